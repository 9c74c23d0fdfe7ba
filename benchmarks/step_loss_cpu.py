"""The training step's loss charged to the last stage, against the cut that leaves it out (CPU processes).

With one process per stage the last stage's rank computes the loss of every micro-batch's output,
beyond the model. The strategy times it from ``training_step`` and charges it to the output it
reads (``lightning_antichain/processes/step_loss.py``), so the cut gives that stage less. Here rank
0 plans a pipeline of ``--ranks`` processes under 1F1B twice, as the strategy's layout search does
(its micro-batch count chosen too), from the same profiles: without the loss (as the strategy did
before) and with it; every rank builds both and trains AdamW steps with each in turns.
Printed: the loss's share of the model's forward and backward on a micro-batch of ``--share-samples``
(timed as the planner times it), each cut's predicted and measured step, each rank's actions
(what it computes, its waits left out) against the cut's prediction, and the measured steps'
ratio, the median of interleaved rounds.

    python benchmarks/step_loss_cpu.py --model decoder8k --ranks 4 --repeats 7
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_models import build, loss_of  # noqa: E402
from harness import heading  # noqa: E402
from layouts_cpu import _probes, on_cpu, train_step  # noqa: E402
from ranks import join_group, run_ranks  # noqa: E402


def rank_main(rank: int, ranks: int, port: int, args: argparse.Namespace, cache: str, results: mp.Queue) -> None:
    from lightning_antichain.capture import capture_call
    from lightning_antichain.cpu_allocator import keep_freed_memory
    from lightning_antichain.planner.layout_cost import measured_links
    from lightning_antichain.planner.layout_search import LayoutSearch, plan_layouts
    from lightning_antichain.planner.overhead import loss_seconds
    from lightning_antichain.plans.options import PipelineOptions
    from lightning_antichain.plans.plan import Plan
    from lightning_antichain.plans.process_schedules import process_schedule
    from lightning_antichain.processes.process_pipeline import ProcessPipeline

    torch.set_num_threads(1)
    keep_freed_memory()
    torch.set_flush_denormal(True)  # as benchmarks/layouts_cpu.py, whose docstring says why
    join_group(rank, ranks, port)
    cpu = torch.device("cpu")
    try:
        model, x, y = build(args.model, cpu)
        loss_fn = loss_of(args.model)
        schedule = process_schedule("1f1b")
        probes = _probes(model, x, y, loss_fn, ranks, [ranks])
        sent: list = [None]
        if rank == 0:
            share = (x[:args.share_samples],), y[:args.share_samples]
            forward_s, backward_s = loss_seconds(model, share[0], {}, lambda out: loss_fn(out, share[1][:len(out)]))
            whole = []
            for _ in range(5):
                started = time.perf_counter()
                loss_fn(model(*share[0]), share[1]).backward()
                whole.append(time.perf_counter() - started)
                model.zero_grad(set_to_none=True)
            alone = statistics.median(whole[1:])
            print(f"step_loss_cpu: {args.model}, {args.share_samples} samples: the loss {1e3 * forward_s:.1f} ms "
                  f"forward, {1e3 * backward_s:.1f} ms backward; the model with it {1e3 * alone:.1f} ms forward and "
                  f"backward: the loss {(forward_s + backward_s) / alone:.2f} of it", flush=True)
            options = PipelineOptions(profile_cache=Path(cache), progress=False)
            search = LayoutSearch(ranks, (schedule,))
            links = measured_links(ranks, probes[0])

            def planned(loss):
                return plan_layouts(model, (x,), {}, ranks, on_cpu, search, links, options,
                                    optimizers=[torch.optim.AdamW(model.parameters())], shared_cores=probes[1],
                                    loss=loss).plan

            plans = [planned(None), planned(lambda out: loss_fn(out, y[:len(out)]))]
            sent = [[plan.to_dict() for plan in plans]]
        dist.broadcast_object_list(sent, src=0)
        plans = [Plan.from_dict(p) for p in sent[0]]

        def built(plan: Plan):
            own = copy.deepcopy(model)
            graph = capture_call(own, (x[:len(x) // plan.chunks],), {})
            pipeline = ProcessPipeline(graph, plan, schedule, rank, ranks, cpu)
            optimizer = torch.optim.AdamW(pipeline.parameters())
            calls = [((m,), {}) for m in x.chunk(plan.chunks)] if pipeline.holds_first else None
            return functools.partial(train_step, pipeline, optimizer, calls, y.chunk(plan.chunks), loss_fn,
                                     plan.chunks)

        steps = [built(plan) for plan in plans]
        times: list[list[float]] = [[] for _ in plans]
        busy: list[list[torch.Tensor]] = [[] for _ in plans]
        for repeat in range(args.repeats + 1):
            for step, taken, actions in zip(steps, times, busy):
                dist.barrier()
                started = time.perf_counter()
                _, busy_s = step()
                mine = torch.tensor([time.perf_counter() - started, busy_s])
                each = [torch.zeros(2) for _ in range(ranks)]
                dist.all_gather(each, mine)
                if repeat:  # the first learns the shapes
                    taken.append(float(torch.stack(each)[:, 0].max()))
                    actions.append(torch.stack(each)[:, 1])
        if rank == 0:
            for name, plan, taken, actions in zip(("without the loss", "with the loss"), plans, times, busy):
                predicted = plan.layouts and next(r for r in plan.layouts if "lost" not in r)
                results.put((name, f"{plan.balance}, {plan.chunks} micro-batches", plan.predicted_step_s,
                             statistics.median(taken),
                             torch.stack(actions).median(0).values.tolist(),
                             predicted.get("rank_busy_s") if predicted else None, taken))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="decoder8k")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--share-samples", type=int, default=8, help="the micro-batch the loss's share is timed on")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        rows = run_ranks(rank_main, args.ranks, args, cache, expected=2)
    print(heading(f"{args.ranks} gloo processes, one intra-op thread each, {args.model}, pp="
          f"{args.ranks} under 1F1B, AdamW, the batch of 32; median of {args.repeats} "
          "interleaved steps", threads=1))
    print("| cut | operations per stage, micro-batches | predicted ms | measured ms | measured / predicted "
          "| each rank's actions ms (predicted) |")
    print("|---|---|---|---|---|---|")
    for name, balance, predicted, measured, actions, predicted_busy, _ in rows:
        each = ", ".join(f"{1e3 * a:.0f}" + ("" if not predicted_busy else f" ({1e3 * p:.0f})")
                         for a, p in zip(actions, predicted_busy or [None] * len(actions)))
        print(f"| {name} | {balance} | {1e3 * predicted:.1f} | {1e3 * measured:.1f} | {measured / predicted:.2f} "
              f"| {each} |")
    (_, _, _, _, _, _, without), (_, _, _, _, _, _, charged) = rows
    ratios = [a / b for a, b in zip(without, charged)]
    print(f"\nThe cut without the loss over the cut with it, measured in the same rounds: median "
          f"{statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
