"""The loop that cuts again on measured stage times (planner/rebalance.py), without timing anything.

``measure`` here stands for a calibration with known context effects, so the loop's choices can be
checked exactly: the real calibration is timed, and a timed unit test would pass or fail with the
machine's load. The DP and the plans are the real ones.
"""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest

import lightning_antichain as la
from lightning_antichain.planner.rebalance import folded, in_context, rebalanced


def chain(n: int = 12) -> nx.DiGraph:
    """``n`` equal operations in a row."""
    graph = nx.DiGraph()
    for i in range(n):
        graph.add_node(f"op{i}", forward_s=1e-3, backward_s=2e-3, output_bytes=1000, order=i)
        if i:
            graph.add_edge(f"op{i - 1}", f"op{i}")
    return graph


def measuring(slowdown: dict[str, float], timed: bool = False):
    """A calibration where operation ``v`` takes ``slowdown[v]`` times its profiled time in context
    (large early activations, say), and each stage what its operations take; ``timed``: it also
    reports what each operation took in its stage, as calibration's op clock does."""

    calls: list[la.Plan] = []

    def measure(plan: la.Plan) -> la.Plan:
        calls.append(plan)
        profile = chain()
        stages = []
        for stage in plan.stages:
            forward = sum(profile.nodes[v]["forward_s"] * slowdown.get(v, 1.0) for v in stage.nodes)
            backward = sum(profile.nodes[v]["backward_s"] * slowdown.get(v, 1.0) for v in stage.nodes)
            stages.append(dataclasses.replace(stage, forward_s=forward, backward_s=backward))
        total = sum(s.compute_s for s in stages)
        plan = dataclasses.replace(plan, stages=stages, bottleneck_s=max(s.time_s for s in stages),
                                   lower_bound_s=total / len(stages), total_compute_s=total,
                                   calibration={"profiled_bound_ratio": plan.bound_ratio})
        if timed:
            plan.calibration["operations"] = {
                v: (profile.nodes[v]["forward_s"] * slowdown.get(v, 1.0),
                    profile.nodes[v]["backward_s"] * slowdown.get(v, 1.0)) for v in profile}
        return plan

    return measure, calls


def cut(cost: nx.DiGraph) -> la.Plan:
    return la.partition(cost, 2, chunks=4)


def test_the_loop_moves_work_off_the_stage_that_measured_slow_and_keeps_the_best():
    cost = chain()
    raw = cut(cost)
    assert raw.balance == [6, 6]
    measure, calls = measuring({f"op{i}": 2.0 for i in range(4)})  # the first four take twice as long
    best = rebalanced(raw, cost, cut, measure)
    first = best.rounds[0]
    assert first["balance"] == [6, 6] and first["measured_bottleneck_s"] / first["measured_lower_bound_s"] > 1.2
    assert best.balance != [6, 6]
    assert best.bottleneck_s < first["measured_bottleneck_s"]
    assert best.bound_ratio <= 1.1
    assert [r["chosen"] for r in best.rounds].count(True) == 1
    chosen = next(r for r in best.rounds if r["chosen"])
    assert chosen["balance"] == best.balance and chosen["measured_bottleneck_s"] == best.bottleneck_s
    assert len(calls) == len(best.rounds)  # each split measured once


SLOWDOWNS = [{}, {"op11": 3.0}, {"op0": 0.2, "op7": 5.0}, {f"op{i}": 1 + i / 3 for i in range(12)}]


@pytest.mark.parametrize("slowdown", SLOWDOWNS)
def test_the_loop_never_returns_a_plan_measured_worse_than_its_first(slowdown):
    cost = chain()
    measure, _ = measuring(slowdown)
    raw = cut(cost)
    first = measure(raw)
    best = rebalanced(raw, cost, cut, measure)
    assert best.bottleneck_s <= first.bottleneck_s
    assert min(r["measured_bottleneck_s"] for r in best.rounds) == best.bottleneck_s


@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_the_rounds_are_bounded(rounds):
    cost = chain()
    slowdown = {f"op{i}": 1 + i / 3 for i in range(12)}

    measure, calls = measuring(slowdown)
    best = rebalanced(cut(cost), cost, cut, measure, rounds=rounds)
    assert len(calls) == len(best.rounds) <= rounds + 1
    measure, calls = measuring(slowdown)
    assert len(rebalanced(cut(cost), cost, cut, measure, seconds=0.0).rounds) == 1  # out of time at once


def test_folding_makes_each_stage_add_up_to_what_it_measured():
    cost = chain()
    raw = cut(cost)
    measure, _ = measuring({"op0": 3.0, "op9": 0.5})
    measured = measure(raw)
    scaled = folded(cost, raw, measured)
    for stage, measured_stage in zip(raw.stages, measured.stages):
        for key in ("forward_s", "backward_s"):
            assert sum(scaled.nodes[v][key] for v in stage.nodes) == pytest.approx(getattr(measured_stage, key))
    assert cost.nodes["op0"]["forward_s"] == 1e-3  # the profile itself is left as it was


def test_the_public_entry_point_plans_as_the_strategy_for_the_same_profile_and_calibrations(tmp_path):
    """``la.plan`` and the strategy take one planning path: with the profile and every round's
    calibration in the cache, they make the same plan, rounds included."""
    import torch
    from lit_models import TinyClassifier, loader, trainer

    torch.manual_seed(0)
    model = TinyClassifier()
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=tmp_path)
    fit = trainer(strategy=strategy, devices=2, max_steps=2)
    fit.fit(model, loader())
    from_strategy = fit.strategy.plan
    assert from_strategy.calibration is not None and from_strategy.rounds
    batch, _ = next(iter(loader()))
    from_function = la.plan(model, batch, ["cpu", "cpu"], chunks=4, profile_cache=tmp_path,
                            optimizers=fit.optimizers)

    def kept(plan: la.Plan) -> dict:
        timed = ("solve_s", "optimizer_step_s", "predicted_step_s")  # timed anew by each call
        data = {k: v for k, v in plan.to_dict().items() if k not in timed}
        data["calibration"] = {k: v for k, v in data["calibration"].items() if k != "read_from"}  # the cache file
        return data

    assert kept(from_function) == kept(from_strategy)
    assert from_function.calibration["read_from"] is not None  # read, not measured again


def true_best(slowdown: dict[str, float]) -> la.Plan:
    """The split the DP makes when it knows what every operation takes in context."""
    cost = chain()
    for v, factor in slowdown.items():
        cost.nodes[v]["forward_s"] *= factor
        cost.nodes[v]["backward_s"] *= factor
    return cut(cost)


@pytest.mark.parametrize("slowdown", SLOWDOWNS[1:])
def test_operations_timed_in_context_lead_to_the_balanced_split_in_one_round(slowdown):
    cost = chain()
    measure, calls = measuring(slowdown, timed=True)
    best = rebalanced(cut(cost), cost, cut, measure)
    assert len(best.rounds) >= 2
    assert best.rounds[1]["balance"] == true_best(slowdown).balance  # no fixed point to walk to
    assert best.bottleneck_s == pytest.approx(measure(true_best(slowdown)).bottleneck_s)


def test_in_context_times_share_each_stage_by_what_its_operations_took():
    cost = chain()
    raw = cut(cost)
    measure, _ = measuring({"op0": 3.0, "op9": 0.5}, timed=True)
    measured = measure(raw)
    # the stage times also hold what the op clock cannot see (the runtime's own work): scale them
    measured.stages[0].forward_s *= 1.2
    shares = in_context(cost, measured)
    for stage in measured.stages:
        for i, key in enumerate(("forward_s", "backward_s")):
            assert sum(shares[v][i] for v in stage.nodes) == pytest.approx(getattr(stage, key))
    assert shares["op0"][0] == pytest.approx(3 * shares["op1"][0])  # in proportion to the clock
    assert shares["op9"][1] == pytest.approx(0.5 * shares["op10"][1])
    measured.calibration["operations"] = {v: (0.0, t[1]) for v, t in measured.calibration["operations"].items()}
    shares = in_context(cost, measured)  # no forward times: shared as the profile does
    assert shares["op0"][0] == pytest.approx(shares["op1"][0])
    assert in_context(cost, raw) == {}  # not calibrated: nothing to share


def test_a_plans_balance_given_back_as_balance_makes_the_same_split():
    """The loop's rounds list each split by ``plan.balance``, which counts the model's inputs in
    the first stage; a user copying one into ``balance=`` gets that split."""
    import torch
    from models import SequentialCNN

    cost = la.profile(SequentialCNN(), torch.randn(2, 3, 16, 16), repeats=1, warmup=0, progress=False)
    planned = la.partition(cost, 3, chunks=4)
    again = la.plan_from_balance(cost, planned.balance, chunks=4)
    assert [s.nodes for s in again.stages] == [s.nodes for s in planned.stages]
    operations = [planned.balance[0] - 1, *planned.balance[1:]]  # the input left out, as before
    assert [s.nodes for s in la.plan_from_balance(cost, operations, chunks=4).stages] == [
        s.nodes for s in planned.stages]


def test_a_round_whose_measured_stages_left_no_time_is_printed_not_divided_by():
    """Calibrated stage times are the measured tasks less the runtime's own cost per task, which a
    busy moment can measure as more than a tiny model's tasks: a round's measured bound is then 0,
    and the plan's table (printed by the strategy on every rank) must still print."""
    import torch
    from torch import nn

    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    plan = la.partition(la.profile(m, torch.randn(2, 4), repeats=1, warmup=0, progress=False), 2, chunks=2)
    plan = dataclasses.replace(plan, rounds=[dict(balance=[2, 2], profiled_bottleneck_s=1.0, profiled_lower_bound_s=1.0,
                        measured_bottleneck_s=0.0, measured_lower_bound_s=0.0),
                   dict(balance=[1, 3], profiled_bottleneck_s=1.0, profiled_lower_bound_s=0.5,
                        measured_bottleneck_s=0.2, measured_lower_bound_s=0.1)])
    table = plan.table()
    assert "round 0: [2, 2] ops, predicted x1.000, measured bottleneck 0.00 ms (x1.000)" in table
    assert "round 1: [1, 3] ops, predicted x2.000, measured bottleneck 200.00 ms (x2.000)" in table
