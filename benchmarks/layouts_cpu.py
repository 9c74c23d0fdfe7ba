"""Every layout of replicas x stages of a few CPU processes, measured against the planner's predictions,
with the one ``pipeline_parallel_size="auto"`` chooses marked.

Rank 0 plans each layout ``dp x pp`` of the ranks as ``pipeline_parallel_size="auto"`` weighs it (every schedule
and micro-batch count, :func:`~lightning_antichain.planner.layout_search.plan_layouts` with the
processes per pipeline fixed), and once more with the layout free: the auto choice. Every rank
then builds each layout on a copy of the model of its own (a ``(dp, pp)`` DeviceMesh, its stages
under the planned schedule over ``"pp"``, DDP over ``"dp"`` or FSDP2 gathering as the plan chose,
each replica running its share of the batch) and trains AdamW steps, the layouts taking turns so
that a machine getting busier or quieter weighs on all alike. A step is the slowest rank's:
forward, backward, the replicas' reduction and the optimizer step. The batch is the same whole
batch in every layout.

    python benchmarks/layouts_cpu.py --ranks 4 --models gpt,resnet50 --repeats 5
    python benchmarks/layouts_cpu.py --ranks 4 --models gpt --replication ddp,fsdp
    python benchmarks/layouts_cpu.py --ranks 4 --models mlp,mobilenetv3,decoder8k   # models it was not tuned on
    python benchmarks/layouts_cpu.py --ranks 4 --models gpt --blocks 4   # turns against steps back to back

Every rank flushes denormal floats to zero (``torch.set_flush_denormal``) unless ``--keep-denormals``:
each layout trains its copy of the model on the same batch again and again, so within a few steps
the loss falls to 1e-7 and the wrong classes' probabilities underflow: the logits' gradient, and
from it the weights', hold denormal numbers, and on x86 a backward over them runs several times
slower than the profile of the fresh model, by an amount that changes from step to step. That is
the trained weights' cost, not the layout's, and no profile taken before training can know it;
flushed, the benchmark measures what the cost model predicts (``--keep-denormals`` shows the rest).
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
from ranks import join_group, run_ranks  # noqa: E402


def rank_main(rank: int, ranks: int, port: int, args: argparse.Namespace, cache: str, results: mp.Queue) -> None:
    from lightning_antichain.cpu_allocator import keep_freed_memory
    from lightning_antichain.planner.layout_search import layout_search

    torch.set_num_threads(1)
    keep_freed_memory()  # as the strategy's CPU ranks do
    torch.set_flush_denormal(not args.keep_denormals)
    join_group(rank, ranks, port)
    cpu = torch.device("cpu")
    try:
        for model_name in args.models.split(","):
            model, x, y = build(model_name, cpu)
            loss_fn = loss_of(model_name)
            free = layout_search("auto", "auto", None)
            counts = free.pipeline_counts(ranks)
            # as the strategy does before it plans a layout on CPU processes
            planned = _probes(model, x, y, loss_fn, ranks, counts)
            for how in args.replication.split(","):
                _measure(rank, ranks, model_name, model, x, y, loss_fn, how, free, counts, planned, cache, args,
                         results)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, ranks: int, model_name: str, model, x, y, loss_fn, how: str, free, counts,
             link: tuple, cache: str, args: argparse.Namespace, results: mp.Queue) -> None:
    """Plan every layout kept in step by ``how`` (and the free choice) on rank 0, then train each, in turns."""
    from lightning_antichain.capture import capture_call
    from lightning_antichain.planner.layout_cost import measured_links
    from lightning_antichain.planner.layout_search import LayoutSearch, plan_layouts
    from lightning_antichain.plans.layout import Layout
    from lightning_antichain.plans.options import PipelineOptions
    from lightning_antichain.plans.plan import Plan
    from lightning_antichain.plans.process_schedules import process_schedule
    from lightning_antichain.processes.layout_trials import timed_in_turns, trial_report
    from lightning_antichain.processes.process_pipeline import ProcessPipeline

    cpu = torch.device("cpu")
    sent: list = [None]
    if rank == 0:
        options = PipelineOptions(profile_cache=Path(cache), progress=False)
        optimizers = [torch.optim.AdamW(model.parameters())]
        searches = [free, *(LayoutSearch(pp, free.schedules) for pp in counts)]
        # the first profiles every micro-batch size once; the others read the profiles back
        links = measured_links(ranks, link[0])
        free_planned, *per_layout = [plan_layouts(model, (x,), {}, ranks, on_cpu, search, links, options,
                                                  optimizers=optimizers, replication=how, shared_cores=link[1],
                                                  loss=lambda out: loss_fn(out, y[:len(out)]),
                                                  alternatives=args.trials - 1 if search is free else 0)
                                     for search in searches]
        chosen, per_layout = free_planned.plan, [planned.plan for planned in per_layout]
        trial_plans = [chosen, *free_planned.alternatives]
        # the free choice's layout runs the free choice itself (the per-layout search, timing the
        # optimizer again, may break a near tie between schedules the other way)
        runs = {pp: (chosen if pp == chosen.layout["pp"] else plan) for pp, plan in zip(counts, per_layout)}
        probed = link[1]
        if probed is not None and probed.model_alone_s:
            # both time one rank's step alone on a replica's share: the profile in planning (its ops
            # added up, the loss with them), the ranks' probe just before it; the search then scales
            # the profiles halfway (geometrically) to the probe: by sqrt(probe / profile)
            scaled_by = next((r["profile_scaled_by"] for r in chosen.layouts if "profile_scaled_by" in r), 1.0)
            profiled = probed.model_alone_s / scaled_by ** 2
            print(f"layouts_cpu: {model_name} {how}: one rank's step alone on {len(x) // ranks} samples, the "
                  f"profile's {1e3 * profiled:.1f} ms, the probe's {1e3 * probed.model_alone_s:.1f} "
                  f"ms, both with the loss ({profiled / probed.model_alone_s:.2f}); the search scaled the "
                  f"profiles by {scaled_by:.2f}", flush=True)
        for row in chosen.layouts:  # where the cores' sharing moving either way turned the choice
            if row.get("lost", "").startswith("faster"):
                print(f"layouts_cpu: {model_name} {how}: auto took dp={chosen.layout['dp']} x pp={chosen.layout['pp']} "
                      f"{chosen.layout['schedule']} over dp={row['dp']} x pp={row['pp']} {row['schedule']} "
                      f"{row['chunks']} chunks: {row['lost']}", flush=True)
        sent = [({pp: plan.to_dict() for pp, plan in runs.items()}, chosen.layout, [p.to_dict() for p in trial_plans])]
    dist.broadcast_object_list(sent, src=0)
    plans, auto, trial_plans = sent[0]
    trial_plans = [Plan.from_dict(p) for p in trial_plans]

    def built(plan: Plan):
        """This rank's training step of ``plan`` in its layout, on a copy of the model of its own."""
        chosen_layout = plan.layout
        layout = Layout(chosen_layout["dp"], chosen_layout["pp"])
        schedule = process_schedule(chosen_layout["schedule"], chosen_layout["virtual_stages"])
        mesh = layout.mesh("cpu")
        replica, position = layout.replica(rank), layout.position(rank)
        share = len(x) // layout.dp
        xs, ys = x[replica * share:(replica + 1) * share], y[replica * share:(replica + 1) * share]
        own = copy.deepcopy(model)  # DDP's hooks stay on a model's parameters: one model per layout
        graph = capture_call(own, (xs[:share // plan.chunks],), {})
        pipeline = ProcessPipeline(graph, plan, schedule, position, layout.pp, cpu,
                                   group=mesh["pp"].get_group() if layout.dp > 1 else None,
                                   replication=(how, mesh["dp"]) if layout.dp > 1 else None,
                                   regather=plan.regather or "step")
        optimizer = torch.optim.AdamW(pipeline.parameters())
        micro_x, micro_y = xs.chunk(plan.chunks), ys.chunk(plan.chunks)
        calls = [((m,), {}) for m in micro_x] if pipeline.holds_first else None

        return functools.partial(train_step, pipeline, optimizer, calls, micro_y, loss_fn, plan.chunks)

    timed = auto
    if len(trial_plans) > 1:  # as the strategy does with layout_trials: each built, stepped in turns
        steps = [built(plan) for plan in trial_plans]
        turns = timed_in_turns(steps, cpu)
        kept = turns.quickest
        timed = trial_plans[kept].layout
        del steps
        if rank == 0:
            print(f"layouts_cpu: {model_name} {how}: {trial_report(trial_plans, turns)}", flush=True)
            print(f"layouts_cpu: {model_name} {how}: the turns' steps, ms: " + "; ".join(
                ", ".join(f"{1e3 * t:.0f}" for t in taken) for taken in turns.seconds), flush=True)
    runs = {pp: (built(plan := Plan.from_dict(plans[pp])), plan, plan.layout) for pp in counts}
    if args.blocks > 1:
        _back_to_back(model_name, how, {pp: step for pp, (step, _, _) in runs.items()}, args.blocks, rank)
    times: dict[int, list[torch.Tensor]] = {pp: [] for pp in runs}
    per_rank: dict[int, list[torch.Tensor]] = {pp: [] for pp in runs}  # each round: [rank, (step, optimizer, busy)]
    # each round's measured / predicted from the probes taken just before it
    again: dict[int, list[float]] = {pp: [] for pp in runs}
    # each round's probes: one rank's step alone, the ranks' capacity, a send's latency
    alone: list[tuple[float, float, float]] = []
    for repeat in range(args.repeats + 1):
        probes = None
        if repeat:  # the machine just before the round: the probes again, every layout predicted from them
            probes = _probes(model, x, y, loss_fn, ranks, counts)
            alone.append((probes[1].model_alone_s or 0.0, probes[1].model or 0.0, probes[0]["send"].latency_s))
        for pp, (step, _, _) in runs.items():
            dist.barrier()
            started = time.perf_counter()
            optimizer_s, busy_s = step()
            # the step, its optimizer's part, the rank's actions
            mine = torch.tensor([time.perf_counter() - started, optimizer_s, busy_s])
            each = [torch.zeros(3) for _ in range(ranks)]
            dist.all_gather(each, mine)
            elapsed = torch.stack(each).amax(0)
            if repeat:
                times[pp].append(elapsed)
                per_rank[pp].append(torch.stack(each))
        if probes is not None and rank == 0:
            for pp, (_, plan, chosen_layout) in runs.items():
                predicted = repredicted(plan, chosen_layout, how, link, probes, ranks)
                again[pp].append(float(times[pp][-1][0]) / predicted)
    if rank == 0 and all(again.values()):
        # the layout the cost model ranks first from each round's probes, against that round's best measured
        picked = []
        for r in range(args.repeats):
            step = {pp: float(times[pp][r][0]) for pp in runs}
            first = min(runs, key=lambda pp: step[pp] / again[pp][r])
            picked.append(step[first] / min(step.values()))
        print(f"layouts_cpu: {model_name} {how}: the layout predicted fastest from each round's probes, against "
              f"that round's fastest: {', '.join(f'{p:.2f}' for p in picked)} (median "
              f"{statistics.median(picked):.2f})", flush=True)
    if rank == 0 and link[1].model_alone_s:
        steps, capacities, sends = zip(*alone)
        print(f"layouts_cpu: {model_name} {how}: the probes before planning and before each round: one rank's step "
              f"alone {1e3 * link[1].model_alone_s:.1f} ms, then {', '.join(f'{1e3 * a:.1f}' for a in steps)} "
              f"(median {statistics.median(steps) / link[1].model_alone_s:.2f} of before); the ranks' capacity "
              f"{link[1].model or 0.0:.2f}, then {', '.join(f'{c:.2f}' for c in capacities)}; a send's latency "
              f"{1e3 * link[0]['send'].latency_s:.2f} ms, then {', '.join(f'{1e3 * t:.2f}' for t in sends)}",
              flush=True)
    if rank == 0:
        for pp, (_, plan, chosen_layout) in runs.items():
            best = min((r for r in plan.layouts if r.get("predicted_step_s") is not None and "lost" not in r),
                       key=lambda r: r["predicted_step_s"])
            same = repredicted(plan, chosen_layout, how, link, link, ranks)  # the planner's own, recomputed
            if abs(same / best["predicted_step_s"] - 1) > 0.01:
                print(f"layouts_cpu: {model_name} dp={chosen_layout['dp']}: the prediction recomputed from the "
                      f"planning probes is {same:.4f} s, the planner's {best['predicted_step_s']:.4f} s", flush=True)
            results.put((model_name, link, chosen_layout, plan.chunks, best["predicted_step_s"],
                         (best.get("reduction_s", 0.0), best.get("optimizer_s", 0.0)),
                         statistics.median(float(t[0]) for t in times[pp]),
                         (_same(chosen_layout, auto), chosen_layout["dp"] == timed["dp"]), how,
                         statistics.median(float(t[1]) for t in times[pp]), statistics.median(again[pp]),
                         _by_position(torch.stack(per_rank[pp]).median(0).values, chosen_layout),
                         best.get("rank_optimizer_s") or [], best.get("rank_end_s") or [],
                         best.get("rank_busy_s") or []))


def _back_to_back(model_name: str, how: str, steps: dict, block: int, rank: int, blocks: int = 4) -> None:
    """Whether timing the layouts in turns (as the trials and the rounds do) measures what training
    one layout step after step gets: each layout's steps in blocks of ``block`` back to back (the
    first of each untimed), the blocks taking turns, against as many steps taking turns one by one."""
    def timed(step) -> float:
        dist.barrier()
        started = time.perf_counter()
        step()
        dist.barrier()
        return time.perf_counter() - started

    in_turns: dict[int, list[float]] = {pp: [] for pp in steps}
    by_place: dict[int, list[list[float]]] = {pp: [[] for _ in range(block)] for pp in steps}  # [place in block]
    for _ in range(blocks):
        for pp, step in steps.items():
            for place in by_place[pp]:
                place.append(timed(step))
        for _ in range(block - 1):
            for pp, step in steps.items():
                in_turns[pp].append(timed(step))
    in_blocks = {pp: [t for place in places[1:] for t in place] for pp, places in by_place.items()}
    if rank == 0:
        def medians(times: dict[int, list[float]]) -> str:
            return ", ".join(f"pp={pp} {1e3 * statistics.median(t):.1f}" for pp, t in times.items())
        ratios = ", ".join(f"pp={pp} {statistics.median(in_blocks[pp]) / statistics.median(in_turns[pp]):.2f}"
                           for pp in steps)
        print(f"layouts_cpu: {model_name} {how}: {block} steps back to back, in blocks taking turns, ms: "
              f"{medians(in_blocks)}; one by one taking turns: {medians(in_turns)} (back to back over in turns: "
              f"{ratios})", flush=True)
        print(f"layouts_cpu: {model_name} {how}: each step of a block, ms: " + "; ".join(
            f"pp={pp} " + ", ".join(f"{1e3 * statistics.median(t):.1f}" for t in places)
            for pp, places in by_place.items()), flush=True)


def _same(layout: dict, other: dict) -> bool:
    return all(layout.get(k) == other.get(k) for k in ("dp", "schedule", "regather"))


def _by_position(medians: torch.Tensor, chosen_layout: dict) -> list[tuple[float, ...]]:
    """Each pipeline position's slowest replica: its step's end, its optimizer's part and its
    actions' part, seconds."""
    from lightning_antichain.plans.layout import Layout

    layout = Layout(chosen_layout["dp"], chosen_layout["pp"])
    return [tuple(float(v) for v in medians[[layout.rank(d, p) for d in range(layout.dp)]].amax(0))
            for p in range(layout.pp)]


def _probes(model, x, y, loss_fn, ranks: int, counts: list[int]) -> tuple:
    """What every rank measures before rank 0 plans (as the strategy does): each collective's
    speed, and what the ranks get through at once running the model and stepping AdamW (on the
    share of the parameters each rank steps in a pipeline of each of ``counts`` ranks; FSDP2's
    shares, ``pp * dp``, are the ranks, among them), the model's step from its loss, as the
    search charges it."""
    from lightning_antichain.measure.link_speed import measured_collectives
    from lightning_antichain.planner.shared_cores import shared_cores

    cpu = torch.device("cpu")
    return (measured_collectives(cpu),
            shared_cores(model, (x[:len(x) // ranks],), {}, [torch.optim.AdamW(model.parameters())],
                         shares=counts, loss=lambda out: loss_fn(out, y[:len(out)])))


def repredicted(plan, chosen_layout: dict, how: str, planned: tuple, probes: tuple, ranks: int) -> float:
    """The step the cost model predicts for ``plan``'s cut in its layout from ``probes`` (taken
    now) in place of the ``planned`` ones (before planning): the collectives' speeds and the
    ranks' capacities as measured now, the profile's times scaled by how much slower one rank
    alone ran the model (and stepped the optimizer) now than then."""
    import dataclasses

    from lightning_antichain.planner.contention import capacity_of_two
    from lightning_antichain.planner.layout_cost import layout_cost, measured_links
    from lightning_antichain.planner.shared_cores import share_of
    from lightning_antichain.plans.layout import Layout
    from lightning_antichain.plans.process_schedules import process_schedule

    (_, then), (collectives, now) = planned, probes

    def ratio(new, old) -> float:
        return new / old if new and old else 1.0

    speed, optimizer_speed = ratio(now.model_alone_s, then.model_alone_s), ratio(now.optimizer_alone_s,
                                                                                  then.optimizer_alone_s)

    def scaled(value):
        return None if value is None else value * speed

    stages = [dataclasses.replace(s, forward_s=s.forward_s * speed, backward_s=s.backward_s * speed,
                                  backward_input_s=scaled(s.backward_input_s),
                                  backward_weight_s=scaled(s.backward_weight_s)) for s in plan.stages]
    cores = plan.cpu_cores or ranks
    layout = Layout(chosen_layout["dp"], chosen_layout["pp"])
    plan = dataclasses.replace(
        plan, stages=stages, optimizer_step_s=plan.optimizer_step_s * optimizer_speed,
        parallel_capacity=capacity_of_two(now.model, ranks, cores) if now.model else plan.parallel_capacity,
        optimizer_slowdown=ranks / optimizer if (optimizer := now.optimizer_at(share_of(layout, how)))
        else plan.optimizer_slowdown)
    schedule = process_schedule(chosen_layout["schedule"], chosen_layout["virtual_stages"])
    return layout_cost(plan, schedule, layout, measured_links(ranks, collectives), how,
                       chosen_layout.get("regather") or "step").step_s


def on_cpu(layout, schedule) -> list[torch.device]:
    return [torch.device("cpu")] * schedule.num_stages(layout.pp)


def train_step(pipeline, optimizer, calls, targets, loss_fn, chunks: int) -> tuple[float, float]:
    """One step of a layout's pipeline: its share of the batch, the replicas' reduction, AdamW;
    returns the seconds of the optimizer's part, and of the rank's actions (its step less its
    waits for other ranks' values, as torch's schedule waits for them: :class:`ActionClock`)."""
    from lightning_antichain.measure.action_clock import ActionClock

    clock = ActionClock(torch.device("cpu"))
    pipeline.run("step", calls, lambda out, m: loss_fn(out, targets[m]) / chunks, chunks, train=True, clock=clock)
    started = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started, chunks * sum(clock.steps[-1].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="gpt,resnet50")
    parser.add_argument("--replication", default="ddp", help="ddp, fsdp, or both: ddp,fsdp")
    parser.add_argument("--trials", type=int, default=2,
                        help="layout_trials: time this many of the layouts predicted fastest, as the strategy does")
    parser.add_argument("--blocks", type=int, default=0,
                        help="before the rounds, time each layout's steps this many back to back, in blocks taking "
                             "turns, against the same count taking turns one by one")
    parser.add_argument("--keep-denormals", action="store_true",
                        help="compute with denormal floats as they come (see the module's docstring)")
    args = parser.parse_args()
    layouts_per_model = sum(1 for n in range(1, args.ranks + 1) if args.ranks % n == 0) * len(
        args.replication.split(","))
    rows = []
    for model_name in args.models.split(","):  # fresh processes for each model, as a training run starts
        one = argparse.Namespace(**{**vars(args), "models": model_name})
        with tempfile.TemporaryDirectory() as cache:
            rows += run_ranks(rank_main, args.ranks, one, cache, expected=layouts_per_model)
    print(heading(f"{args.ranks} gloo processes, one intra-op thread each, AdamW, the batch of 32 "
          f"split over the replicas; denormals {'kept' if args.keep_denormals else 'flushed to zero'}; median of "
          f"{args.repeats} interleaved steps", threads=1))
    print("| model | replicas | layout | schedule | chunks | predicted ms | of it, replicas ms | measured ms "
          "| of it, optimizer ms (predicted, measured) | measured / predicted | over the model's median "
          "| the same, probes each round | measured / best measured | auto | auto, timed "
          "| link GB/s "
          "| a collective ms | ranks' capacity | each position: step end, optimizer, actions ms (predicted) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    within, relative, picks, timed_picks = [], [], [], []
    for model_name in args.models.split(","):
        for how in args.replication.split(","):
            mine = [r for r in rows if r[0] == model_name and r[8] == how]
            best = min(r[6] for r in mine)
            typical = statistics.median(r[6] / r[4] for r in mine)  # the machine's speed since planning, as one
            for _, (link, capacity), layout, chunks, predicted, (reduction, planned_optimizer), measured, \
                    (auto, timed), _, \
                    optimizer_s, per_round, positions, planned_positions, planned_ends, planned_busy in sorted(
                    mine, key=lambda r: r[2]["pp"]):
                schedule = layout["schedule"] + (
                    f" (v={layout['virtual_stages']})" if layout["virtual_stages"] > 1 else "")
                kept = how if layout["dp"] == 1 or how == "ddp" else f"fsdp, {layout.get('regather')}"
                print(f"| {model_name} | {kept} | dp={layout['dp']} x pp={layout['pp']} | {schedule} | {chunks} "
                      f"| {1e3 * predicted:.1f} | {1e3 * reduction:.1f} | {1e3 * measured:.1f} "
                      f"| {1e3 * planned_optimizer:.1f}, {1e3 * optimizer_s:.1f} "
                      f"| {measured / predicted:.2f} | {measured / predicted / typical:.2f} "
                      f"| {per_round:.2f} | {measured / best:.2f} "
                      f"| {'chosen' if auto else ''} | {'chosen' if timed else ''} "
                      f"| {_speeds(link, 'gbps', 1.0)} | {_speeds(link, 'latency_s', 1e3)} "
                      f"| {_capacity(capacity.model)}, {_capacity(capacity.optimizer)} "
                      f"| {_positions(positions, planned_positions, planned_ends, planned_busy, predicted)} |")
                within.append(BAND[0] <= measured / predicted <= BAND[1])
                relative.append(BAND[0] <= measured / predicted / typical <= BAND[1])
                if auto:
                    picks.append(measured / best)
                if timed:
                    timed_picks.append(measured / best)
    print(f"\nWithin {BAND[0]}-{BAND[1]} of the prediction before planning: {sum(within)} of {len(within)} rows; "
          f"over their model's median: {sum(relative)} of {len(relative)}. `auto` against the best measured: "
          + ", ".join(f"{p:.2f}" for p in picks) + f"; with layout_trials={args.trials} (the {args.trials} layouts "
          "predicted fastest timed in turns before the rounds, as the strategy times them before training): "
          + ", ".join(f"{p:.2f}" for p in timed_picks))
    print("\nLink GB/s and a collective's ms: all-reduce, all-gather, reduce-scatter, each fitted to back-to-back runs "
          "at two sizes; the ranks' capacity: the work all ranks get through at once in units of one alone, "
          "running the model and stepping AdamW. \"The same, probes each round\": the median over the measured "
          "rounds of each round's step over the prediction for the same cut from the probes taken just before "
          "that round (the machine's speed then: the profile's times scaled by one rank's time alone then over "
          "before planning), which tells the cost model's error from the machine's drift. \"Over the model's median\": "
          "measured / predicted over its median among the model's layouts, the layouts' costs relative to each "
          "other (what the choice rests on), whatever the machine's speed did between planning and measuring. "
          "Each position: the pipeline "
          "position's slowest replica, the median of its step's end (the optimizer's included) and of its "
          "optimizer's part and of its actions' part (the step less its optimizer and its waits for other ranks, "
          "as torch's schedule waits), with the cost model's (its tasks' timeline's end, the optimizer's part, "
          "its tasks' durations; * where all ranks' work over the shared cores' capacity, not the timeline, set "
          "the predicted step)")


#: the band a layout's measured / predicted step should fall in (issue 50)
BAND = (0.85, 1.15)


def _positions(measured: list[tuple[float, ...]], optimizers: list[float], ends: list[float], busy: list[float],
               step: float) -> str:
    """Each pipeline position's measured step end, optimizer part and actions' part, with the
    predicted ones (the end as its tasks' timeline says); a ``*`` where the shared cores' bound,
    not the timeline, set the predicted step."""
    bound = "*" if ends and step > max(ends) * 1.001 else ""

    def predicted(p: int) -> str:
        found = [f"{1e3 * ends[p]:.0f}{bound}" if p < len(ends) else "-",
                 f"{1e3 * optimizers[p]:.0f}" if p < len(optimizers) else "-",
                 f"{1e3 * busy[p]:.0f}" if p < len(busy) else "-"]
        return ", ".join(found)

    return "; ".join(f"{1e3 * end:.0f}, {1e3 * optimizer:.0f}, {1e3 * acting:.0f} ({predicted(p)})"
                     for p, (end, optimizer, acting) in enumerate(measured))


def _capacity(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _speeds(link: dict, field: str, scale: float) -> str:
    return ", ".join(f"{scale * getattr(speed, field):.2f}" for speed in link.values())


if __name__ == "__main__":
    main()
