"""A custom autograd Function reaches the stages as one operation with its own backward.

Every frontend traced through ``Function.apply`` into ``forward``: a gradient-reversal layer then
trained as if it were not there, and a Python decision inside ``forward`` was frozen at capture.
Each Function below has a backward that is not its forward's derivative, so tracing through it
changes the gradients: every 2-stage cut (before, at and after the Function) and the 3-stage cuts
around it must give the plain module's output and gradients in float64, whatever the frontend.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from pipelined import assert_pipelined
from torch import nn

import lightning_antichain as la
from lightning_antichain.capture import capture
from lightning_antichain.capture.autograd_functions import FunctionApply, FunctionCall

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from differential_cases import FunctionCalls  # noqa: E402  (the differential check's rows)


def reference(model: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    output = model(x)
    (output * weights).sum().backward()
    return output.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(model: nn.Module, output: torch.Tensor, expected: torch.Tensor, grads: dict, where: str) -> None:
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=1e-12, msg=where)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-9, atol=1e-12, msg=f"{where}: {name}")


@pytest.mark.parametrize("function", ["reverse", "round", "saved"])
@pytest.mark.parametrize("frontend", ["fx", "export", "concrete"])
def test_a_function_is_one_operation_and_every_cut_around_it_trains_as_the_plain_module(function, frontend):
    torch.manual_seed(0)
    model = FunctionCalls(function).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    graph = capture(model, x[:2], frontends=(frontend,))
    assert graph.frontend == frontend
    calls = [n for n in graph.graph_module.graph.nodes if isinstance(n.target, (FunctionCall, FunctionApply))]
    assert len(calls) == 1, graph.graph_module.code  # kept whole: not traced into
    cost = la.profile(model, x[:2], op_graph=graph, repeats=1, warmup=0, progress=False)
    weights = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected, grads = reference(model, x, weights)
    operations = [n.name for n in graph.nodes if n.kind != "placeholder"]
    at = operations.index(calls[0].name)
    balances = [[first, len(operations) - first] for first in range(1, len(operations))]
    balances += [[at, 1, len(operations) - at - 1]]  # the Function alone in the middle stage
    for balance in balances:
        plan = la.plan_from_balance(cost, balance, chunks=3)
        model.zero_grad(set_to_none=True)
        with la.Pipeline(model, plan, chunks=3, graph=graph) as pipe:
            output = pipe(x)
            (output * weights).sum().backward()
            assert_pipelined(pipe, stages=len(balance))
        assert_same(model, output, expected, grads, f"{frontend}, stages of {balance} operations")


class Checked(torch.autograd.Function):
    """A Function that decides in Python on a flag each time it runs."""

    fail = False

    @staticmethod
    def forward(ctx, x):
        if Checked.fail:
            raise RuntimeError("the Function's forward ran its check")
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_the_python_inside_a_function_runs_each_time_not_once_at_capture(frontend):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner[2](Checked.apply(self.inner[1](self.inner[0](x))))

    wrapped = Model()
    x = torch.randn(4, 4, dtype=torch.float64)
    graph = capture(wrapped, x[:2], frontends=(frontend,))
    cost = la.profile(wrapped, x[:2], op_graph=graph, repeats=1, warmup=0, progress=False)
    plan = la.plan_from_balance(cost, [2, len(cost) - 2], chunks=2)
    with la.Pipeline(wrapped, plan, chunks=2, graph=graph) as pipe:
        torch.testing.assert_close(pipe(x), wrapped(x))
        Checked.fail = True
        try:
            with pytest.raises(RuntimeError, match="the Function's forward ran its check"):
                pipe(x)
        finally:
            Checked.fail = False


class Recomputed(torch.autograd.Function):
    """Runs a block without keeping its activations and again in backward, as reentrant
    checkpointing does: the Function is handed the module it runs."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block.inner(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            torch.autograd.backward(ctx.block.inner(x), grad)
        return x.grad, None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def inner(self, x):
        return self.b(torch.tanh(self.a(x)))

    def forward(self, x):
        return Recomputed.apply(x, self)


def test_a_function_given_a_module_to_run_keeps_the_calling_module_whole_and_trains_as_plain():
    """A Function handed the module it runs reads parameters that are no argument of its call, so
    no stage would know it holds them. The capture does not take the call apart from its module:
    the leaf frontend keeps the block that calls it whole, and says why the others refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), Block(), nn.Tanh(), Block(), nn.Linear(6, 3)).double()
    x = torch.randn(6, 6, dtype=torch.float64)
    graph = capture(model, x[:2])
    assert graph.frontend == "leaves" and graph.note == "kept whole: 1, 3"
    assert "Recomputed.apply is given the module Block" in graph.refused[0], graph.refused
    assert "use_reentrant=False" in graph.refused[0]
    cost = la.profile(model, x[:2], op_graph=graph, repeats=1, warmup=0, progress=False)
    weights = torch.randn(6, 3, dtype=torch.float64)
    expected, grads = reference(model, x, weights)
    plan = la.plan_from_balance(cost, [2, len(cost) - 2], chunks=3)
    model.zero_grad(set_to_none=True)
    with la.Pipeline(model, plan, chunks=3, graph=graph) as pipe:
        output = pipe(x)
        (output * weights).sum().backward()
    assert_same(model, output, expected, grads, "blocks run by a Function")


class Counted(torch.autograd.Function):
    """Returns a Python number beside its tensor, which the graph holds as captured."""

    count = 3

    @staticmethod
    def forward(ctx, x):
        return x + 1, Counted.count

    @staticmethod
    def backward(ctx, grad, _):
        return grad


def test_a_number_a_function_returns_is_checked_each_call_against_the_captured_one():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            y, n = Counted.apply(self.a(x))
            return y * n

    model = Model().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    graph = capture(model, x[:2], frontends=("export",))
    torch.testing.assert_close(graph.graph_module(x)[0], model(x))
    Counted.count = 4
    try:
        with pytest.raises(RuntimeError, match=r"Counted.apply returned \(<tensor>, 4\) where the captured graph has "
                                               r"\(<tensor>, 3\)"):
            graph.graph_module(x)
    finally:
        Counted.count = 3


def _halved(t):
    return t / 2


class Mapped(torch.autograd.Function):
    """Applies a plain function given as an argument; its backward is a fixed scale, not the derivative."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return 3 * grad, None


def test_a_function_given_a_plain_function_is_kept_whole_and_one_closing_over_a_module_is_refused():
    class Model(nn.Module):
        def __init__(self, closing: bool):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
            self.closing = closing

        def forward(self, x):
            if self.closing:
                return self.b(Mapped.apply(self.a(x), lambda t: self.b(t) @ self.b.weight))
            return self.b(Mapped.apply(self.a(x), _halved))

    model = Model(closing=False).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    graph = capture(model, x[:2], frontends=("fx",))
    assert sum(isinstance(n.target, FunctionCall) for n in graph.graph_module.graph.nodes) == 1
    model(x).sum().backward()
    expected = model.a.weight.grad.clone()
    model.zero_grad()
    graph.graph_module(x).sum().backward()
    torch.testing.assert_close(model.a.weight.grad, expected)  # the backward's 3x, not the derivative's 1/2
    with pytest.raises(Exception, match="Mapped.apply is given the function"):
        capture(Model(closing=True).double(), x[:2], frontends=("fx",))
