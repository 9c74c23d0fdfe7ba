"""The pipeline on one GPU: overhead against the plain module, profile accuracy, memory per stage,
K stages sharing the GPU, and a simulated multi-GPU speed-up from the measured profile.

Every time is the median of interleaved repeats, timed from the caller's side as a user sees a
training step (forward, loss, backward, optimizer step; with CUDA events on a GPU). It runs on the
CPU too (``--device cpu``, smaller inputs with ``--small``), so only the CUDA branch is new on a GPU.

    python benchmarks/gpu.py --device cuda:0
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torchvision
from torch import nn

import lightning_antichain as la

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, publish, section  # noqa: E402

START, END = "<!-- gpu:start -->", "<!-- gpu:end -->"
TORCHGPIPE_RESNET101_8 = 4.29  # torchgpipe's published speed-up, ResNet-101 on 8 GPUs (arXiv:2004.09910)


class GPT(nn.Module):
    """Hugging Face GPT-2 (random weights, untied output layer) returning its logits."""

    def __init__(self, layers: int, width: int, vocab: int, length: int) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=vocab,
                                         n_positions=length, use_cache=False, bos_token_id=0, eos_token_id=0,
                                         tie_word_embeddings=False)
        self.gpt = transformers.GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=ids, use_cache=False).logits


class UNet(nn.Module):
    """Ronneberger et al.'s U-Net: four down and four up steps with skip connections."""

    def __init__(self, base: int = 32, classes: int = 2) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

        widths = [base * 2**i for i in range(5)]
        self.down = nn.ModuleList([block(3, widths[0])] + [block(widths[i], widths[i + 1]) for i in range(4)])
        self.up = nn.ModuleList([nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in range(4)])
        self.merge = nn.ModuleList([block(2 * widths[i], widths[i]) for i in range(4)])
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, down in enumerate(self.down):
            x = down(x if i == 0 else nn.functional.max_pool2d(x, 2))
            skips.append(x)
        for i in reversed(range(4)):
            x = self.merge[i](torch.cat([skips[i], self.up[i](x)], dim=1))
        return self.head(x)


def models(small: bool) -> dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor], int]]:
    """name -> (build, batch of n, batch size)."""
    side, length = (32, 64) if small else (224, 512)

    def images(n: int, size: int = side) -> torch.Tensor:
        return torch.randn(n, 3, size, size)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, 8192, (n, length))

    return {
        "ResNet-50": (lambda: torchvision.models.resnet50(num_classes=1000), images, 8 if small else 128),
        "GPT-2 (12 x 768)": (lambda: GPT(2 if small else 12, 128 if small else 768, 8192, length), tokens,
                             4 if small else 32),
        "ResNet-101": (lambda: torchvision.models.resnet101(num_classes=1000), images, 8 if small else 128),
        "U-Net": (lambda: UNet(8 if small else 32), lambda n: images(n, 32 if small else 256), 4 if small else 32),
    }


class Clock:
    """Seconds of a block as the caller's stream sees it: CUDA events on a GPU, wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, run: Callable[[], None]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            run()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        run()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def step_of(net: nn.Module, params: list[nn.Parameter], x: torch.Tensor) -> Callable[[], None]:
    """One training step of ``net`` on ``x``: forward, loss, backward, SGD step, gradients dropped."""
    optimizer = torch.optim.SGD(params, lr=1e-4)

    def step() -> None:
        net(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def calibration_step(plan: la.Plan) -> float:
    """The pipelined step that calibrating ``plan`` measured, with the optimizer's step (NaN where
    it was not calibrated)."""
    found = plan.calibration or {}
    return found.get("pipelined_step_s", math.nan) + plan.optimizer_step_s


def accumulated_step_of(net: nn.Module, x: torch.Tensor, chunks: int) -> Callable[[], None]:
    """The plain module's step on ``chunks`` micro-batches one after another, gradients accumulated
    (the pipeline's loss over the whole batch, split): what the micro-batches' smaller kernels
    cost without the pipeline, against which the pipeline's own cost shows."""
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-4)
    parts = x.chunk(chunks)

    def step() -> None:
        for part in parts:
            (net(part).float().square().mean() * (len(part) / len(x))).backward()  # the batch's mean, split
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


#: untimed runs of a step before each of its timed ones in the one-stage table (:func:`interleaved`)
SETTLE_STEPS = 3


def interleaved(clock: Clock, steps: dict[str, Callable[[], None]], repeats: int, warmup: int = 3,
                settle: int = 0) -> dict[str, float]:
    """Median seconds of each step, the steps taking turns so that drift hits all alike. With
    ``settle``, each timed step follows that many untimed runs of itself, as a training loop's steps
    follow each other: where the host's launches set the pace, a step timed right after another
    kind of step can run in a colder state than training's."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            for _ in range(settle):
                step()
            times[name].append(clock.time(step))
    return {name: statistics.median(values) for name, values in times.items()}


def allocated(device: torch.device) -> int:
    """Bytes in tensors on ``device`` now, after collecting what earlier runs left (0 off CUDA)."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def peak_bytes(device: torch.device, run: Callable[[], None], baseline: int) -> int | None:
    """The allocator's peak over ``run`` above ``baseline`` (``None`` off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    run()
    return torch.cuda.max_memory_allocated(device) - baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--small", action="store_true", help="small inputs and models (a CPU dry run)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmark-runs.md")
    parser.add_argument("--chunk-counts", default="1,2,4,8", help="micro-batch counts of the one-stage table")
    parser.add_argument("--compiled-models", default="ResNet-50,GPT-2 (12 x 768)",
                        help="comma-separated models of the compiled table")
    parser.add_argument("--parts", default="one,memory,shared,simulated,processes",
                        help="which tables: one (one stage), compiled (one stage through torch.compile), memory, "
                             "shared (K stages on one GPU), simulated, processes (torch's schedules, one process "
                             "per GPU)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    cache = Path(tempfile.mkdtemp(prefix="gpu-benchmark-"))  # profiles shared by the tables, none from earlier runs
    device = torch.device(args.device)
    clock = Clock(device)
    zoo = models(args.small)
    name_of_device = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"Machine: {name_of_device}; host {machine()}.", ""]
    costs = {}

    def profiled(name: str, chunks: int) -> tuple[nn.Module, torch.Tensor, object]:
        build, batch, size = zoo[name]
        torch.manual_seed(0)
        model = build()
        x = batch(size)
        if (name, chunks) not in costs:  # a profile's times and activations are per micro-batch of its size
            costs[name, chunks] = la.profile(model, x[: size // chunks], str(device), progress=False)
        return model, x, costs[name, chunks]

    # 1. one stage against the plain module, and the plan's prediction against the measured step
    lines += ["### One stage against the plain module", "",
              "Predicted from the per-operation profile alone, and from the plan calibrated on a few of its own "
              "steps (the default: `calibrate=True`).", "",
              "\"plain, accumulated\" runs the plain module on the same micro-batches one after another, gradients "
              "accumulated: the cost of smaller kernels without a pipeline; the pipeline's own cost is the last "
              "overhead.", "",
              "\"calibration's step\" is the pipelined step calibration measured (plus the optimizer's step): "
              "where it is far from the measured step, the host ran in another state while calibrating.", "",
              f"Each timed step follows {SETTLE_STEPS} untimed runs of itself, as a training loop's steps follow "
              "each other; the last column times the pipeline's step right after the plain module's steps.", "",
              "| model | batch | chunks | plain step ms | pipeline step ms | overhead | profiled / measured "
              "| calibrated / measured | calibration's step / measured | calibrated stage ms per micro-batch "
              "| calibrated step overhead ms | plain, accumulated ms | overhead over it "
              "| pipeline step ms, right after the others |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("ResNet-50", "GPT-2 (12 x 768)") if "one" in parts else ():
        for chunks in map(int, args.chunk_counts.split(",")):
            build, batch, size = zoo[name]
            if size // chunks < 2:  # BatchNorm needs two samples (only the --small inputs are this small)
                continue
            torch.manual_seed(0)
            model, x = build(), batch(size)
            plain = copy.deepcopy(model).to(device)
            settings = dict(chunks=chunks, profile_cache=str(cache), progress=False)
            profiled_plan = la.plan(model, x, [str(device)], calibrate=False, **settings)
            plan = la.plan(model, x, [str(device)], **settings)
            with la.Pipeline(model, plan, chunks=chunks) as pipe:
                xs = x.to(device)
                steps = {"plain": step_of(plain, list(plain.parameters()), xs),
                         "pipe": step_of(pipe, list(model.parameters()), xs)}
                if chunks > 1:
                    steps["accumulated"] = accumulated_step_of(plain, xs, chunks)
                alternating = interleaved(clock, steps, args.repeats)
                medians = interleaved(clock, steps, args.repeats, warmup=0, settle=SETTLE_STEPS)
            accumulated = medians.get("accumulated", medians["plain"])
            lines.append(f"| {name} | {len(x)} | {chunks} | {1e3 * medians['plain']:.1f} | {1e3 * medians['pipe']:.1f} "
                         f"| {100 * (medians['pipe'] / medians['plain'] - 1):+.1f}% "
                         f"| {profiled_plan.predict_step() / medians['pipe']:.2f} "
                         f"| {plan.predict_step() / medians['pipe']:.2f} "
                         f"| {calibration_step(plan) / medians['pipe']:.2f} "
                         f"| {1e3 * plan.stages[0].compute_s:.1f} | {1e3 * plan.step_overhead_s:.1f} "
                         f"| {1e3 * accumulated:.1f} | {100 * (medians['pipe'] / accumulated - 1):+.1f}% "
                         f"| {1e3 * alternating['pipe']:.1f} |")
            print(lines[-1], flush=True)
            del plain, model, pipe
    # 1b. compiled: the stage through torch.compile against the compiled plain module
    lines += ["", "### One stage compiled (`compile_stages`) against the compiled plain module", "",
              "Each compiled on its first steps (the warm-up), then timed; `torch.compile` defaults "
              "(inductor); stages refuse the modes that replay CUDA graphs. \"accumulated\": the compiled plain "
              "module on the same micro-batches one after another, gradients accumulated (a copy of its own, "
              "compiled for that size: `dynamic=False` in both).", "",
              "| model | chunks | plain ms | plain compiled ms | plain compiled, accumulated ms | stage ms "
              "| stage compiled ms | stage compiled / plain compiled | stage compiled / accumulated |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name in args.compiled_models.split(",") if "compiled" in parts else ():
        for chunks in map(int, args.chunk_counts.split(",")):
            build, batch, size = zoo[name]
            if size // chunks < 2:
                continue
            torch.manual_seed(0)
            model, x = build(), batch(size)
            xs = x.to(device)
            plain = copy.deepcopy(model).to(device)
            plain_compiled = torch.compile(copy.deepcopy(model).to(device), dynamic=False)
            plan = la.plan(model, x, [str(device)], chunks=chunks, profile_cache=str(cache), progress=False,
                           calibrate=False)
            steps = {"plain": step_of(plain, list(plain.parameters()), xs),
                     "plain compiled": step_of(plain_compiled, list(plain_compiled.parameters()), xs)}
            if chunks > 1:
                steps["accumulated"] = accumulated_step_of(
                    torch.compile(copy.deepcopy(model).to(device), dynamic=False), xs, chunks)
            pipes = []
            for label, compiled in (("stage", False), ("stage compiled", True)):
                copied = copy.deepcopy(model)
                pipe = la.Pipeline(copied, plan, chunks=chunks, compile_stages=compiled)
                pipes.append(pipe)
                steps[label] = step_of(pipe, list(copied.parameters()), xs)
            try:
                medians = interleaved(clock, steps, args.repeats, warmup=3)
            finally:
                for pipe in pipes:
                    pipe.close()
            medians.setdefault("accumulated", medians["plain compiled"])
            ms = {k: f"{1e3 * v:.1f}" for k, v in medians.items()}
            lines.append(f"| {name} | {chunks} | {ms['plain']} | {ms['plain compiled']} | {ms['accumulated']} "
                         f"| {ms['stage']} | {ms['stage compiled']} "
                         f"| {medians['stage compiled'] / medians['plain compiled']:.3f} "
                         f"| {medians['stage compiled'] / medians['accumulated']:.3f} |")
            print(lines[-1], flush=True)
            del plain, plain_compiled, model, pipes
    # 2. memory per stage, predicted against measured, for each recompute mode
    lines += ["", "### Memory of one stage: predicted against the allocator's peak", "",
              "Parameters, gradients and activations (SGD without momentum keeps no state); the measured "
              "peak also holds what the plan does not model, such as the cuBLAS workspace.", "",
              "The prediction counts the micro-batches' outputs joined into one batch on the stage's device, "
              "that batch's gradient, and the loss's workspace where it meets what the stage keeps.", "",
              "| model | recompute | predicted MB | of it, the joined output and its gradient MB "
              "| of it, the loss's workspace MB | measured MB | measured / predicted |",
              "|---|---|---|---|---|---|---|"]
    for name in ("ResNet-50", "GPT-2 (12 x 768)") if "memory" in parts else ():
        for recompute in ("never", "except_last", "always"):
            model, x, cost = profiled(name, 4)
            plan = la.partition(cost, stages=1, chunks=4, devices=[str(device)], recompute=recompute,
                                optimizer_multiplier=0.0)
            baseline = allocated(device)
            with la.Pipeline(model, plan, chunks=4, recompute=recompute) as pipe:
                step = step_of(pipe, list(model.parameters()), x.to(device))
                step()
                measured = peak_bytes(device, step, baseline)
            first = plan.stages[0]
            shown = "n/a | " if measured is None else f"{measured / 1e6:.0f} | {measured / first.memory_bytes:.2f}"
            terms = f"{first.joined_output_bytes / 1e6:.0f} | {first.loss_workspace_bytes / 1e6:.0f}"
            lines.append(f"| {name} | {recompute} | {first.memory_bytes / 1e6:.0f} | {terms} | {shown} |")
            print(lines[-1], flush=True)
            del model, pipe
    # 3. K stages sharing the GPU against the plain module: the runtime's cost per micro-batch
    lines += ["", f"### K stages on one device against the plain module ({args.chunks} micro-batches)", "",
              "| model | K | plain step ms | pipeline step ms | ratio |", "|---|---|---|---|---|"]
    for name in ("ResNet-50", "GPT-2 (12 x 768)") if "shared" in parts else ():
        for stages in (2, 4):
            model, x, cost = profiled(name, args.chunks)
            plain = copy.deepcopy(model).to(device)
            plan = la.partition(cost, stages=stages, chunks=args.chunks, devices=[str(device)] * stages)
            with la.Pipeline(model, plan, chunks=args.chunks) as pipe:
                xs = x.to(device)
                medians = interleaved(clock, {"plain": step_of(plain, list(plain.parameters()), xs),
                                              "pipe": step_of(pipe, list(model.parameters()), xs)}, args.repeats)
            lines.append(f"| {name} | {stages} | {1e3 * medians['plain']:.1f} | {1e3 * medians['pipe']:.1f} "
                         f"| {medians['pipe'] / medians['plain']:.2f} |")
            print(lines[-1], flush=True)
            del plain, model, pipe
    # 4. simulated K-GPU speed-up from the measured profile (a simulation: one GPU is measured)
    lines += ["", f"### Simulated speed-up on K GPUs from this GPU's profile ({args.chunks} micro-batches)", "",
              "A simulation: the plan's predicted step on K identical GPUs (16 GB/s links) against one GPU's, "
              "from the per-operation profile measured here; nothing ran on K GPUs.", "",
              "| model | K=2 | K=4 | K=8 | torchgpipe (published, 8 GPUs) |", "|---|---|---|---|---|"]
    for name in ("ResNet-101", "U-Net", "GPT-2 (12 x 768)") if "simulated" in parts else ():
        _, _, cost = profiled(name, args.chunks)
        one = la.partition(cost, stages=1, chunks=args.chunks, devices=[la.DeviceSpec("gpu0")]).predict_step()
        row = []
        for stages in (2, 4, 8):
            specs = [la.DeviceSpec(f"gpu{k}") for k in range(stages)]
            plan = la.partition(cost, stages=stages, chunks=args.chunks, devices=specs, bandwidth_gbps=16.0)
            row.append(f"{one / plan.predict_step():.2f}x")
        published = f"{TORCHGPIPE_RESNET101_8:.2f}x" if name == "ResNet-101" else ""
        lines.append(f"| {name} | {' | '.join(row)} | {published} |")
        print(lines[-1], flush=True)
    # 5. stages as processes: torch's schedules, one process per GPU (one rank with virtual stages on one GPU)
    if "processes" in parts:
        ranks = torch.cuda.device_count() if device.type == "cuda" else 2
        command = [sys.executable, str(Path(__file__).resolve().parent / "processes_cpu.py"), "--device",
                   device.type, "--ranks", str(ranks), "--chunks", str(args.chunks), "--repeats", str(args.repeats)]
        lines += ["", "### Stages as processes (`schedule=`)", "",
                  f"`{' '.join(['python', 'benchmarks/processes_cpu.py', *command[2:]])}`, run by this command:", ""]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise SystemExit(f"processes_cpu.py failed:\n{done.stderr[-4000:]}")
        lines += done.stdout.strip().splitlines()
        print("\n".join(lines[-30:]), flush=True)
    text = section(START, END, lines)
    publish(text, START, END, "## On a GPU", write=not args.no_write)


if __name__ == "__main__":
    main()
