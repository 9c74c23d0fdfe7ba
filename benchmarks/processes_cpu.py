"""Stages as processes on the CPU: each of torch's schedules on the plan's stages, one gloo process
per rank, with its step time and what each rank keeps for backward at its peak.

Rank 0 profiles and plans (the DP, ``chunks`` micro-batches) and sends the plan to every rank; each
rank builds and places its own stages only (:func:`~lightning_antichain.runtime.process_stages.rank_stages`)
and runs torch's schedule. Steps of the schedules take turns, and each time is the median over the
repeats of the slowest rank's step. The memory is what autograd saves during a step on each rank
(:class:`~lightning_antichain.runtime.saved_tensors.HeldMemory`; torch's own copies of the stage
outputs are not in it), against the plan's activations per micro-batch of each stage, weighed by
the micro-batches torch's table of tasks keeps in flight on the rank's stages at its peak
(:func:`~lightning_antichain.runtime.schedule.held_at_peak`; a zero-bubble schedule's keep their
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

On GPUs (``benchmarks/gpu.py --parts processes`` runs it there) the in-process baseline puts its
stages on the GPUs in turn, and every time is taken after the devices finish their work.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2))


class Block(nn.Module):
    """A pre-norm decoder block: causal self-attention and an MLP, shapes from constants only (no
    sizes cross the cuts, which torch's stages could not send)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(h)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(attended.transpose(1, 2).flatten(2))
        return h + self.mlp(self.norm2(h))


class Decoder(nn.Module):
    """A GPT-style decoder returning logits."""

    def __init__(self, layers: int = 8, width: int = 128, heads: int = 4, vocab: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def build(name: str, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name == "gpt":
        model, x, y = Decoder(), torch.randint(0, 512, (32, 64)), torch.randint(0, 512, (32, 64))
    else:
        import torchvision

        model = torchvision.models.resnet50(num_classes=10)
        x, y = torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,))
    return model.to(device), x.to(device), y.to(device)


def rank_device(rank: int, kind: str) -> torch.device:
    """Rank ``rank``'s device: the CPU, or GPU ``rank % count``."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, rank % torch.cuda.device_count())


def loss_of(name: str):
    if name == "gpt":
        return lambda logits, target: nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    return nn.functional.cross_entropy


def rank_main(rank: int, ranks: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.device import synchronize, use_device
    from lightning_antichain.planner.process_calibration import from_records
    from lightning_antichain.runtime.action_clock import ActionClock
    from lightning_antichain.runtime.process_schedules import process_schedule
    from lightning_antichain.runtime.process_stages import rank_stages, schedule_runner
    from lightning_antichain.runtime.saved_tensors import HeldMemory, state_storages
    from lightning_antichain.runtime.schedule import held_at_peak

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = rank_device(rank, args.device)
    own_gpus = device.type != "cpu" and ranks <= torch.cuda.device_count()
    with use_device(device):
        dist.init_process_group("nccl" if own_gpus else "gloo", rank=rank, world_size=ranks)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collected(processes: list, results: mp.Queue, expected: int) -> list:
    """The ``expected`` rows the ranks put on ``results``, once every process has ended; where a
    rank fails, every process is killed and the run stops."""
    rows = []
    while len(rows) < expected:
        try:
            rows.append(results.get(timeout=5))
        except queue.Empty:
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if failed:
                for process in processes:
                    process.kill()
                raise SystemExit(f"a rank failed (exit codes {failed}); its error is printed above") from None
    for process in processes:
        process.join(timeout=60)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="gpt,resnet50")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the ranks run")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=rank_main, args=(r, args.ranks, port, args, results))
                 for r in range(args.ranks)]
    for process in processes:
        process.start()
    rows = collected(processes, results, (args.ranks * len(SCHEDULES) + len(BASELINES)) * len(args.models.split(",")))
    where = "gloo processes" if args.device == "cpu" else f"processes on {args.device}"
    print(f"Machine: {machine(1)}; {args.ranks} {where}, {args.chunks} micro-batches, "
          f"median of {args.repeats} interleaved steps\n")
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
