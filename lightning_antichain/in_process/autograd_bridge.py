"""The bridge between a pipelined forward and the caller's autograd graph.

The Pipeline runs its stages' forward itself and gathers their outputs; :class:`PipelineFunction`
then hands those tensors to autograd as the outputs of one node whose backward splits the output
gradients into micro-batches and runs the stages' backward (:func:`~.engine.run_backward`), one
worker per stage, returning the gradients of the caller's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .engine import PassState, run_backward
from .worker import WorkerPool


@dataclass
class PipelineBackward:
    """What the backward of one training call needs: the engine's pass state, the gathered output
    tensors (handed to autograd by the Function, then dropped here), how they split back into
    micro-batches, and where the caller's inputs that want gradients sit."""

    pool: WorkerPool
    state: PassState | None
    count: int
    outputs: tuple[torch.Tensor, ...]
    output_dims: list[Any]
    output_sizes: list[list[int]]
    output_is_tensor: list[bool]
    leaf_positions: list[int] | None
    leaf_count: int
    grad_input_slots: list[int]
    input_dims: list[int]
    input_devices: list[torch.device]


class PipelineFunction(torch.autograd.Function):
    """Connects a pipelined forward, already run, to the caller's autograd graph: its backward runs
    the stages' backward."""

    @staticmethod
    def forward(ctx, backward: PipelineBackward, phony: torch.Tensor, *grad_inputs: torch.Tensor):  # noqa: ANN001
        outputs, backward.outputs = backward.outputs, ()  # autograd keeps them; the plan must not
        ctx.backward = backward
        ctx.mark_non_differentiable(*[t for t in outputs if not t.is_floating_point()])
        return outputs

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001
        try:
            return PipelineFunction.pipelined_backward(ctx.backward, grads)
        except (KeyboardInterrupt, SystemExit):
            ctx.backward.pool.shutdown()  # wherever the interrupt landed, no worker outlives it
            raise

    @staticmethod
    def pipelined_backward(plan: PipelineBackward, grads: tuple) -> tuple:
        count = plan.count
        per_output: list[list[Any]] = []
        it = iter(zip(grads, plan.output_sizes, plan.output_dims))
        for is_tensor in plan.output_is_tensor:
            grad, sizes, dim = next(it) if is_tensor else (None, None, 0)
            weights = getattr(dim, "weights", None)  # a loss joined as a weighted sum
            if grad is None:
                per_output.append([None] * count)
            elif weights is not None:
                per_output.append([w * grad for w in weights])
            else:
                per_output.append(list(torch.split(grad, sizes, dim)))
        output_grads = [tuple(g[m] for g in per_output) for m in range(count)]
        if plan.leaf_positions is not None:  # leaves only kept for attributes get no gradient
            output_grads = [spread(grads, plan.leaf_positions, plan.leaf_count) for grads in output_grads]
        if plan.state is None:
            raise RuntimeError("backward ran twice through one pipelined forward (retain_graph=True?): the stages "
                               "free what they keep for backward as they go, so call the pipeline again instead")
        input_grads = run_backward(plan.pool, plan.state, output_grads)
        plan.state = None
        result: list[Any] = [None, None]
        for slot, device, dim in zip(plan.grad_input_slots, plan.input_devices, plan.input_dims):
            parts = [input_grads[m][slot] for m in range(count)]
            if any(p is None for p in parts):
                result.append(None)
            else:
                result.append(torch.cat([p.to(device) for p in parts], dim=dim))
        return tuple(result)


def spread(grads: tuple[Any, ...], positions: list[int], count: int) -> tuple[Any, ...]:
    full: list[Any] = [None] * count
    for position, grad in zip(positions, grads):
        full[position] = grad
    return tuple(full)
