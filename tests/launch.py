"""How the tests start processes: a test script's all at once, as torchrun starts them, and a
test's own worker functions forked from a server that imported the package once.

Lightning's own launcher starts a run's other processes when the first reaches ``Trainer.fit``,
after that one's imports (8-10 s on 2 shared cores), so each test would pay the imports twice over.
Tests of what the processes do once they run start them with torchrun (Lightning takes its ranks
from torchrun's environment); tests of how a run starts, fails and stops keep Lightning's launcher
(the failing stage of tests/test_stage_processes_trainer.py, the refusals of
tests/test_process_habits.py, the quick start, tests/test_replicas.py).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_command(script: Path, args: Sequence[str], processes: int) -> list[str]:
    """``python script args``, as ``processes`` processes started together where more than one."""
    if processes <= 1:
        return [sys.executable, str(script), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), str(script), *args]


def processes_of(args: Sequence[str], devices: int = 1) -> int:
    """How many processes tests/scripts/stage_processes.py and habits.py start for ``args`` (``devices``:
    the script's default): one per device, except plain Lightning and the in-process runtime
    (``--schedule none``), which run in one."""
    def value(flag: str, default: str) -> str:
        return args[args.index(flag) + 1] if flag in args else default
    if "--plain" in args or value("--schedule", "1f1b") == "none":
        return 1
    return int(value("--devices", str(devices)))


def process_context():
    """Where the tests' worker functions start: forked from a server process that imported the package
    once (``forkserver``), not each a fresh interpreter importing torch and Lightning again (8-10 s
    on 2 shared cores). The server has run no operation, so each child starts as clean as a spawned one."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["lightning_antichain"])  # (no effect once the server runs)
    return context
