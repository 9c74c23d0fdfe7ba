"""One checkpoint file from ranks that each hold a share of the model: gathered on rank 0 by
``torch.distributed.gather_object`` (pickled, through the process group), against each rank
writing its share as ``torch.distributed.checkpoint`` shards and rank 0 joining them into one file
(:class:`~lightning_antichain.weights.sharded_checkpoint.ShardedCheckpoint`, as ``consolidate``).

Each rank holds ``--megabytes`` of float32 weights and as much again of optimizer state (Adam's
two moments, half each), under the names a Lightning checkpoint gives them. Every way runs in
fresh processes (gloo, 127.0.0.1), in interleaved rounds; the table gives the median wall time of
the save (from the first rank's start to the file written), rank 0's peak resident memory over
what it held before the save (sampled every millisecond), and the file's size; the last column, each way's time over the
gather's. Both files load to the same tensors (checked every round).

    python benchmarks/one_file_save.py --ranks 4 --megabytes 64 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_antichain.weights.sharded_checkpoint import ShardedCheckpoint, save_sharded

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine  # noqa: E402
from ranks import join_group, run_ranks  # noqa: E402

WAYS = ("gather_object", "shards, then one file")


def _share(rank: int, megabytes: int) -> dict:
    """Rank ``rank``'s part of a checkpoint: its stage's weights and their Adam state."""
    generator = torch.Generator().manual_seed(rank)
    count = megabytes * 2**20 // 4 // 8
    weights = {f"model.layers.{rank}.w{i}": torch.randn(count, generator=generator) for i in range(8)}
    state = {rank * 8 + i: {"step": torch.tensor(3.0), "exp_avg": w / 2, "exp_avg_sq": w.abs() / 2}
             for i, w in enumerate(weights.values())}
    return {"state_dict": weights, "optimizer_states": [{"state": state, "param_groups": [{"lr": 1e-3}]}],
            "epoch": 1, "global_step": 10}


def _merge(parts: list[dict]) -> dict:
    whole = dict(parts[0])
    whole["state_dict"] = {k: v for part in parts for k, v in part["state_dict"].items()}
    whole["optimizer_states"] = [{**parts[0]["optimizer_states"][0],
                                  "state": {k: v for p in parts for k, v in p["optimizer_states"][0]["state"].items()}}]
    return whole


class _PeakResident:
    """The most resident memory of this process over what it held at the start, sampled every
    millisecond on a thread while within (the lifetime peak, ``ru_maxrss``, would count what was
    freed before)."""

    def __enter__(self) -> _PeakResident:
        self.start = self.peak = _resident()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _resident())

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _resident())

    @property
    def added_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, ranks: int, port: int, way: str, megabytes: int, folder: str, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    join_group(rank, ranks, port)
    share = _share(rank, megabytes)
    dist.barrier()
    target = Path(folder) / "whole.ckpt"
    with _PeakResident() as peak:
        started = time.perf_counter()
        if way == "gather_object":
            parts: list | None = [None] * ranks if rank == 0 else None
            dist.gather_object(share, parts, dst=0)
            if rank == 0:
                assert parts is not None
                torch.save(_merge(parts), target)
        else:
            shards = Path(folder) / "shards"
            save_sharded(share, shards)
            if rank == 0:  # dcp.save returns on every rank once every rank's shards and the index are written
                torch.save(ShardedCheckpoint(shards).whole(), target)
                shutil.rmtree(shards)
        dist.barrier()
        seconds = time.perf_counter() - started
    if rank == 0:
        results.put((seconds, peak.added_mib, target.stat().st_size / 2**20))
    dist.destroy_process_group()


def save_once(way: str, ranks: int, megabytes: int) -> tuple[float, float, float, dict]:
    """One save by ``way`` in fresh processes: seconds, rank 0's added peak MiB, file MiB, and the file."""
    folder = tempfile.mkdtemp()
    try:
        (got,) = run_ranks(_rank, ranks, way, megabytes, folder, expected=1)
        saved = torch.load(Path(folder) / "whole.ckpt", weights_only=False)
        return (*got, saved)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--megabytes", type=int, default=64, help="weights per rank (optimizer state: as much)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    timings: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        files = {}
        for way in WAYS:
            *numbers, files[way] = save_once(way, args.ranks, args.megabytes)
            timings[way].append(tuple(numbers))
        a, b = (files[way] for way in WAYS)
        assert a["state_dict"].keys() == b["state_dict"].keys() and a["epoch"] == b["epoch"]
        assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
        for i, s in a["optimizer_states"][0]["state"].items():
            assert all(torch.equal(v, b["optimizer_states"][0]["state"][i][k]) for k, v in s.items())
    print(f"# one checkpoint file from {args.ranks} ranks, {args.megabytes} MiB of weights each (and as much "
          f"optimizer state); medians of {args.rounds} interleaved rounds; {machine()}")
    print("| way | save (s) | rank 0's peak memory added (MiB) | file (MiB) | time over gather_object's |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(t[0] for t in timings[WAYS[0]])
    for way in WAYS:
        seconds, peak, size = (statistics.median(t[i] for t in timings[way]) for i in range(3))
        print(f"| {way} | {seconds:.2f} | {peak:.0f} | {size:.0f} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
