"""A call's split and join are decided on the first call of its shape and read after that.

The first call of a shape may run the stages more than the micro-batches need (the join of an
output whose batch dim the sizes cannot tell is found by a run with one sample more; the check
that micro-batching changes nothing runs the first micro-batch). A later call of that shape runs
each micro-batch once, and nothing else; a call of another shape (an epoch's last, smaller batch)
decides its own, and results stay those of the plain module, in float64.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import lightning_antichain as la

CHUNKS = 4


class SquareOutput(nn.Module):
    """Outputs ``[samples, 3]``: on micro-batches of 3 samples, both dims follow the sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _counted_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _step(pipe: la.Pipeline, model: nn.Module, plain: nn.Module, x: torch.Tensor) -> None:
    for m in (model, plain):
        m.zero_grad(set_to_none=True)
    output, expected = pipe(x), plain(x)
    weights = torch.randn(expected.shape, dtype=expected.dtype, generator=torch.Generator().manual_seed(len(x)))
    (output * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(output, expected, rtol=1e-9, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_a_later_call_of_a_shape_runs_each_micro_batch_once_and_no_probe():
    torch.manual_seed(0)
    model = SquareOutput().double()
    plain = copy.deepcopy(model)
    example = torch.randn(12, 5, dtype=torch.float64)
    plan = la.partition(la.profile(model, example, repeats=1, warmup=0, progress=False), 2, chunks=CHUNKS)
    with la.Pipeline(model, plan, chunks=CHUNKS) as pipe:
        calls = _counted_calls(model.c)  # the last stage's last operation: once per micro-batch run
        _step(pipe, model, plain, example)
        first = calls[0]
        assert first > CHUNKS  # the join of [3, 3] outputs was found by a run with one more sample
        for size in (12, 10, 12, 10):
            calls[0] = 0
            _step(pipe, model, plain, torch.randn(size, 5, dtype=torch.float64))
            runs = calls[0]
            if size == 12:
                assert runs == CHUNKS, f"a later call of a shape seen ran the stages {runs} times for {CHUNKS} chunks"
        calls[0] = 0
        _step(pipe, model, plain, torch.randn(10, 5, dtype=torch.float64))
        assert calls[0] == CHUNKS  # the smaller batch's own layout, kept beside the first


def test_outputs_of_new_shapes_for_inputs_of_a_known_shape_are_joined_anew():
    """The join is kept per output shapes too: a module whose output follows a flag of its own
    (read at run time, inside a leaf module) is joined right after the flag changes, on the dim
    its samples now are."""

    class Turned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.turned = False

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h.t() if self.turned else h

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.turn = nn.Linear(5, 8), nn.Linear(8, 6), Turned()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.turn(self.b(torch.tanh(self.a(x))))

    torch.manual_seed(0)
    model = Model().double()
    plain = copy.deepcopy(model)
    example = torch.randn(8, 5, dtype=torch.float64)
    cost = la.profile(model, example, repeats=1, warmup=0, progress=False, leaf_modules=[Turned])
    plan = la.partition(cost, 2, chunks=CHUNKS)
    with la.Pipeline(model, plan, chunks=CHUNKS, leaf_modules=[Turned]) as pipe:
        for turned in (False, True, False, True):  # micro-batch outputs [2, 6], then [6, 2]
            model.turn.turned = plain.turn.turned = turned
            _step(pipe, model, plain, example)
