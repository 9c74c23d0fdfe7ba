"""Device constants inside captured graphs, the bodies of higher-order operations included."""

from __future__ import annotations

import torch
from torch import nn

from lightning_antichain.capture.devices import retarget_devices


class PositionsWithoutGrad(nn.Module):
    """Makes a tensor inside ``no_grad``, which torch.export keeps as a separate graph (the body of
    ``wrap_with_set_grad_enabled``) that names the example's device."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            positions = torch.arange(x.shape[0], device=x.device, dtype=x.dtype)
        return self.lin(x) + positions[:, None]


def devices_named(graph_module: torch.fx.GraphModule) -> set[str]:
    named = set()
    for module in graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                for value in [*node.args, *node.kwargs.values()]:
                    if isinstance(value, torch.device):
                        named.add(str(value))
    return named


def test_a_graph_captured_on_meta_runs_elsewhere_with_its_higher_order_bodies_retargeted():
    with torch.device("meta"):
        meta_model = PositionsWithoutGrad()
    graph_module = torch.export.export(meta_model, (torch.randn(3, 4, dtype=torch.float64, device="meta"),)).module()
    assert "meta" in devices_named(graph_module)
    retarget_devices(graph_module, "meta", "cpu")
    assert devices_named(graph_module) == {"cpu"}
    real = PositionsWithoutGrad()
    graph_module.load_state_dict(real.state_dict(), assign=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(graph_module(x), real(x), rtol=0, atol=0)
