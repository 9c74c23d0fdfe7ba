"""The target cost model's efficiencies fitted on the GPU at hand, and each operation of a Llama
decoder predicted against its time measured there.

The planner costs operations on GPUs it does not have from their FLOPs and bytes on the GPU's
roofline, at a share of the published peaks per kind of kernel (``plan --gpu``). This script
times, on the GPU at hand, the operations of a Llama-3.1-8B decoder layer at several shapes in
bf16 (the projections' matrix products, fused attention, RMSNorm, SwiGLU, rotary embedding, the
residual adds, the embedding, the loss over the vocabulary, AdamW's step), fits the shares to
them (:func:`lightning_antichain.planner.efficiency_fit.fit_efficiencies`), writes them with the
GPU's name and the date, and prints each operation's predicted time against its measured time,
at the assumed shares and at the fitted ones. Then a two-layer Llama as the planner sees it:
every captured operation's forward and backward costed by the target model at the fitted shares,
against the same operation timed on the GPU by the measured profile (both one operation at a
time, as the planner replays them).

    python benchmarks/fit_efficiencies.py --gpu H200                   # on the GPU machine
    python benchmarks/fit_efficiencies.py --gpu H100 --gpu-device cpu --small   # a dry run here

Times are medians of ``--repeats`` runs after two warm-ups, from
:func:`lightning_antichain.device.timed` (CUDA events, or the host's time to issue where longer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_antichain.device import timed
from lightning_antichain.planner.efficiency_fit import TimedOperation, fit_efficiencies
from lightning_antichain.planner.roofline import Efficiencies, RooflineClock
from lightning_antichain.planner.target_devices import TargetDevice, target_device

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine  # noqa: E402

TOLERANCE = 0.15


@dataclass(frozen=True)
class Shapes:
    """A Llama decoder's widths (Llama-3.1-8B's unless ``--small``) and the token counts timed."""

    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128256
    tokens: tuple[int, ...] = (1024, 4096, 16384)
    #: (batch, sequence) of the attention timed
    attention: tuple[tuple[int, int], ...] = ((1, 2048), (2, 4096), (1, 8192))
    #: the parameters of the optimizer step timed
    optimizer_parameters: int = 2**28

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def small(self) -> Shapes:
        return Shapes(256, 896, 4, 2, 4096, (64, 256), ((1, 128), (2, 256)), 2**20)


@dataclass
class Operation:
    """An operation to time: ``make(device, dtype)`` returns its function and its inputs; the
    inputs that require gradients are differentiated (and any parameters of the function)."""

    name: str
    make: Callable[[torch.device, torch.dtype], tuple[Callable[..., Any], tuple]]
    backward: bool = True


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm, as it runs eagerly."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return weight * x.to(dtype)


def _rotary(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor."""
    half = q.shape[-1] // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return q * cos + rotated * sin


def operations(s: Shapes) -> list[Operation]:
    """The decoder's operations at each shape timed."""
    def tensor(*shape: int, grad: bool = True, dtype: torch.dtype | None = None) -> Callable[..., torch.Tensor]:
        return lambda device, default: torch.randn(*shape, device=device, dtype=dtype or default,
                                                   requires_grad=grad)

    def make(fn: Callable[..., Any], *inputs: Callable[..., torch.Tensor]) -> Callable[..., tuple]:
        return lambda device, dtype: (fn, tuple(make_input(device, dtype) for make_input in inputs))

    ops: list[Operation] = []
    kv = s.kv_heads * s.head_dim
    projections = {"q_proj": (s.hidden, s.hidden), "k_proj": (s.hidden, kv), "o_proj": (s.hidden, s.hidden),
                   "gate_proj": (s.hidden, s.intermediate), "down_proj": (s.intermediate, s.hidden),
                   "lm_head": (s.hidden, s.vocab)}
    for tokens in s.tokens:
        for name, (fan_in, fan_out) in projections.items():
            if name == "lm_head" and tokens != s.tokens[len(s.tokens) // 2]:
                continue
            ops.append(Operation(f"{name} {tokens} x {fan_in} -> {fan_out}",
                                 make(F.linear, tensor(tokens, fan_in), tensor(fan_out, fan_in))))
    for batch, length in s.attention:
        shape = (batch, s.heads, length, s.head_dim)
        ops.append(Operation(f"attention (causal) {batch} x {s.heads} heads x {length}",
                             make(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                  tensor(*shape), tensor(*shape), tensor(*shape))))
    for tokens in s.tokens:
        ops.append(Operation(f"RMSNorm {tokens} x {s.hidden}", make(_rms_norm, tensor(tokens, s.hidden),
                                                                    tensor(s.hidden))))
        ops.append(Operation(f"SwiGLU {tokens} x {s.intermediate}",
                             make(lambda g, u: F.silu(g) * u, tensor(tokens, s.intermediate),
                                  tensor(tokens, s.intermediate))))
        ops.append(Operation(f"residual add {tokens} x {s.hidden}",
                             make(torch.add, tensor(tokens, s.hidden), tensor(tokens, s.hidden))))
        ops.append(Operation(f"rotary {tokens} x {s.heads} x {s.head_dim}",
                             make(_rotary, tensor(tokens, s.heads, s.head_dim),
                                  *[tensor(tokens, 1, s.head_dim, grad=False)] * 2)))
    middle = s.tokens[len(s.tokens) // 2]
    ids = lambda device, dtype: torch.randint(0, s.vocab, (middle,), device=device)  # noqa: E731
    ops.append(Operation(f"embedding {middle} of {s.vocab} x {s.hidden}",
                         make(F.embedding, ids, tensor(s.vocab, s.hidden))))
    ops.append(Operation(f"cross-entropy (float32) {middle} x {s.vocab}",
                         make(lambda logits, labels: F.cross_entropy(logits.float(), labels),
                              tensor(middle, s.vocab), ids)))
    return ops


def _inputs_needing_grad(inputs: tuple) -> list[torch.Tensor]:
    return [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]


def _measured(op: Operation, device: torch.device, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds on ``device``."""
    fn, inputs = op.make(device, dtype)
    wrt = _inputs_needing_grad(inputs)
    forwards, backwards = [], []
    def backward_of(out: torch.Tensor) -> Callable[[], Any]:
        grad = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, wrt, grad)

    for round_ in range(repeats + 2):
        forward, out = timed(device, lambda: fn(*inputs))
        backward, _ = timed(device, backward_of(out))
        if round_ >= 2:
            forwards.append(forward)
            backwards.append(backward)
    return statistics.median(forwards), statistics.median(backwards)


def _counted(op: Operation, gpu: TargetDevice, dtype: torch.dtype) -> tuple[TimedOperation, TimedOperation]:
    """The kernels the roofline counts for the operation's forward and backward, on meta."""
    fn, inputs = op.make(torch.device("meta"), dtype)
    wrt = _inputs_needing_grad(inputs)
    clock = RooflineClock(gpu)
    _, out = clock(lambda: fn(*inputs))
    forward = clock.tally
    grad = torch.empty_like(out)
    clock(lambda: torch.autograd.grad(out, wrt, grad))
    backward = clock.tally
    return (TimedOperation(f"{op.name} forward", tuple(forward.kernels), forward.dispatches, 0.0),
            TimedOperation(f"{op.name} backward", tuple(backward.kernels), backward.dispatches, 0.0))


def _optimizer_step(parameters: int, device: torch.device, dtype: torch.dtype, repeats: int,
                    gpu: TargetDevice) -> tuple[float, Callable[[Efficiencies], float]]:
    """AdamW's step (foreach) over ``parameters`` in ``dtype``: measured, and as the target model
    prices it (:meth:`~lightning_antichain.planner.target_profile.TargetModel.optimizer_step_s`)."""
    from lightning_antichain.planner.target_profile import TargetModel

    tensors = [torch.zeros(parameters // 8, device=device, dtype=dtype, requires_grad=True) for _ in range(8)]
    for t in tensors:
        t.grad = torch.randn_like(t)
    optimizer = torch.optim.AdamW(tensors, lr=1e-4, foreach=True)
    times = [timed(device, optimizer.step)[0] for _ in range(repeats + 2)][2:]
    nbytes = parameters * tensors[0].element_size()
    # AdamW keeps two moments of the parameters' dtype
    return statistics.median(times), lambda eff: TargetModel(gpu, eff).optimizer_step_s(nbytes, 2.0)


def _decoder_layers(s: Shapes, layers: int, device: torch.device, dtype: torch.dtype, sequence: int,
                    gpu: TargetDevice, efficiencies: Efficiencies, repeats: int) -> list[tuple[str, float, float]]:
    """Every captured operation of a ``layers``-layer Llama: (name, predicted, measured) seconds
    of its forward and backward, predicted by the target model, measured by the profile on ``device``."""
    import transformers

    import lightning_antichain as la
    from lightning_antichain.capture import trace
    from lightning_antichain.planner.target_profile import TargetModel

    config = transformers.LlamaConfig(hidden_size=s.hidden, intermediate_size=s.intermediate,
                                      num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                                      num_hidden_layers=layers, vocab_size=s.vocab, max_position_embeddings=sequence,
                                      attn_implementation="sdpa", use_cache=False)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    ids = torch.randint(0, s.vocab, (1, sequence), device=device)

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.llama = model

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.llama(input_ids=input_ids, use_cache=False).logits

    wrapped = Logits()
    graph = trace(wrapped, ids, progress=False)
    measured = la.profile(wrapped, ids, device, op_graph=graph, repeats=repeats, warmup=2, progress=False,
                          runtime_overhead=False, just_in_time=True)
    predicted = TargetModel(gpu, efficiencies).profile(wrapped, graph, (ids,), {}, progress=False)
    rows = []
    for node in measured.nodes:
        if node not in predicted.nodes:
            continue
        m, p = measured.nodes[node], predicted.nodes[node]
        rows.append((str(node), p["forward_s"] + p["backward_s"], m["forward_s"] + m["backward_s"]))
    return rows


def _within(predicted: float, measured: float) -> bool:
    return measured > 0 and abs(predicted / measured - 1) <= TOLERANCE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="H200", help="the GPU's name in the planner's table (its peaks)")
    parser.add_argument("--gpu-device", default="cuda:0", help="where to time (cpu: a dry run)")
    parser.add_argument("--small", action="store_true", help="small widths (a dry run on the CPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the whole-model comparison")
    parser.add_argument("--sequence", type=int, default=4096, help="tokens of the whole-model comparison")
    parser.add_argument("--out", default=None, help="write the fitted efficiencies here (JSON; "
                                                    "default benchmarks/configs/efficiencies/<gpu>.json; on the CPU, "
                                                    "a dry run, nothing unless given)")
    args = parser.parse_args()
    device = torch.device(args.gpu_device)
    gpu = target_device(args.gpu)
    shapes = Shapes().small() if args.small else Shapes()
    dtype = torch.bfloat16
    torch.manual_seed(0)
    print(f"# Efficiencies of {gpu.name} fitted on {device} ({machine()})\n", flush=True)

    timed_ops: list[TimedOperation] = []
    for op in operations(shapes):
        forward, backward = _measured(op, device, dtype, args.repeats)
        counted = _counted(op, gpu, dtype)
        for half, seconds in zip(counted, (forward, backward)):
            timed_ops.append(TimedOperation(half.name, half.kernels, half.dispatches, seconds))
        print(f"timed {op.name}: {forward * 1e3:.3f} ms forward, {backward * 1e3:.3f} ms backward", flush=True)
    step_s, step_priced = _optimizer_step(shapes.optimizer_parameters, device, dtype, args.repeats, gpu)

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()
    source = (f"fitted on {device_name} ({gpu.name}'s peaks) on {when} by benchmarks/fit_efficiencies.py, "
              f"torch {torch.__version__}: {len(timed_ops)} timings of a Llama decoder's operations in bf16")
    assumed = Efficiencies()
    fitted = fit_efficiencies(timed_ops, gpu, source, assumed)

    print("\n| operation | measured ms | predicted ms, assumed | ratio | predicted ms, fitted | ratio | decided by |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    within = 0
    for op in timed_ops:
        before, after = op.predicted_s(gpu, assumed), op.predicted_s(gpu, fitted)
        within += _within(after, op.measured_s)
        print(f"| {op.name} | {op.measured_s * 1e3:.4g} | {before * 1e3:.4g} | {before / op.measured_s:.2f} | "
              f"{after * 1e3:.4g} | {after / op.measured_s:.2f} | {op.dominant_kind(gpu, fitted) or 'mixed'} |")
    print(f"| AdamW step, {shapes.optimizer_parameters:,} parameters | {step_s * 1e3:.4g} | "
          f"{step_priced(assumed) * 1e3:.4g} | {step_priced(assumed) / step_s:.2f} | {step_priced(fitted) * 1e3:.4g} "
          f"| {step_priced(fitted) / step_s:.2f} | elementwise |")
    print(f"\n{within} of {len(timed_ops)} operations within {TOLERANCE:.0%} at the fitted efficiencies\n")
    print("fitted:", json.dumps({"compute": fitted.compute, "memory": fitted.memory,
                                 "dispatch_s": fitted.dispatch_s}, indent=None))
    if args.out or device.type != "cpu":
        out = Path(args.out) if args.out else (Path(__file__).resolve().parent / "configs" / "efficiencies"
                                               / f"{gpu.name}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        fitted.save(out)
        print(f"written to {out}\n", flush=True)
    else:  # a dry run's factors are the CPU's, not the GPU's: never where --efficiencies users look
        print("a dry run on the CPU: nothing written (--out to keep it)\n", flush=True)

    rows = _decoder_layers(shapes, args.layers, device, dtype, 256 if args.small else args.sequence, gpu, fitted,
                           args.repeats)
    total_p, total_m = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"## A {args.layers}-layer Llama, every captured operation's forward and backward\n")
    print("| operation | measured ms | predicted ms | ratio |")
    print("| --- | --- | --- | --- |")
    for name, predicted, measured in sorted(rows, key=lambda r: -r[2]):
        ratio = f"{predicted / measured:.2f}" if measured > 0 else ""
        print(f"| {name} | {measured * 1e3:.4g} | {predicted * 1e3:.4g} | {ratio} |")
    heavy = [r for r in rows if r[2] >= 0.01 * total_m]
    print(f"\nwhole model: predicted {total_p * 1e3:.4g} ms, measured {total_m * 1e3:.4g} ms, ratio "
          f"{total_p / total_m:.2f}; operations of at least 1% of it within {TOLERANCE:.0%}: "
          f"{sum(_within(p, m) for _, p, m in heavy)} of {len(heavy)}; all operations: "
          f"{sum(_within(p, m) for _, p, m in rows)} of {len(rows)}")


if __name__ == "__main__":
    main()
