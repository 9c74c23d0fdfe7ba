"""Random operations in a pipeline: recomputation replays them, threads cannot disturb them, and a
seed decides them.

The probe models multiply positive inputs by positive weights and apply dropout (or another random
mask) after each product, so every mask can be read back from the output: the output is linear in
each weight, and the true gradient of ``sum(c * y)`` with respect to a weight ``w`` that scales
every element of its column is ``sum(c * y) / w`` per column. A gradient computed from another
draw of the masks than the one the output saw fails that.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_antichain as la
from lightning_antichain.stages import randomness


class ModuleDropout(nn.Module):
    """``y = d_n(... d_1(x * w_1) ... * w_n)`` with ``nn.Dropout``."""

    def __init__(self, layers: int = 3, width: int = 64, p: float = 0.3) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.rand(width) + 0.5) for _ in range(layers))
        self.drop = nn.ModuleList(nn.Dropout(p) for _ in range(layers))

    def forward(self, x):
        for w, drop in zip(self.w, self.drop):
            x = drop(x * w)
        return x


class FunctionalDropout(ModuleDropout):
    """The same with ``F.dropout(training=self.training)``, ``torch.bernoulli`` and ``rand_like``."""

    def forward(self, x):
        for i, w in enumerate(self.w):
            x = x * w
            if i % 3 == 0:
                x = F.dropout(x, 0.3, training=self.training)
            elif i % 3 == 1:
                x = x * torch.bernoulli(torch.full_like(x, 0.7)) / 0.7
            else:
                x = x * (torch.rand_like(x) < 0.7) / 0.7
        return x


MODELS = {"module": ModuleDropout, "functional": FunctionalDropout}


def _true_gradients(model: nn.Module, y: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
    return [(c * y).sum(0) / w.detach() for w in model.w]


def _pipeline(model: nn.Module, stages: int, chunks: int, recompute: str) -> la.Pipeline:
    cost = la.profile(model, torch.rand(2, 64, dtype=torch.float64) + 0.1, repeats=1, warmup=0, progress=False)
    ops = sum(1 for v in cost.nodes if not cost.nodes[v].get("pinned"))
    balance = [ops // stages] * stages
    balance[-1] += ops - sum(balance)
    return la.Pipeline(model, la.plan_from_balance(cost, balance), chunks=chunks, recompute=recompute)


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("recompute", ["never", "except_last", "always"])
def test_gradients_are_those_of_the_masks_the_output_saw(kind, stages, recompute):
    model = MODELS[kind](layers=2 * stages).double()
    pipe = _pipeline(model, stages, chunks=4, recompute=recompute)
    assert all(stage.random_nodes for stage in pipe.stages), "every stage must draw"
    for seed in range(3):
        torch.manual_seed(seed)
        for _ in range(2):  # several steps
            x = torch.rand(16, 64, dtype=torch.float64) + 0.1
            model.zero_grad()
            y = pipe(x)
            assert (y == 0).any() and (y != 0).any(), "the masks must drop some elements and keep others"
            c = torch.randn_like(y)
            (c * y).sum().backward()
            for w, true in zip(model.w, _true_gradients(model, y.detach(), c)):
                torch.testing.assert_close(w.grad, true, rtol=1e-12, atol=1e-12)
    pipe.close()


def test_every_checkpoint_mode_and_stage_count_draws_the_same_numbers_under_one_seed():
    model = FunctionalDropout(layers=6).double()
    x = torch.rand(16, 64, dtype=torch.float64) + 0.1
    outputs = []
    for stages in (1, 2, 3):
        for recompute in ("never", "always"):
            with _pipeline(model, stages, 4, recompute) as pipe:
                torch.manual_seed(7)
                outputs.append(pipe(x))
    for other in outputs[1:]:
        assert torch.equal(other, outputs[0])


def test_a_seed_decides_the_draws_and_each_call_draws_anew():
    model = ModuleDropout().double()
    x = torch.rand(16, 64, dtype=torch.float64) + 0.1
    with _pipeline(model, 2, 4, "never") as pipe:
        torch.manual_seed(0)
        first, second = pipe(x), pipe(x)
        torch.manual_seed(0)
        again = pipe(x)
        torch.manual_seed(1)
        other = pipe(x)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)
    assert not torch.equal(first, other)


def test_a_call_takes_one_draw_of_the_callers_generator_and_only_if_it_has_random_operations():
    x = torch.rand(8, 64, dtype=torch.float64) + 0.1
    for model, draws in ((ModuleDropout().double(), 1), (nn.Sequential(nn.Linear(64, 64), nn.Tanh()).double(), 0)):
        with _pipeline(model, 2, 4, "never") as pipe:
            torch.manual_seed(3)
            pipe(x)
            after = torch.rand(1)
            torch.manual_seed(3)
            for _ in range(draws):
                randomness.step_seed()
            assert torch.equal(torch.rand(1), after)


def test_eval_mode_dropout_draws_nothing_and_is_the_identity():
    model = ModuleDropout().double().eval()
    x = torch.rand(16, 64, dtype=torch.float64) + 0.1
    with _pipeline(model, 2, 4, "never") as pipe:
        torch.testing.assert_close(pipe(x), model(x), rtol=1e-12, atol=0)


@pytest.mark.parametrize("op", ["native_dropout", "bernoulli_", "rand", "randn_like", "multinomial"])
def test_seeded_operations_draw_the_same_on_a_thread_while_others_draw(op):
    """Whether an operation takes a ``generator`` argument or not (native_dropout), what one thread
    draws does not depend on what other threads draw at the same time, seeded or not."""
    x = torch.rand(64, 64)
    calls = {
        "native_dropout": lambda: torch.ops.aten.native_dropout.default(x, 0.5, True)[0],
        "bernoulli_": lambda: torch.empty(64, 64).bernoulli_(0.5),
        "rand": lambda: torch.rand(64, 64),
        "randn_like": lambda: torch.randn_like(x),
        "multinomial": lambda: torch.multinomial(x, 8),
    }
    seeded = randomness.SeededCall(calls[op], "op")

    def draw(seed: int, out: list) -> None:
        for micro_batch in range(50):
            with randomness.drawing(seed, micro_batch):
                out.append(seeded())

    alone: list = []
    draw(1, alone)
    together: list = []
    noise = [threading.Thread(target=lambda: [torch.rand(256, 256) for _ in range(200)]) for _ in range(2)]
    others = [threading.Thread(target=draw, args=(2, [])) for _ in range(2)]
    for t in [*noise, *others]:
        t.start()
    draw(1, together)
    for t in [*noise, *others]:
        t.join()
    for a, b in zip(alone, together):
        assert torch.equal(a, b)
    assert not all(torch.equal(alone[0], a) for a in alone[1:]), "micro-batches must draw differently"


def test_which_operations_are_seeded():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.ReLU(), nn.Dropout(0.0), nn.LSTM(4, 4, 2, dropout=0.2))
    gm = torch.fx.symbolic_trace(nn.Sequential(*list(model)[:4]))
    seeded = {n.target for n in gm.graph.nodes if randomness.may_draw(gm, n)}
    assert seeded == {"1"}  # the dropout with p > 0, not Linear, ReLU or Dropout(0)
    assert randomness.module_may_draw(model[4])
    assert not randomness.module_may_draw(nn.LSTM(4, 4, 2))
    assert randomness.function_may_draw(F.dropout) and randomness.function_may_draw(torch.ops.aten.bernoulli.p)
    assert not randomness.function_may_draw(torch.relu) and not randomness.function_may_draw(torch.ops.aten.mm.default)
    assert randomness.function_may_draw(lambda x: x), "code it cannot see is assumed to draw"


def test_an_operation_without_a_generator_draws_from_the_default_one_swapped_under_a_lock():
    """Fused kernels without a ``generator`` argument draw from their device's default generator in
    the operation's own state; seeded operations on other threads wait for the lock meanwhile."""
    generators = [torch.Generator().manual_seed(s) for s in (1, 1)]
    expected = torch.rand(1000, generator=torch.Generator().manual_seed(1))
    before = torch.get_rng_state()
    results: list = []

    def draw(generator: torch.Generator) -> None:
        for _ in range(20):
            results.append(randomness._with_default_swapped(torch.ops.aten.rand.default, ([1000],), {}, generator,
                                                            torch.device("cpu")))

    threads = [threading.Thread(target=draw, args=(g,)) for g in generators]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(torch.get_rng_state(), before), "the default generator is given back as it was"
    assert sum(torch.equal(r, expected) for r in results) == 2, "each generator's first draw is its own"
