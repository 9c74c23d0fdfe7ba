"""What micro-batching may change, and the clear errors where it would change a result.

The pipeline runs forward once per micro-batch and joins the outputs on dim 0. That is exact for
per-sample outputs only; anything else must be refused, never joined silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_antichain as la
from lightning_antichain.capture import capture
from lightning_antichain.microbatch import MicroBatchError


class Net(nn.Module):
    def __init__(self, extra: str) -> None:
        super().__init__()
        self.extra = extra
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x):
        h = self.net(x)
        if self.extra == "weight":
            return h, self.net[0].weight.norm(dim=1)
        if self.extra == "sum":
            return h, (h**2).sum().reshape(1)
        return h, h.softmax(-1)


def _pipe(model, x, chunks):
    graph = capture(model, x[: len(x) // chunks])
    cost = la.profile(model, x[: len(x) // chunks], op_graph=graph, repeats=1, warmup=0, progress=False)
    return la.Pipeline(model, la.partition(cost, 2, chunks=chunks), chunks=chunks, graph=graph)


@pytest.mark.parametrize(("extra", "shapes"), [("weight", r"\[\(16,\), \(16,\)\]"), ("sum", r"\[\(1,\), \(1,\)\]")])
@pytest.mark.parametrize("grad", [True, False])
def test_an_output_that_is_not_per_sample_is_refused_not_joined(extra, shapes, grad):
    torch.manual_seed(0)
    model = Net(extra).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    with _pipe(model, x, chunks=2) as pipe, torch.set_grad_enabled(grad):
        with pytest.raises(MicroBatchError, match=rf"not one row per sample: shapes {shapes} for micro-batches of "
                                                  r"\[4, 4\] samples .*compute the rest outside"):
            pipe(x)


def test_per_sample_outputs_are_still_joined():
    torch.manual_seed(0)
    model = Net("softmax").double()
    x = torch.randn(9, 4, dtype=torch.float64)  # 3, 3, 3
    with _pipe(model, x, chunks=3) as pipe:
        for got, expected in zip(pipe(x), model(x)):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
