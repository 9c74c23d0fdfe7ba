"""Stages as processes on the CPU: each of torch's schedules on the plan's stages, one gloo process
per rank, with its step time and what each rank keeps for backward at its peak.

Rank 0 profiles and plans (the DP, ``chunks`` micro-batches) and sends the plan to every rank; each
rank builds and places its own stages only (:func:`~lightning_antichain.processes.process_stages.rank_stages`)
and runs torch's schedule. Steps of the schedules take turns, and each time is the median over the
repeats of the slowest rank's step. The memory is what autograd saves during a step on each rank
(:class:`~lightning_antichain.measure.saved_tensors.HeldMemory`; torch's own copies of the stage
outputs are not in it), against the plan's activations per micro-batch of each stage, weighed by
the micro-batches torch's table of tasks keeps in flight on the rank's stages at its peak
(:func:`~lightning_antichain.plans.schedule.held_at_peak`; a zero-bubble schedule's keep their
activations until the weights' gradient). In the same rounds, rank 0 runs two baselines while the
other ranks wait: the in-process runtime (``la.Pipeline`` on the GPipe plan, one worker thread of
one intra-op thread per stage) and the plain module (``min(ranks, cores)`` intra-op threads). The
second table gives each runtime's step against the plan's predictions and the plain module's step
over it. The planner simulates each schedule's table of tasks as torch orders them
(:meth:`ProcessSchedule.table`): with the profile's stage times ("from the profile"), and, as the
strategy does after its first steps, with each action's cost timed on the ranks
(:mod:`~lightning_antichain.planner.process_calibration`): the timeline of those actions, plus what
it leaves unexplained of the timed steps ("predicted"). After a round to warm up, timed rounds take
turns with measured ones ("timed steps": the timed rounds' own median), so that a machine getting
busier or quieter weighs on both alike.

    python benchmarks/processes_cpu.py --ranks 2 --chunks 8
    python benchmarks/processes_cpu.py --device cuda --ranks 1   # on GPUs: rank r on GPU r % count,
                                                                 # NCCL where each rank has its own
    python benchmarks/processes_cpu.py --part runtime   # the Trainer + strategy against torch's pipelining by hand
    python benchmarks/processes_cpu.py --part split     # the DP's split against equal layers, a 32k-vocab Llama

``--part runtime``: one plan (the DP's, 2 stages, 1F1B), trained by hand on torch's stages and
schedule with an SGD step, and by the Trainer with the strategy (``plan=``, no calibration), in
interleaved rounds; the median step of each after three steps to warm up. ``--part split``: a
Hugging Face Llama with a 32k vocabulary, its loss from ``labels=``, cut by the DP and as torchtitan
and NeMo AutoPipeline cut it (equal decoder layers per stage, the embedding with the first stage,
the head with the last), both run by the process runtime's pipeline under 1F1B, in interleaved rounds.

On GPUs (``benchmarks/gpu.py --parts processes`` runs it there) the in-process baseline puts its
stages on the GPUs in turn, and every time is taken after the devices finish their work.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_antichain.cpu_allocator import keep_freed_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_models import build, loss_of  # noqa: E402
from harness import heading  # noqa: E402
from ranks import join_group, run_ranks  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2))


def rank_device(rank: int, kind: str) -> torch.device:
    """Rank ``rank``'s device: the CPU, or GPU ``rank % count``."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, rank % torch.cuda.device_count())


def rank_main(rank: int, ranks: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.device import synchronize, use_device
    from lightning_antichain.measure.action_clock import ActionClock
    from lightning_antichain.measure.saved_tensors import HeldMemory, state_storages
    from lightning_antichain.planner.process_calibration import from_records
    from lightning_antichain.plans.process_schedules import process_schedule
    from lightning_antichain.plans.schedule import held_at_peak
    from lightning_antichain.processes.process_stages import rank_stages, schedule_runner

    torch.set_num_threads(1)
    device = rank_device(rank, args.device)
    if device.type == "cpu":
        keep_freed_memory()  # as the strategy's CPU ranks do
    own_gpus = device.type != "cpu" and ranks <= torch.cuda.device_count()
    with use_device(device):
        join_group(rank, ranks, port, "nccl" if own_gpus else "gloo")
    try:
        for model_name in args.models.split(","):
            model, x, y = build(model_name, device)
            micro = len(x) // args.chunks
            graph = capture_call(model, (x[:micro],), {})
            runs = {}
            predicted_step: dict[tuple[str, int], float | None] = {}
            plans, clocks = {}, {}  # per schedule: the plan and its table; the clock timing its actions
            calibrated_step: dict[tuple[str, int], float | None] = {}
            cost = la.profile(model, x[:micro], str(device), op_graph=graph, progress=False) if rank == 0 else None
            for name, virtual in SCHEDULES:
                schedule = process_schedule(name, virtual)
                stages_total = schedule.num_stages(ranks)
                plan_data = [None]
                if rank == 0:
                    kind = "1f1b" if name != "gpipe" else "gpipe"  # the DP's memory model; interleaved: a guide
                    devices = [str(rank_device(k % ranks, args.device)) for k in range(stages_total)]
                    plan_data = [la.partition(cost, stages_total, chunks=args.chunks, schedule=kind,
                                              devices=devices).to_dict()]
                dist.broadcast_object_list(plan_data, src=0)
                plan = la.Plan.from_dict(plan_data[0])
                table = schedule.table(ranks, args.chunks)  # each rank's tasks as torch orders them
                predicted_step[name, virtual] = plan.predict_step(table)
                if name == "gpipe":
                    gpipe_plan = plan
                stages = rank_stages(graph, plan, schedule, rank, ranks, device)
                held = HeldMemory(excluded=state_storages(model))
                run = schedule_runner(schedule, stages, args.chunks, loss_of(model_name))
                mine = schedule.stages_of(rank, ranks)
                predicted = held_at_peak(table, [stage.activation_bytes for stage in plan.stages])[rank]
                runs[name, virtual] = (run, held, mine, stages_total, predicted)
                plans[name, virtual], clocks[name, virtual] = (plan, table), (ActionClock(device), stages, [])
            baselines = baseline_steps(model, graph, gpipe_plan, x, y, loss_of(model_name), ranks, args.chunks,
                                       args.device) if rank == 0 else {}
            times: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
            times.update({key: [] for key in BASELINES})
            # after a round to warm up, rounds whose actions are timed (the plan's times) take turns with
            # rounds that are measured, so that a machine getting busier or quieter weighs on both alike
            calibrating = range(1, 2 * args.repeats + 1, 2)
            for repeat in range(2 * args.repeats + 1):
                for key, (run, held, mine, total, _) in runs.items():
                    clock, torch_stages, lengths = clocks[key]
                    for p in model.parameters():
                        p.grad = None
                    held.reset_peak()
                    synchronize(device)
                    dist.barrier()
                    started = time.perf_counter()
                    timed = clock.timing(torch_stages) if repeat in calibrating else contextlib.nullcontext()
                    with held.saving(), timed:
                        kwargs = {}
                        if 0 in mine:
                            kwargs["args"] = (x,)
                        if total - 1 in mine:
                            kwargs.update(target=y, losses=[])
                        run.step(*kwargs.pop("args", ()), **kwargs)
                    synchronize(device)
                    elapsed_s = time.perf_counter() - started
                    if repeat in calibrating:
                        lengths.append(elapsed_s)
                    elapsed = torch.tensor([elapsed_s], device=device if own_gpus else "cpu")
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if repeat and repeat not in calibrating:
                        times[key].append(float(elapsed.cpu()))
                for key in BASELINES:  # rank 0 runs them while the others wait
                    dist.barrier()
                    if rank == 0:
                        elapsed_s = baselines[key]()
                        if repeat and repeat not in calibrating:
                            times[key].append(elapsed_s)
                    dist.barrier()
            for key, (clock, _, lengths) in clocks.items():
                timed_plan = from_records(*plans[key], _everyone((clock.steps, lengths)))
                calibrated_step[key] = (timed_plan.predicted_step_s, timed_plan.calibration["explained_step_s"],
                                        timed_plan.calibration["measured_step_s"])
            for key, (_, held, mine, _, predicted) in runs.items():
                results.put((rank, model_name, key, statistics.median(times[key]), held.peak_bytes, predicted, mine,
                             predicted_step[key], calibrated_step[key]))
            if rank == 0:
                for key in BASELINES:
                    results.put((rank, model_name, key, statistics.median(times[key]), 0, 0, [],
                                 gpipe_plan.predicted_step_s if key == IN_PROCESS else None, (None, None, None)))
    finally:
        dist.destroy_process_group()


IN_PROCESS, PLAIN = ("in-process (threads)", 1), ("plain", 1)
BASELINES = (IN_PROCESS, PLAIN)


def baseline_steps(model: nn.Module, graph, plan, x: torch.Tensor, y: torch.Tensor, loss, ranks: int,
                   chunks: int, kind: str = "cpu") -> dict[tuple[str, int], object]:
    """Rank 0's baselines, each a function timing one step: the in-process runtime on ``plan`` (one
    worker thread per stage, one intra-op thread each; on GPUs, stage k on rank k's GPU) and the
    plain module."""
    import lightning_antichain as la
    from lightning_antichain.device import synchronize

    devices = [rank_device(k, kind) for k in range(plan.num_stages)]
    pipeline = la.Pipeline(model, plan, chunks=chunks, graph=graph, devices=devices, output_device=x.device,
                           cpu_threads=1)

    def in_process() -> float:
        for p in model.parameters():
            p.grad = None
        synchronize(devices)
        started = time.perf_counter()
        loss(pipeline(x), y).backward()
        synchronize(devices)
        return time.perf_counter() - started

    def plain() -> float:
        for p in model.parameters():
            p.grad = None
        threads = torch.get_num_threads()
        torch.set_num_threads(min(ranks, os.cpu_count() or 1))
        try:
            synchronize(devices)
            started = time.perf_counter()
            loss(model(x), y).backward()
            synchronize(devices)
            return time.perf_counter() - started
        finally:
            torch.set_num_threads(threads)

    return {IN_PROCESS: in_process, PLAIN: plain}


def _everyone(part: object) -> list[object]:
    parts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return parts


def time_steps(step, count: int) -> list[float]:
    """The length of each of ``count`` calls of ``step``, every rank's together (the slowest's)."""
    lengths = []
    for _ in range(count):
        dist.barrier()
        started = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        lengths.append(float(elapsed))
    return lengths


def runtime_rank(rank: int, ranks: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    """Rank ``rank`` of the runtime row: the same plan, schedule and micro-batches, trained by hand
    on torch.distributed.pipelining (torch's stages and schedule, an SGD step, no Lightning) and by
    the Trainer with the strategy (``schedule=``, ``plan=``), in interleaved rounds; each round's
    steps after the first few, per step."""
    import lightning as L

    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.plans.process_schedules import process_schedule
    from lightning_antichain.processes.process_stages import rank_stages, schedule_runner

    torch.set_num_threads(1)
    keep_freed_memory()  # as the strategy's CPU ranks do
    join_group(rank, ranks, port, LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(ranks), RANK=str(rank))
    try:
        model, x, y = build("gpt", torch.device("cpu"))
        micro = len(x) // args.chunks
        graph = capture_call(model, (x[:micro],), {})
        plan_path = Path(args.out) / "runtime-plan.json"
        if rank == 0:
            cost = la.profile(model, x[:micro], op_graph=graph, progress=False)
            la.partition(cost, ranks, chunks=args.chunks, schedule="1f1b").save(plan_path)
        dist.barrier()
        plan = la.Plan.load(plan_path)
        schedule = process_schedule("1f1b")
        stages = rank_stages(graph, plan, schedule, rank, ranks, torch.device("cpu"))
        run = schedule_runner(schedule, stages, args.chunks, loss_of("gpt"))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))

        def by_hand() -> None:
            for inputs, target in data:  # one batch: as a training loop reads it
                if 0 in schedule.stages_of(rank, ranks):
                    run.step(inputs, target=target if rank == ranks - 1 else None)
                elif rank == ranks - 1:
                    run.step(target=target, losses=[])
                else:
                    run.step()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        class Module(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = build("gpt", torch.device("cpu"))[0]

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return self.net(ids)

            def training_step(self, batch, batch_idx):
                return loss_of("gpt")(self(batch[0]), batch[1])

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=1e-3)

        class Clock(L.Callback):
            def __init__(self) -> None:
                self.starts: list[float] = []

            def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
                dist.barrier()
                self.starts.append(time.perf_counter())

        warm, steps = 3, args.steps
        hand, lightning = [], []
        for _ in range(args.repeats):
            hand += time_steps(by_hand, warm + steps)[warm:]
            clock = Clock()
            trainer = L.Trainer(
                accelerator="cpu", devices=ranks, max_steps=warm + steps + 1, logger=False, callbacks=[clock],
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, limit_val_batches=0,
                strategy=la.AntichainPipelineStrategy(schedule="1f1b", chunks=args.chunks, plan=str(plan_path),
                                                      module="net", calibrate=False, profile_cache=False))
            big = torch.utils.data.TensorDataset(x.repeat(warm + steps + 1, 1), y.repeat(warm + steps + 1, 1))
            trainer.fit(Module(), torch.utils.data.DataLoader(big, batch_size=len(x)))
            lengths = torch.tensor([b - a for a, b in zip(clock.starts, clock.starts[1:])])
            dist.all_reduce(lengths, op=dist.ReduceOp.MAX)
            lightning += lengths.tolist()[warm:]
        if rank == 0:
            results.put(("runtime", statistics.median(hand), statistics.median(lightning), len(hand)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def split_rank(rank: int, ranks: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    """Rank ``rank`` of the split row: a Hugging Face Llama with a 32k vocabulary under 1F1B, cut by
    the DP and cut as torchtitan and NeMo AutoPipeline cut it (equal decoder layers per stage, the
    embedding with the first, the norm and head with the last), both run alike
    (:class:`~lightning_antichain.processes.process_pipeline.ProcessPipeline`) in interleaved rounds."""
    import transformers

    import lightning_antichain as la
    from lightning_antichain.batches import microbatch
    from lightning_antichain.capture import capture_call
    from lightning_antichain.plans.process_schedules import process_schedule
    from lightning_antichain.processes.process_pipeline import ProcessPipeline

    torch.set_num_threads(1)
    keep_freed_memory()  # as the strategy's CPU ranks do
    join_group(rank, ranks, port)
    try:
        torch.manual_seed(0)
        layers = args.layers
        config = transformers.LlamaConfig(vocab_size=32000, hidden_size=128, intermediate_size=344,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=256, use_cache=False, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, 32000, (args.batch, 64))
        micro = args.batch // args.chunks
        graph = capture_call(model, (), {"input_ids": ids[:micro], "labels": ids[:micro]})
        plans = [None, None]
        if rank == 0:
            cost = la.profile(model, {"input_ids": ids[:micro], "labels": ids[:micro]}, op_graph=graph,
                              progress=False)
            operations = [n for n in graph.nodes if n.kind != "placeholder"]
            half = next(i for i, n in enumerate(operations) if n.owner.startswith(f"model.layers.{layers // 2}"))
            plans = [la.partition(cost, ranks, chunks=args.chunks, schedule="1f1b").to_dict(),
                     la.plan_from_balance(cost, [half, len(operations) - half], chunks=args.chunks).to_dict()]
        dist.broadcast_object_list(plans, src=0)
        schedule = process_schedule("1f1b")
        pipelines = [ProcessPipeline(graph, la.Plan.from_dict(p), schedule, rank, ranks, torch.device("cpu"))
                     for p in plans]
        calls = microbatch.scatter(((), {"input_ids": ids, "labels": ids}), args.chunks)

        def step(pipeline: ProcessPipeline):
            def run() -> None:
                model.zero_grad(set_to_none=True)
                with torch.enable_grad():
                    pipeline.run(("shape",), calls if pipeline.holds_first else None,
                                 lambda output, m: output.loss / args.chunks, args.chunks, train=True)
            return run

        times: list[list[float]] = [[], []]
        for repeat in range(args.repeats + 1):
            for i, pipeline in enumerate(pipelines):
                lengths = time_steps(step(pipeline), args.steps)
                if repeat:  # the first round warms up
                    times[i] += lengths
        if rank == 0:
            stages = [[len(s["nodes"]) for s in p["stages"]] for p in plans]
            results.put(("split", statistics.median(times[0]), statistics.median(times[1]), stages,
                         [p["predicted_step_s"] for p in plans]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rows_main(args: argparse.Namespace) -> None:
    """``--part runtime`` and ``--part split``: their row, printed."""
    target = runtime_rank if args.part == "runtime" else split_rank
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (row,) = run_ranks(target, args.ranks, args, expected=1)
    print(heading(f"{args.ranks} gloo processes, 1F1B, {args.chunks} micro-batches, median of "
          f"{args.repeats} interleaved rounds of {args.steps} steps", threads=1))
    if args.part == "runtime":
        _, hand_s, strategy_s, count = row
        print("| GPT decoder, same plan | step ms | / by hand |\n|---|---|---|")
        print(f"| torch.distributed.pipelining by hand | {1e3 * hand_s:.1f} | 1.00 |")
        print(f"| Trainer + AntichainPipelineStrategy(schedule='1f1b') | {1e3 * strategy_s:.1f} "
              f"| {strategy_s / hand_s:.3f} |")
        return
    _, auto_s, equal_s, stages, predicted = row
    print(f"| Llama, 32k vocabulary, {args.layers} layers | operations per stage | predicted ms | step ms "
          "| / automatic |\n|---|---|---|---|---|")
    print(f"| automatic (the DP) | {stages[0]} | {1e3 * predicted[0]:.1f} | {1e3 * auto_s:.1f} | 1.00 |")
    print(f"| equal layers, embedding first, head last | {stages[1]} | {1e3 * predicted[1]:.1f} "
          f"| {1e3 * equal_s:.1f} | {equal_s / auto_s:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="gpt,resnet50")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the ranks run")
    parser.add_argument("--part", default="schedules", choices=["schedules", "runtime", "split"],
                        help="schedules: each of torch's schedules on the plan (the default); runtime: the "
                             "strategy's step against torch.distributed.pipelining by hand; split: the DP's split "
                             "against equal decoder layers for a 32k-vocabulary Llama")
    parser.add_argument("--steps", type=int, default=6, help="steps per round (runtime, split)")
    parser.add_argument("--layers", type=int, default=8, help="the Llama's decoder layers (split)")
    parser.add_argument("--batch", type=int, default=16, help="the Llama's batch of 64-token sequences (split)")
    parser.add_argument("--out", default="benchmark-out", help="where the runtime row keeps its plan")
    args = parser.parse_args()
    if args.part != "schedules":
        rows_main(args)
        return
    rows = run_ranks(rank_main, args.ranks, args,
                     expected=(args.ranks * len(SCHEDULES) + len(BASELINES)) * len(args.models.split(",")))
    where = "gloo processes" if args.device == "cpu" else f"processes on {args.device}"
    print(heading(f"{args.ranks} {where}, {args.chunks} micro-batches, "
          f"median of {args.repeats} interleaved steps", threads=1))
    print("| model | schedule | virtual stages | step ms | rank | stages | saved at peak MB | predicted MB "
          "| measured / predicted | peak / GPipe's | K / chunks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    gpipe = {(m, r): peak for r, m, (n, _), _, peak, *_ in rows if n == "gpipe"}
    schedules = [r for r in rows if (r[2][0], r[2][1]) not in BASELINES]
    for rank, model_name, (name, virtual), step_s, peak, predicted, mine, *_ in sorted(
            schedules, key=lambda r: r[1:3] + r[:1]):
        of_gpipe = peak / max(gpipe[model_name, rank], 1)
        print(f"| {model_name} | {name} | {virtual} | {1e3 * step_s:.1f} | {rank} | {mine} | {peak / 1e6:.1f} "
              f"| {predicted / 1e6:.1f} | {peak / max(predicted, 1):.2f} | {of_gpipe:.2f} "
              f"| {args.ranks / args.chunks:.2f} |")
    print("\n| model | runtime | step ms | predicted ms | measured / predicted | timeline of the actions ms "
          "| measured / timeline | timed steps ms | from the profile ms | measured / from the profile | plain / this |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    steps = {(r[1], r[2]): (r[3], r[7], r[8]) for r in rows if r[0] == 0}
    for model_name in args.models.split(","):
        plain_s = steps[model_name, PLAIN][0]
        for key in [*(k for k in SCHEDULES), IN_PROCESS, PLAIN]:
            step_s, profiled_s, (calibrated_s, explained_s, timed_s) = steps[model_name, key]
            predicted_s = calibrated_s or profiled_s  # in-process: the planner's own prediction
            profiled_s = profiled_s if calibrated_s else None
            label = key[0] if key[1] == 1 or key in BASELINES else f"{key[0]} (v={key[1]})"
            print(f"| {model_name} | {label} | {1e3 * step_s:.1f} | {_ms(predicted_s)} | {_ratio(step_s, predicted_s)} "
                  f"| {_ms(explained_s)} | {_ratio(step_s, explained_s)} | {_ms(timed_s)} "
                  f"| {_ms(profiled_s)} | {_ratio(step_s, profiled_s)} "
                  f"| {plain_s / step_s:.2f} |")


def _ms(seconds: float | None) -> str:
    return "-" if not seconds else f"{1e3 * seconds:.1f}"


def _ratio(measured: float, predicted: float | None) -> str:
    return "-" if not predicted else f"{measured / predicted:.2f}"


if __name__ == "__main__":
    main()
