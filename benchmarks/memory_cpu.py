"""Predicted against measured memory per stage: what each stage keeps for backward, and its
parameters, gradients and optimizer state.

For each model: profile one micro-batch, plan K stages for each recompute mode, run one training
step with Adam through the pipeline with ``measure_activations=True``, and compare per stage:

* kept for backward: the plan's prediction (``memory_bytes`` less parameters, gradients, Adam state
  and buffers) against the most bytes the stage kept at once, counted by the runtime through
  ``saved_tensors_hooks`` (each storage once; the micro-batches' stage inputs and outputs included);
  also the prediction of the older model, which took every operation's output to be kept;
* parameters, gradients and Adam state: predicted against the bytes of the stage's tensors (a
  parameter that stages share counts in the first that uses it, as in the plan).

On CPU there is no allocator peak per device; on a GPU, torch.cuda.max_memory_allocated is the
check (issue 11).

    python benchmarks/memory_cpu.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torchvision

import lightning_antichain as la

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from harness import machine, publish, section  # noqa: E402
from zoo import ZOO, NanoGPT  # noqa: E402

START, END = "<!-- memory-cpu:start -->", "<!-- memory-cpu:end -->"
GPT_CONFIG = {"vocab": 256, "width": 128, "heads": 4, "layers": 4, "block_size": 64}
MODES = ("never", "except_last", "always")


def make(name: str, batch: int) -> tuple[torch.nn.Module, tuple, dict]:
    """The model in training mode and one batch for it."""
    if name == "gpt":
        model = NanoGPT(**GPT_CONFIG)
        return model.train(), (torch.randint(0, GPT_CONFIG["vocab"], (batch, GPT_CONFIG["block_size"])),), {}
    if name in ZOO and ZOO[name].library == "transformers":
        args, kwargs = ZOO[name].batch(batch)
        return ZOO[name].build().train(), args, kwargs
    return getattr(torchvision.models, name)(num_classes=10).train(), (torch.randn(batch, 3, 32, 32),), {}


def first_micro_batch(args: tuple, kwargs: dict, size: int) -> tuple | dict:
    if kwargs:
        return {k: v[:size] for k, v in kwargs.items()}
    return tuple(a[:size] for a in args) if len(args) > 1 else args[0][:size]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def kept_prediction(plan: la.Plan, stage: la.Stage) -> int:
    """What the plan has ``stage`` keep for backward: its memory less its weights, gradients,
    optimizer state and buffers, and less the pipeline's output joined from the micro-batches and
    the loss's workspace, which the stage that makes the model's output also holds."""
    return (stage.memory_bytes - int(stage.param_bytes * (2 + plan.optimizer_multiplier)) - stage.buffer_bytes
            - stage.joined_output_bytes - stage.loss_workspace_bytes)


def adam_state_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """Bytes of the optimizer's state tensors shaped like their parameter (Adam's two moments; its
    scalar step counters are not the parameter's size), counted here, apart from the planner."""
    return sum(t.numel() * t.element_size() for p in params for t in optimizer.state.get(p, {}).values()
               if isinstance(t, torch.Tensor) and t.shape == p.shape)


def loss_of(output) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, tuple) else output.logits
    return logits.float().square().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["resnet50", "gpt", "densenet121", "hf_gpt2"])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmark-runs.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        "| model | recompute | kept for backward per stage, predicted MB | measured MB | predicted / measured "
        "(worst stage) | same, by output sizes (before) | parameters, gradients, Adam state: worst error |",
        "|---|---|---|---|---|---|---|",
    ]
    worst_overall, exact, stages_seen = 1.0, 0, 0
    for name in args.models:
        torch.manual_seed(0)
        model, batch_args, batch_kwargs = make(name, args.batch_size)
        example = first_micro_batch(batch_args, batch_kwargs, args.batch_size // args.chunks)
        cost = la.profile(model, example, progress=False, repeats=1, warmup=0, runtime_overhead=False, name=name)
        by_outputs = cost.copy()
        by_outputs.graph["saved_counted"] = False
        for mode in MODES:
            plan = la.partition(cost, args.stages, chunks=args.chunks, recompute=mode)
            before = la.plan_from_balance(by_outputs, [len([v for v in s.nodes if not cost.nodes[v]["pinned"]])
                                                       for s in plan.stages], chunks=args.chunks, recompute=mode)
            optimizer = torch.optim.Adam(model.parameters())
            optimizer.zero_grad(set_to_none=True)
            with la.Pipeline(model, plan, chunks=args.chunks, recompute=mode, measure_activations=True) as pipe:
                loss_of(pipe(*batch_args, **batch_kwargs)).backward()
                optimizer.step()
                measured = pipe.last_activation_bytes
                state_error, seen = 0.0, set()
                for spec, stage in zip(plan.stages, pipe.stages):
                    # a parameter that stages share (tied weights) counts in the first, as the plan counts it
                    params = [p for p in stage.parameters() if id(p) not in seen]
                    seen.update(id(p) for p in params)
                    actual = nbytes(params) + nbytes(p.grad for p in params) + adam_state_bytes(optimizer, params)
                    if actual:
                        state_error = max(state_error, abs(spec.param_bytes * 4 - actual) / actual)
            predicted = [kept_prediction(plan, s) for s in plan.stages]
            old = [kept_prediction(before, s) for s in before.stages]
            ratios = [p / m for p, m in zip(predicted, measured)]
            exact += sum(p == m for p, m in zip(predicted, measured))
            stages_seen += len(measured)
            old_ratios = [p / m for p, m in zip(old, measured)]
            worst = max(ratios, key=lambda r: abs(r - 1))
            worst_overall = max(worst_overall, worst, 1 / worst, key=lambda r: abs(r - 1))
            mb = lambda values: ", ".join(f"{v / 1e6:.2f}" for v in values)  # noqa: E731
            lines.append(
                f"| {name} ({plan.frontend}) | {mode} | {mb(predicted)} | {mb(measured)} | {worst:.3f} "
                f"| {max(old_ratios, key=lambda r: abs(r - 1)):.2f} | {state_error:.1%} |"
            )
            print(lines[-1], file=sys.stderr)
    text = section(
        START,
        END,
        [
            f"Machine: {machine(1)}; batch {args.batch_size} in {args.chunks} micro-batches, {args.stages} stages, "
            "Adam, one training step per recompute mode. GPT: nanoGPT-style, "
            f"{GPT_CONFIG}; hf_gpt2: the tests' tiny GPT-2 config.",
            "",
            *lines,
            "",
            f"Worst predicted / measured over all stages: {worst_overall:.4f}; predicted to the byte in {exact} of "
            f"{stages_seen} stages.",
        ],
    )
    publish(text, START, END, "## Memory per stage on CPU", write=not args.no_write)


if __name__ == "__main__":
    main()
