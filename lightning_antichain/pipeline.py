"""``Pipeline``: a module that runs another module as a micro-batched pipeline over several devices.

    plan = la.partition(la.profile(model, example), stages=2, chunks=8)
    pipe = la.Pipeline(model, plan, chunks=8)
    loss = criterion(pipe(x), y)      # forward: all stages busy at once
    loss.backward()                   # backward: pipelined too, gradients land in model's parameters

The wrapped module keeps its parameters, buffers and ``state_dict()``; the Pipeline only decides
where and in what order its operations run.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from . import microbatch
from .batchnorm import deferred_batch_norm
from .engine import CHECKPOINT_MODES, PassState, run_backward, run_forward
from .plan import Plan
from .split import place_stages, split_stages
from .trace import bind_placeholders, trace
from .worker import WorkerPool, share_malloc_arena


class Pipeline(nn.Module):
    """Run ``module`` as the stages of ``plan``, ``chunks`` micro-batches at a time.

    ``checkpoint`` recomputes activations in backward instead of keeping them: ``"never"``,
    ``"except_last"`` (every micro-batch but the last, whose backward comes first anyway) or
    ``"always"``. ``devices`` overrides the plan's device per stage. Outputs are gathered on
    ``output_device`` (default: the device of the first input tensor, else the first stage's).
    A batch with fewer samples than ``chunks`` runs as that many micro-batches of one sample.
    ``deferred_batch_norm`` updates BatchNorm running statistics once per step from the whole batch
    instead of once per micro-batch (normalisation itself always uses micro-batch statistics).
    ``share_cpu_allocator`` lets worker threads share glibc's main malloc arena when a stage runs
    on CPU (see :func:`lightning_antichain.worker.share_malloc_arena` for why).
    """

    def __init__(
        self,
        module: nn.Module,
        plan: Plan,
        chunks: int = 8,
        checkpoint: str = "never",
        devices: Sequence[str | torch.device] | None = None,
        output_device: str | torch.device | None = None,
        leaf_modules: Sequence[type | str] = (),
        deferred_batch_norm: bool = False,
        share_cpu_allocator: bool = True,
    ) -> None:
        super().__init__()
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
        if chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {chunks}")
        self.module = module
        self.plan = plan
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        self.output_device = None if output_device is None else torch.device(output_device)
        graph = trace(module, fallback=None, leaf_modules=leaf_modules)
        stage_devices = [torch.device(d) for d in (devices or [s.device for s in plan.stages])]
        stages = split_stages(graph, plan, stage_devices)
        place_stages(stages)
        # A plain list: the stages share the module's parameters and must not be registered twice.
        self._stages = stages
        if share_cpu_allocator and any(s.device.type == "cpu" for s in stages):
            share_malloc_arena()
        self._pool = WorkerPool(len(stages))
        #: seconds each stage worked in the last training step (forward and backward; on CUDA the
        #: time to issue the work, not to run it)
        self.last_busy_s: list[float] = [0.0] * len(stages)
        weakref.finalize(self, self._pool.shutdown)
        self._placeholders = [n for n in graph.graph_module.graph.nodes if n.op == "placeholder"]
        self._output_arg = next(n for n in graph.graph_module.graph.nodes if n.op == "output").args[0]

    def close(self) -> None:
        """Stop the worker threads now (they also stop when the Pipeline is garbage collected)."""
        self._pool.shutdown()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stages(self) -> list[Any]:
        return list(self._stages)

    @property
    def devices(self) -> list[torch.device]:
        return [s.device for s in self._stages]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._bind(args, kwargs)
        micro = microbatch.scatter([bound[name] for name in self._stages[0].inputs], self.chunks)
        micro_inputs = [tuple(values) for values in micro]
        output_device = self.output_device or _first_device(args, kwargs) or self._stages[0].device
        needs_grad = torch.is_grad_enabled()
        if not needs_grad:
            outputs = run_forward(self._pool, self._stages, micro_inputs, None, 0)
            return self._assemble(microbatch.gather(outputs, output_device))
        stop = {"never": 0, "except_last": len(micro_inputs) - 1, "always": len(micro_inputs)}[self.checkpoint]
        if not self.training:
            stop = 0
        grad_inputs = [v for v in (bound[name] for name in self._stages[0].inputs) if _is_grad_tensor(v)]
        phony = torch.empty(0, device=output_device, requires_grad=True)
        layout: list[tuple[bool, Any]] = []
        self.last_busy_s = [0.0] * len(self._stages)
        deferral = deferred_batch_norm(self.module.modules()) if self.deferred_batch_norm else nullcontext()
        with deferral:
            options = (output_device, stop, layout, self.last_busy_s)
            tensors = _PipelineFunction.apply((self._pool, self._stages), micro_inputs, options, phony, *grad_inputs)
        it = iter(tensors)
        return self._assemble(tuple(next(it) if is_tensor else constant for is_tensor, constant in layout))

    # -- helpers -------------------------------------------------------------------------------

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        return bind_placeholders(self._placeholders, args, kwargs, f"{type(self.module).__name__}.forward")

    def _assemble(self, gathered: tuple[Any, ...]) -> Any:
        by_name = dict(zip(self._stages[-1].outputs, gathered))
        return fx.node.map_arg(self._output_arg, lambda n: by_name[n.name])


class _PipelineFunction(torch.autograd.Function):
    """Connects the pipeline to the caller's autograd graph: backward runs the stages' backward."""

    @staticmethod
    def forward(ctx, runtime, micro_inputs, options, phony, *grad_inputs):  # noqa: ANN001
        output_device, stop, layout, busy = options
        pool, stages = runtime
        state = PassState(busy=busy)
        outputs = run_forward(pool, stages, micro_inputs, state, stop)
        gathered = microbatch.gather(outputs, output_device)
        layout.extend((isinstance(v, torch.Tensor), None if isinstance(v, torch.Tensor) else v) for v in gathered)
        tensors = tuple(v for v in gathered if isinstance(v, torch.Tensor))
        ctx.pool, ctx.stages, ctx.state = pool, stages, state
        ctx.sizes = [microbatch.batch_size(m) or 1 for m in micro_inputs]
        ctx.layout = list(layout)
        ctx.grad_input_slots = [i for i, v in enumerate(micro_inputs[0]) if _is_grad_tensor(v)]
        ctx.input_devices = [v.device for v in grad_inputs]
        ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])
        return tensors

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001
        count = len(ctx.sizes)
        per_output: list[list[Any]] = []
        it = iter(grads)
        for is_tensor, _ in ctx.layout:
            grad = next(it) if is_tensor else None
            per_output.append(list(torch.split(grad, ctx.sizes)) if grad is not None else [None] * count)
        output_grads = [tuple(g[m] for g in per_output) for m in range(count)]
        input_grads = run_backward(ctx.pool, ctx.stages, ctx.state, output_grads)
        ctx.state = None
        result: list[Any] = [None, None, None, None]
        for slot, device in zip(ctx.grad_input_slots, ctx.input_devices):
            parts = [input_grads[m][slot] for m in range(count)]
            if any(p is None for p in parts):
                result.append(None)
            else:
                result.append(torch.cat([p.to(device) for p in parts], dim=0))
        return tuple(result)


def _is_grad_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point()


def _first_device(args: tuple, kwargs: dict) -> torch.device | None:
    from .trace import iter_tensors

    first = next(iter_tensors((args, kwargs)), None)
    return None if first is None else first.device
