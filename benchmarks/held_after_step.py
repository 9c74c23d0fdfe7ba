"""What autograd still holds after each step of torch's schedules: nothing, on any rank.

Plain torch.distributed.pipelining, no lightning-antichain code in the pipeline: two gloo
processes, one ``PipelineStage`` each over a small MLP, 8 micro-batches, and what autograd still
holds after each step (after ``gc.collect()``), counted by the saved-tensor hooks of
:class:`~lightning_antichain.measure.saved_tensors.HeldMemory`, under 1F1B and ZB-H1
(``ScheduleInterleavedZeroBubble``). An earlier version of those hooks kept each saved tensor with
its autograd node, a cycle the collector cannot break: a graph whose backward never ran (torch's
trial forward before the first step) stayed counted on the first rank, and under ZB-H1 the last
rank's count grew every step, which this script once showed and docs/benchmark-runs.md took for a
leak in torch. It now checks that nothing is left.

    python benchmarks/held_after_step.py
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import join_group, run_ranks  # noqa: E402

STEPS, CHUNKS, WIDTH = 4, 8, 256


def rank_main(rank: int, ranks: int, port: int, kind: str, results: mp.Queue) -> None:
    from lightning_antichain.measure.saved_tensors import HeldMemory, state_storages

    torch.set_num_threads(1)
    join_group(rank, ranks, port)
    try:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        schedule = (ScheduleInterleavedZeroBubble([stage], CHUNKS, loss_fn=_loss, scale_grads=False)
                    if kind == "zb-h1" else Schedule1F1B(stage, CHUNKS, loss_fn=_loss, scale_grads=False))
        held = HeldMemory(excluded=state_storages(module))
        x, y = torch.randn(8 * CHUNKS, WIDTH), torch.randn(8 * CHUNKS, WIDTH)
        after = []
        for _ in range(STEPS):
            with held.saving():
                schedule.step(x) if rank == 0 else schedule.step(target=y)
            gc.collect()
            after.append(held.current_bytes)
        results.put((kind, rank, after))
    finally:
        dist.destroy_process_group()


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def main() -> None:
    print(f"torch {torch.__version__}; 2 gloo processes, {CHUNKS} micro-batches of 8 x {WIDTH}; bytes autograd "
          "still holds after each step\n")
    print("| schedule | rank | " + " | ".join(f"after step {i + 1}" for i in range(STEPS)) + " |")
    print("|---|---|" + "---|" * STEPS)
    for kind in ("1f1b", "zb-h1"):
        rows = sorted(run_ranks(rank_main, 2, kind, expected=2))
        for name, rank, after in rows:
            print(f"| {name} | {rank} | " + " | ".join(str(b) for b in after) + " |")


if __name__ == "__main__":
    main()
