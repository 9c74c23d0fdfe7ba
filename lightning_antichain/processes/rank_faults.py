"""When one stage's process fails, every process stops with that process's error.

A rank whose step raises ends; the ranks waiting on it then fail in torch.distributed with a lost
connection, which says nothing of why. So a rank that raises a step's own error (not a lost
connection) leaves it in the process group's store, which every rank reaches, before it ends; a
rank that loses a connection looks there for a few seconds and raises the failing rank's error
instead (:func:`explained`). The store lives in rank 0's process: where rank 0 fails, it first
closes its connections (the others' waits on it end), and stays until every other rank has read
its error or a few seconds have passed; another rank that fails gives rank 0 a moment to fail too
before it ends, since a launcher may end every process once one has. A rank waiting on rank 0 in
a transfer may only see the connection go when rank 0's process ends (a transfer rank 0 left
pending holds its connections open past ``destroy_process_group``), and the store with it: so
every other rank watches the store while it trains (:class:`FaultWatch`) and has read rank 0's
error by then. A rank that dies without raising (killed, out of memory) leaves nothing: the others
raise the lost connection, as torch reports it.
"""

from __future__ import annotations

import gc
import threading
import time

import torch.distributed as dist

KEY = "lightning_antichain/failed_rank_error"
READ = "lightning_antichain/failed_rank_error_read"
FIRST_FAILED = "lightning_antichain/rank_zero_failed"
WAIT_S = 5.0
_TOLD = "_antichain_told"  # on an error this rank has left in the store
GRACE_S = 2.0


class StageProcessError(RuntimeError):
    """Another stage's process failed; its error, as that process raised it."""


class FaultWatch:
    """A thread that reads a failing rank's error from the store as soon as it is left there, on
    a rank other than 0, and says it read it (rank 0 waits for that before it ends)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        #: the failing rank's error, as it left it; ``None`` until one has
        self.found: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        store = _store()
        if store is None or dist.get_rank() == 0 or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, args=(store,), name="rank-fault-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self, store: dist.Store) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if store.check([KEY]):
                    self.found = store.get(KEY).decode()
                    store.add(READ, 1)
                    return
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing more to read
                return


def explained(error: BaseException, rank: int, watch: FaultWatch | None = None) -> BaseException:
    """The error this rank should raise for ``error``: its own where it is the step's own failure
    (left in the store for the others), else the failing rank's, where one left it in time (or
    ``watch`` read it). The caller must hold no process group of its own then (rank 0 ends them all).
    An error told once is not told again (the runtime tells of one raised in a step when it is
    raised, and of any other when the run stops)."""
    if getattr(error, _TOLD, False):
        return error
    if watch is not None and watch.found is not None and _lost_connection(error):
        return StageProcessError(f"the process of another stage failed, {watch.found}")
    store = _store()
    if store is None:
        return error
    if not _lost_connection(error):
        setattr(error, _TOLD, True)
        cause = error
        while cause.__cause__ is not None:  # torch's stage wraps the user's error in its own
            cause = cause.__cause__
        notes = [n for e in {id(error): error, id(cause): cause}.values() for n in getattr(e, "__notes__", ())]
        try:
            store.set(KEY, "\n".join([f"rank {rank}: {type(cause).__name__}: {cause}", *notes]))
            if rank == 0:
                store.set(FIRST_FAILED, "1")
                _wait_until_read(store)
            else:  # this rank's error is its own; it need not read another's
                store.add(READ, 1)
                _wait_for_first(store)
        except Exception:  # noqa: BLE001 - the store's host may be gone too; the error is raised as it is
            return error
        return error
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if store.check([KEY]):
                found = StageProcessError(f"the process of another stage failed, {store.get(KEY).decode()}")
                store.add(READ, 1)
                return found
        except Exception:  # noqa: BLE001 - the store lives in rank 0's process, which may be the one gone
            return error
        time.sleep(0.1)
    return error


def _wait_for_first(store: dist.Store) -> None:
    """A few seconds for rank 0 to fail too, where it raises the same error (a refusal every rank
    makes): a launcher that ends every process once one has ended (Lightning's) would otherwise
    end rank 0 before it says why."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and not store.check([FIRST_FAILED]):
        time.sleep(0.05)


def _wait_until_read(store: dist.Store) -> None:
    """On rank 0, whose process holds the store: end every process group, so that the ranks
    waiting on this one fail now, and wait until each has read the error (or ``WAIT_S`` passed)."""
    others = dist.get_world_size() - 1
    dist.destroy_process_group()
    gc.collect()  # a process group's connections close when its last reference goes
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if store.add(READ, 0) >= others:
                return
        except Exception:  # noqa: BLE001
            return
        time.sleep(0.05)


def _store() -> dist.Store | None:
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None


def _lost_connection(error: BaseException) -> bool:
    """Whether ``error``, or one it was raised from (torch's stage wraps what its forward raised),
    is a lost connection to another rank."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if isinstance(current, dist.DistBackendError) or any(
                sign in text for sign in ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                                          "NCCL")):
            return True
        current = current.__cause__
    return False
