"""Where the GPU misses of ``benchmarks/gpu.py`` come from: the prediction, the one-stage overhead,
the memory gap and the interpreter lock, each broken down so that the fix can be chosen.

- **prediction**: the profile's predicted step, the same plan calibrated on its own runtime
  tasks (the CPU's calibration, applied to GPU stages here), and the measured step; per operation,
  the profile's time against the time inside the stage (the op clock on the stage's stream).
- **overhead**: plain module against one stage at one micro-batch: step time (CUDA events), host
  time to enqueue a step, kernel time and kernel count per step (torch.profiler), and the
  profiler's tables written to ``--out``.
- **memory**: per recompute mode, the plan's terms against the allocator's peak, the runtime's
  exact count of what each micro-batch keeps, the allocated bytes after forward, loss and backward,
  and what is alive at the peak, grouped by where it was allocated (the allocator's history).
- **lock**: K stages sharing the GPU: step time, CPU seconds per step of each thread (the
  workers', the main thread's, autograd's), and the GPU's kernel time per step.

    python benchmarks/gpu_breakdown.py --device cuda:0 --out /tmp/breakdown
    python benchmarks/gpu_breakdown.py --device cpu --small     # a dry run
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gc
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import torch

import lightning_antichain as la
from lightning_antichain.planner import calibration

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import Clock, allocated, interleaved, models, step_of  # noqa: E402
from harness import machine  # noqa: E402


@contextlib.contextmanager
def calibration_on_gpus() -> Iterator[None]:
    """Calibration as the CPU has it, allowed for plans whose stages are on a GPU."""
    original = calibration.applies_to

    def applies(plan, graph) -> bool:
        return graph is not None and graph.granularity == "ops"

    calibration.applies_to = applies
    try:
        yield
    finally:
        calibration.applies_to = original


def guarded(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Run a part, printing its error instead of ending the script (one run on a lent GPU must give
    every part it can)."""

    def wrap(part: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            print(f"\n## {name}", flush=True)
            started = time.perf_counter()
            try:
                part()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            print(f"({name}: {time.perf_counter() - started:.0f} s)", flush=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

        return run

    return wrap


def kernel_time(run: Callable[[], None], steps: int, device: torch.device, table: Path | None = None) -> tuple:
    """Per step: GPU kernel seconds, kernel count, host-side synchronisations (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6 / steps
    count = sum(e.count for e in kernels) / steps
    syncs = (
        sum(
            e.count
            for e in events
            if "Synchronize" in e.key or e.key in ("cudaMemcpy", "aten::item", "aten::_local_scalar_dense")
        )
        / steps
    )
    if table is not None:
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        table.write_text(
            events.table(sort_by=sort, row_limit=60)
            + "\n\nby CPU time\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=60)
        )
    return busy, count, syncs


def gpu_gaps(run: Callable[[], None], device: torch.device, steps: int, trace: Path | None = None) -> str:
    """Where the GPU waits inside a step that starts on an idle GPU (as the clock times it): the
    wait before the step's first kernel, the idle time between its kernels, and the longest gaps
    with the kernels around them (torch.profiler; empty off CUDA). ``trace``: a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if device.type != "cuda":
        return ""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize(device)
            with record_function("benchmark_step"):
                run()
        torch.cuda.synchronize(device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.events()
    starts = sorted(e.time_range.start for e in events if e.name == "benchmark_step")
    on_gpu = torch.autograd.DeviceType.CUDA
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == on_gpu)
    leads, idles, gaps = [], [], []
    for k, begin in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else float("inf")
        mine = [kern for kern in kernels if begin <= kern[0] < end]
        if not mine:
            continue
        leads.append(mine[0][0] - begin)
        reached = mine[0][1]
        idle = 0.0
        for (_, _, before), (start, stop, after) in zip(mine, mine[1:]):
            if start > reached:
                idle += start - reached
                gaps.append((start - reached, (start - begin) / 1e3, before[:40], after[:40]))
            reached = max(reached, stop)
        idles.append(idle)
    worst = sorted(gaps, reverse=True)[:4]
    shown = "; ".join(f"{g / 1e3:.2f} ms at {at:.1f} ms, {a} -> {b}" for g, at, a, b in worst)
    return (f"wait for the first kernel {statistics.median(leads) / 1e3:.2f} ms, idle between kernels "
            f"{statistics.median(idles) / 1e3:.2f} ms per step; longest gaps: {shown}")


def host_time(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds until a step returns to the caller (no synchronisation after it)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times)


def back_to_back(clock: Clock, run: Callable[[], None], steps: int) -> float:
    """Seconds per step of ``steps`` steps timed as one, the host running ahead of the device as
    in training that does not wait for each step's loss."""
    run()
    return clock.time(lambda: [run() for _ in range(steps)]) / steps


def thread_cpu(run: Callable[[], None], steps: int, device: torch.device) -> dict[str, float]:
    """CPU seconds per step of each kind of thread in this process while ``run`` runs ``steps`` times."""
    process = psutil.Process()

    def sample() -> dict[int, float]:
        return {t.id: t.user_time + t.system_time for t in process.threads()}

    before = sample()
    for _ in range(steps):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    after = sample()
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    kinds: dict[str, float] = collections.defaultdict(float)
    for tid, seconds in after.items():
        spent = (seconds - before.get(tid, 0.0)) / steps
        name = "main" if tid == main else names.get(tid, "native (autograd, allocator, ...)")
        kinds["stage workers" if name.startswith("antichain") else name] += spent
    return dict(kinds)


class LockProbe:
    """How much of the time some thread holds the interpreter lock: a probe thread sleeps
    ``period`` seconds at a time and times how long past each wake-up it waits before it runs
    Python again. A wake that finds the lock free runs at once (the idle machine's wake-up
    latency, measured first); one that finds it held waits until the holder lets go. The share
    of wakes that waited past ``threshold`` over the idle latency samples the share of the time
    the lock was held (torch's operators let it go while they run, the Python around them not)."""

    def __init__(self, period: float = 0.002, threshold: float = 2e-4) -> None:
        self.period, self.threshold = period, threshold
        self.idle = statistics.median(self._waits(100))
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lock-probe", daemon=True)

    def _waits(self, count: int) -> list[float]:
        waits = []
        for _ in range(count):
            started = time.perf_counter()
            time.sleep(self.period)
            waits.append(time.perf_counter() - started - self.period)
        return waits

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.extend(self._waits(1))

    def __enter__(self) -> LockProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def held_share(self) -> float:
        """The share of the probe's wakes that found the lock held."""
        held = sum(1 for w in self.samples if w - self.idle > self.threshold)
        return held / max(1, len(self.samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("breakdown"))
    parser.add_argument("--parts", default="overhead,prediction,memory,lock")
    parser.add_argument("--models", default="ResNet-50,GPT-2 (12 x 768)", help="comma-separated, of the two")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    clock = Clock(device)
    zoo = models(args.small)
    print(f"Machine: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}; host {machine()}")
    names = tuple(args.models.split(","))

    def built(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
        build, batch, size = zoo[name]
        torch.manual_seed(0)
        return build(), batch(size)

    def tag(name: str) -> str:
        return name.split()[0].lower().replace("-", "")

    @guarded("overhead: plain module against one stage, one micro-batch")
    def overhead() -> None:
        print(
            "| model | plain ms | stage ms | overhead | host plain ms | host stage ms | kernel plain ms "
            "| kernel stage ms | kernels plain | kernels stage | syncs plain | syncs stage |"
        )
        for name in names:
            model, x = built(name)
            plain = copy.deepcopy(model).to(device)
            cost = la.profile(model, x, str(device), progress=False)
            plan = la.partition(cost, stages=1, chunks=1, devices=[str(device)])
            with la.Pipeline(model, plan, chunks=1) as pipe:
                xs = x.to(device)
                steps = {
                    "plain": step_of(plain, list(plain.parameters()), xs),
                    "stage": step_of(pipe, list(model.parameters()), xs),
                }
                medians = interleaved(clock, steps, args.repeats)
                host = {k: host_time(s, device, args.repeats) for k, s in steps.items()}
                kern = {
                    k: kernel_time(s, 3, device, args.out / f"profile_{tag(name)}_{k}.txt") for k, s in steps.items()
                }
                waits = {k: gpu_gaps(s, device, 3, args.out / f"trace_{tag(name)}_{k}.json") for k, s in steps.items()}
                ahead = {k: back_to_back(clock, s, args.repeats) for k, s in steps.items()}
            print(
                f"| {name} | {1e3 * medians['plain']:.1f} | {1e3 * medians['stage']:.1f} "
                f"| {100 * (medians['stage'] / medians['plain'] - 1):+.1f}% | {1e3 * host['plain']:.1f} "
                f"| {1e3 * host['stage']:.1f} | {1e3 * kern['plain'][0]:.1f} | {1e3 * kern['stage'][0]:.1f} "
                f"| {kern['plain'][1]:.0f} | {kern['stage'][1]:.0f} "
                f"| {kern['plain'][2]:.0f} | {kern['stage'][2]:.0f} |",
                flush=True,
            )
            print(f"  back to back ({args.repeats} steps, no synchronisation between them): plain "
                  f"{1e3 * ahead['plain']:.1f} ms, stage {1e3 * ahead['stage']:.1f} ms per step "
                  f"({100 * (ahead['stage'] / ahead['plain'] - 1):+.1f}%)", flush=True)
            for k, text in waits.items():
                if text:
                    print(f"  GPU waits, {k}: {text}", flush=True)
            del plain, model, pipe

    @guarded("prediction: profile, calibrated and measured step")
    def prediction() -> None:
        print(
            "| model | chunks | stages | profiled ms | calibrated ms | measured ms | profiled/measured "
            "| calibrated/measured | ops profiled ms | ops in stage ms |"
        )
        for name in names:
            for chunks in (1, 4):
                for stages in (1, 2):
                    try:
                        predicted_row(name, chunks, stages)
                    except Exception:  # noqa: BLE001
                        traceback.print_exc()

    def predicted_row(name: str, chunks: int, stages: int) -> None:
        model, x = built(name)
        devices = [str(device)] * stages
        kwargs = dict(chunks=chunks, profile_cache="/tmp/breakdown-cache", progress=False, rebalance_rounds=0)
        profiled = la.plan(model, x, devices, calibrate=False, **kwargs)
        with calibration_on_gpus():
            measured_plan = la.plan(model, x, devices, calibrate=True, **kwargs)
        found = measured_plan.calibration or {}
        with la.Pipeline(model, profiled, chunks=chunks) as pipe:
            xs = x.to(device)

            def fwd_bwd() -> None:
                calibration.backward_from(pipe(xs))
                for p in model.parameters():
                    p.grad = None

            measured = interleaved(clock, {"step": fwd_bwd}, args.repeats)["step"]
        ops = found.get("operations", {})
        in_stage = sum(f + b for f, b in ops.values())
        from_profile = sum(s.compute_s for s in profiled.stages)
        print(
            f"| {name} | {chunks} | {stages} | {1e3 * profiled.predicted_step_s:.1f} "
            f"| {1e3 * measured_plan.predicted_step_s:.1f} | {1e3 * measured:.1f} "
            f"| {profiled.predicted_step_s / measured:.2f} | {measured_plan.predicted_step_s / measured:.2f} "
            f"| {1e3 * from_profile:.1f} | {1e3 * in_stage:.1f} |",
            flush=True,
        )
        if chunks == 4 and stages == 1 and ops:
            cost = la.profile(model, x[: len(x) // chunks], str(device), progress=False)
            rows = []
            for node, data in cost.nodes(data=True):
                if node in ops:
                    mine = data.get("forward_s", 0.0) + data.get("backward_s", 0.0)
                    rows.append((mine - sum(ops[node]), node, mine, sum(ops[node])))
            rows.sort(reverse=True)
            with (args.out / f"ops_{tag(name)}.txt").open("w") as f:
                for diff, node, mine, theirs in rows:
                    f.write(
                        f"{node}\tprofile {1e6 * mine:.0f} us\tin stage {1e6 * theirs:.0f} us"
                        f"\tdiff {1e6 * diff:+.0f} us\n"
                    )
            print(
                "   largest profile-over-stage ops:",
                ", ".join(f"{n} {1e6 * m:.0f}/{1e6 * t:.0f} us" for _, n, m, t in rows[:6]),
            )

    @guarded("memory: the plan's terms against the allocator")
    def memory() -> None:
        name = names[-1]
        print(
            "| recompute | params+grads MB | activations MB x | kept inputs MB | predicted MB | peak MB "
            "| peak/predicted | measured act MB | after fwd MB | after loss MB | after bwd MB | reserved MB |"
        )
        model, x = built(name)
        plain = model.to(device)
        base = allocated(device)
        step = step_of(plain, list(plain.parameters()), x.to(device))
        step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            step()
            print(
                f"| plain module | | | | | {(torch.cuda.max_memory_allocated(device) - base) / 1e6:.0f} | | | | | | |"
            )
        del model, plain, step
        for recompute in ("never", "except_last", "always"):
            memory_row(name, recompute)

    def memory_row(name: str, recompute: str) -> None:
        model, x = built(name)
        cost = la.profile(model, x[: len(x) // 4], str(device), progress=False)
        plan = la.partition(
            cost, stages=1, chunks=4, devices=[str(device)], recompute=recompute, optimizer_multiplier=0.0
        )
        stage = plan.stages[0]
        base = allocated(device)
        with la.Pipeline(model, plan, chunks=4, recompute=recompute, measure_activations=True) as pipe:
            xs = x.to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            points: dict[str, int] = {}

            def step() -> None:
                out = pipe(xs)
                points["fwd"] = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                loss = out.float().square().mean()
                points["loss"] = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                del out
                loss.backward()
                points["bwd"] = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            step()
            peak = 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
                step()
                peak = torch.cuda.max_memory_allocated(device) - base
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                at_peak(snapshot, device, args.out / f"peak_{recompute}.txt")
            else:
                step()
            kept = pipe.last_activation_bytes
            reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
        mb = 1e6
        print(
            f"| {recompute} | {(2 * stage.param_bytes) / mb:.0f} | {stage.activation_bytes / mb:.0f} "
            f"| {stage.kept_input_bytes / mb:.0f} | {stage.memory_bytes / mb:.0f} | {peak / mb:.0f} "
            f"| {peak / stage.memory_bytes:.2f} | {kept} | {(points['fwd'] - base) / mb:.0f} "
            f"| {(points['loss'] - base) / mb:.0f} | {(points['bwd'] - base) / mb:.0f} | {reserved / mb:.0f} |",
            flush=True,
        )

    @guarded("lock: K stages sharing the GPU, CPU seconds per thread against kernel time")
    def lock() -> None:
        name = names[-1]
        chunks = min(8, zoo[name][2])
        for stages in (1, 2, 4):
            model, x = built(name)
            cost = la.profile(model, x[: len(x) // chunks], str(device), progress=False)
            plan = la.partition(cost, stages=stages, chunks=chunks, devices=[str(device)] * stages)
            with la.Pipeline(model, plan, chunks=chunks) as pipe:
                step = step_of(pipe, list(model.parameters()), x.to(device))
                wall = interleaved(clock, {"step": step}, args.repeats)["step"]
                cpu = thread_cpu(step, args.repeats, device)
                busy, count, _ = kernel_time(step, 2, device)
                with LockProbe() as probe:
                    probed = back_to_back(clock, step, args.repeats)
            spent = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v > 1e-4)
            held = probe.held_share() * probed
            print(
                f"K={stages}: step {1e3 * wall:.1f} ms, kernels {1e3 * busy:.1f} ms ({count:.0f}), "
                f"CPU ms per step: {spent}; interpreter lock held {100 * probe.held_share():.0f}% of a step "
                f"({1e3 * held:.0f} ms of {1e3 * probed:.0f} ms back to back; {len(probe.samples)} probe wakes, idle "
                f"wake-up {1e6 * probe.idle:.0f} us)",
                flush=True,
            )
            if stages == 1:
                per_gpu = busy / 8 * (chunks + 7) / chunks  # GPipe's fill and drain over 8 stages
                print(f"  projected for 8 GPUs in one process: kernels {1e3 * per_gpu:.0f} ms per GPU with the "
                      f"bubble, the lock {1e3 * held:.0f} ms per step: a step of at least "
                      f"{1e3 * max(per_gpu, held):.0f} ms against {1e3 * wall:.0f} ms on one GPU "
                      f"({wall / max(per_gpu, held):.1f}x)", flush=True)
            del model, pipe

    parts = {"overhead": overhead, "prediction": prediction, "memory": memory, "lock": lock}
    for part in args.parts.split(","):
        parts[part]()


def at_peak(snapshot: dict, device: torch.device, path: Path) -> None:
    """What the allocator held at its peak in ``snapshot``'s history, grouped by the innermost frames
    of this package or the user's code that allocated it."""
    trace = snapshot["device_traces"][device.index or 0]
    live: dict[int, dict] = {}
    total = best = 0
    best_live: list[dict] = []
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > best:
                best, best_live = total, list(live.values())
        elif action in ("free_requested", "free_completed") and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for event in best_live:
        frames = [f for f in event.get("frames", []) if f["filename"].endswith(".py")]
        ours = [f for f in frames if "lightning_antichain" in f["filename"] or "benchmarks" in f["filename"]]
        torch_side = [f for f in frames if "/torch/" in f["filename"] or "transformers" in f["filename"]]
        where = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in (torch_side[:2] + ours[:3]))
        groups[where or "(no python frame)"][0] += event["size"]
        groups[where or "(no python frame)"][1] += 1
    lines = [
        f"peak of the traced step: {best / 1e6:.0f} MB in {len(best_live)} blocks (above what was alive "
        "before the trace began)"
    ]
    for where, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:60]:
        lines.append(f"{size / 1e6:10.1f} MB {count:6d}  {where}")
    path.write_text("\n".join(lines) + "\n")
    print("   at peak:", " | ".join(lines[1:5]))


if __name__ == "__main__":
    main()
