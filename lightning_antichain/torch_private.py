"""The names of torch's private API the package uses, in one place.

Each torch release may move or change a private name; here is where to look when one does, and
nothing else in the package imports one (``tests/test_torch_private.py`` counts them). Some are
private in name only and are what torch's own libraries and its documentation use:
``torch.utils._pytree`` for nested values, ``TorchDispatchMode`` for a mode over ATen calls, the
``OpOverload`` types every exported graph's targets are. Others reach into torch's internals,
each for the reason its comment gives.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx.experimental._config as fx_config  # noqa: F401 (re-exported)
import torch.utils._pytree as pytree  # noqa: F401 (re-exported)
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket  # noqa: F401 (re-exported)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode  # noqa: F401 (re-exported)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as load_state_dict_planned  # noqa: F401
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining.schedules import _Action as Action  # noqa: F401 (re-exported)
from torch.distributed.pipelining.schedules import _add_send_recv as add_send_recv  # noqa: F401 (re-exported)
from torch.distributed.pipelining.schedules import _ComputationType as ComputationType  # noqa: F401 (re-exported)
from torch.distributed.pipelining.schedules import (  # noqa: F401 (re-exported)
    _PipelineScheduleRuntime as ScheduleRuntime,  # the runtime of torch's action tables, with comms added
)
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase  # noqa: F401 (re-exported)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 (re-exported)
from torch.utils._pytree import tree_map_only  # noqa: F401 (re-exported)

#: ``torch._assert``: the assertion fx traces where it cannot trace ``assert``
torch_assert = torch._assert

#: ATen's matrix products whose names are private: FP8's scaled product, the convolution behind
#: ``convolution``, and the grouped product mixtures of experts run their experts with
SCALED_MM = torch.ops.aten._scaled_mm
CONVOLUTION_IMPL = torch.ops.aten._convolution
GROUPED_MM = torch.ops.aten._grouped_mm


def split_backward() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """torch's split backward of pipeline stages (``torch.distributed.pipelining._backward``), as
    zero-bubble schedules run it: a tensor's gradient function (or its accumulator), the reverse
    graph from some of them, the input pass and the weight pass."""
    from torch.distributed.pipelining import _backward

    return (_backward._get_grad_fn_or_grad_acc, _backward.construct_reverse_graph, _backward.stage_backward_input,
            _backward.stage_backward_weight)


@contextmanager
def batch_waits_through(wrap: Callable[[Callable[[Any], Any]], Callable[[Any], Any]]) -> Iterator[None]:
    """Within, torch's schedules wait for a batch of sends and receives through ``wrap(wait)``
    (``wait``: torch's own): the one place a schedule's transfers can be timed or watched, as
    torch's schedules call the module's ``_wait_batch_p2p`` for every batch of them."""
    waited = _torch_schedules._wait_batch_p2p
    _torch_schedules._wait_batch_p2p = wrap(waited)
    try:
        yield
    finally:
        _torch_schedules._wait_batch_p2p = waited


def wrap_shape_inference(stage: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Have torch's pipeline ``stage`` infer its outputs' shapes (the made-up forward it runs
    before the first step, when it was given no output shapes) through ``wrap(infer)``."""
    stage._forward_metadata_inference = wrap(stage._forward_metadata_inference)


def runtime_of_actions(stages: list[Any], chunks: int, loss_fn: Callable[..., Any],
                       actions: dict[int, list[Action]]) -> Any:
    """torch's runtime for tables of actions running this rank's ``stages`` in the order
    ``actions`` (every rank's, computation only) gives, with the sends and receives added as
    torch's own schedules add them (``scale_grads=False``: the loss is scaled where it is made).
    torch reads such tables from CSV files only; this gives it one made in memory."""
    runner = ScheduleRuntime(stages, chunks, loss_fn=loss_fn, scale_grads=False)
    runner._prepare_schedule_with_comms(actions)
    return runner


def step_micro_batches(runner: Any, arg_mbs: list[tuple] | None, target_mbs: list | None, train: bool) -> None:
    """One batch of micro-batches already split through torch's schedule ``runner``, forward and
    backward (``train``) or forward only, on a torch (2.13) whose ``step`` and ``eval`` take whole
    batches only: what ``step`` does before it runs the micro-batches, then its inner step,
    without joining the last stage's outputs."""
    stages = runner._stages if hasattr(runner, "_stages") else [runner._stage]
    had_backward = runner._has_backward
    runner._has_backward = had_backward and train
    try:
        for stage in stages:
            stage.has_backward = runner._has_backward
            stage.clear_runtime_states()
        takes = inspect.signature(runner._step_microbatches).parameters
        runner._step_microbatches(arg_mbs, None, target_mbs, None,
                                  **({"return_outputs": False} if "return_outputs" in takes else {}))
    finally:
        runner._has_backward = had_backward
