"""A stage's operations grouped by block, each group a module of its own (for FSDP2 per block).

Each run of operations one decoder layer issued becomes one submodule call; what the stage computes
is unchanged (float64 outputs and gradients against the plain module, both capture frontends),
and each unit holds exactly the parameters its block's operations read, the user's own objects,
so ``fully_shard`` on it gathers that block and no other.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lightning_antichain as la
from lightning_antichain.capture import capture_call
from lightning_antichain.processes.process_stages import FlatStage
from lightning_antichain.stages.block_units import outline_stage
from lightning_antichain.stages.split import split_stages

VOCAB, WIDTH, LAYERS = 24, 8, 4


class Layer(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.scale = nn.Parameter(torch.ones(width))  # read directly, not through a called module

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.scale * self.down(torch.tanh(self.up(self.norm(h))))


class Decoder(nn.Module):
    def __init__(self, layers: int = LAYERS, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(Layer(width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_blocks_outlined_compute_what_the_stage_did_and_hold_their_own_parameters(frontend):
    torch.manual_seed(0)
    model = Decoder().double()
    plain = copy.deepcopy(model)
    tokens = torch.randint(0, VOCAB, (4, 6))
    graph = capture_call(model, (tokens,), {}, frontends=(frontend,))
    cost = la.profile(model, tokens, op_graph=graph, repeats=1, warmup=0, progress=False, runtime_overhead=False)
    count = cost.number_of_nodes()
    plan = la.plan_from_balance(cost, [count // 2, count - count // 2], chunks=1)
    stages = split_stages(graph, plan, [torch.device("cpu")] * 2)
    units = [outline_stage(stage, graph) for stage in stages]
    blocks = [unit.block for stage_units in units for unit in stage_units]
    assert set(blocks) == {f"layers.{i}" for i in range(LAYERS)}  # a block cut by the stages may be in both
    names = {id(p): n for n, p in model.named_parameters()}
    for stage_units in units:
        for unit in stage_units:
            held = {names[id(p)] for p in unit.module.parameters()}
            assert held and all(n.startswith(unit.block + ".") for n in held), (unit.block, held)
    flat = [FlatStage(stage) for stage in stages]
    hidden = flat[0](tokens)
    output = flat[1](*hidden) if isinstance(hidden, tuple) else flat[1](hidden)
    expected = plain(tokens)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn(expected.shape, dtype=torch.float64)
    (output * weights).sum().backward()
    (expected * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
