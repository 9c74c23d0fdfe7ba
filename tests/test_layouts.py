"""The layout of replicas x stages: what the cost model charges each layout, and what
``pipeline_parallel_size="auto"`` weighs and chooses (the processes themselves: test_stage_processes_trainer.py)."""

import dataclasses

import pytest
import torch
from torch import nn

import lightning_antichain as la
from lightning_antichain.measure.link_speed import CollectiveSpeed
from lightning_antichain.planner.contention import capacity_of_two
from lightning_antichain.planner.cores_shared import optimizer_slowdown
from lightning_antichain.planner.cost_graph import with_loss
from lightning_antichain.planner.layout_cost import (
    BUCKET_BYTES,
    Collective,
    Links,
    layout_cost,
    measured_links,
    ring_all_gather_s,
    ring_all_reduce_s,
    shared_ends,
)
from lightning_antichain.planner.layout_search import (
    LayoutSearch,
    layout_search,
    plan_layouts,
    same_layout,
    with_verdicts,
)
from lightning_antichain.planner.overhead import loss_seconds
from lightning_antichain.planner.robust_choice import CAPACITY_SPREAD, least_regret, regrets, with_cores_shared
from lightning_antichain.planner.shared_cores import SharedCores, share_of
from lightning_antichain.plans.layout import Layout
from lightning_antichain.plans.options import PipelineOptions
from lightning_antichain.plans.plan import Plan, Stage
from lightning_antichain.plans.process_schedules import process_schedule

MB = 2**20


def stage(index: int, *, forward_s: float = 0.01, backward_s: float = 0.02, param_bytes: int = 100 * MB,
          cut_bytes: int = 10 * MB, memory_bytes: int = 1000 * MB) -> Stage:
    return Stage(index=index, device="cuda:0", nodes=[f"op{index}"], forward_s=forward_s, backward_s=backward_s,
                 transfer_s=0.0, memory_bytes=memory_bytes, param_bytes=param_bytes, buffer_bytes=0,
                 activation_bytes=0, input_bytes=cut_bytes if index else 0, output_bytes=cut_bytes)


def two_stage_plan(chunks: int = 4, **kwargs) -> Plan:
    stages = [stage(0, **kwargs), stage(1, **kwargs)]
    return Plan(stages=stages, method="antichain", chunks=chunks, bottleneck_s=0.03, lower_bound_s=0.03,
                predicted_step_s=0.0, total_compute_s=0.06, optimizer_multiplier=2.0, optimizer_step_s=0.004)


ONE_F_ONE_B = process_schedule("1f1b")


def test_a_ring_all_reduce_sends_twice_the_bytes_less_a_share_and_links_know_their_nodes():
    assert ring_all_reduce_s(1e9, 4, 10.0) == pytest.approx(2 * 3 / 4 * 0.1)
    assert ring_all_reduce_s(1e9, 1, 10.0) == ring_all_reduce_s(1e9, 4, None) == 0.0
    links = Links(per_node=2, within_gbps=100.0, across_gbps=10.0)
    assert links.between(0, 1) == 100.0 and links.between(1, 2) == 10.0 and links.between(3, 3) is None
    assert links.slowest([0, 1]) == 100.0 and links.slowest([0, 2]) == 10.0


def test_the_reduction_a_replica_adds_is_what_the_last_backwards_do_not_hide_and_at_least_their_last_buckets():
    plan = two_stage_plan(cut_bytes=0)  # no transfers: the backward is its compute alone
    alone = layout_cost(plan, ONE_F_ONE_B, Layout(1, 2), Links(2, 100.0, 100.0))
    assert alone.reduction_s == 0.0
    slow = Links(per_node=4, within_gbps=1.0, across_gbps=1.0)  # 100 MB over 1 GB/s: ~0.1 s, past a 20 ms backward
    cost = layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), slow)
    whole = ring_all_reduce_s(100 * MB, 2, 1.0)
    # each stage's backward hid 20 ms of it; the last stage sends its input gradient once its own
    # reduction is done, so the first stage's last backward, and its reduction, come after it
    assert cost.reduction_s == pytest.approx(2 * (whole - 0.02), rel=0.05)
    fast = layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), Links(per_node=4, within_gbps=1000.0, across_gbps=1000.0))
    tail = ring_all_reduce_s(BUCKET_BYTES, 2, 1000.0)
    assert 0 < fast.reduction_s <= 2 * tail + 1e-9  # hidden but for each stage's last bucket
    assert cost.step_s > fast.step_s > alone.step_s


def test_a_cut_across_nodes_is_charged_the_slower_link():
    plan = two_stage_plan()
    within = layout_cost(plan, ONE_F_ONE_B, Layout(1, 2), Links(per_node=2, within_gbps=100.0, across_gbps=0.5))
    across = layout_cost(plan, ONE_F_ONE_B, Layout(1, 2), Links(per_node=1, within_gbps=100.0, across_gbps=0.5))
    shipped = 2 * 10 * MB / 0.5e9  # a micro-batch's cut forward and its gradient back, per stage
    assert across.step_s - within.step_s > shipped  # on the critical path once per micro-batch at least


def test_fsdp_keeps_a_share_of_each_tensor_per_rank_and_gathers_a_block_or_the_stage_and_ddp_all_of_it():
    plan = two_stage_plan()  # 100 MB parameters, their gradients, 200 MB of optimizer state, 600 MB else
    links = Links(4, 100.0, 100.0)
    ddp = layout_cost(plan, ONE_F_ONE_B, Layout(4, 2), links, "ddp")
    assert ddp.rank_bytes == (1000 * MB, 1000 * MB)
    step = layout_cost(plan, ONE_F_ONE_B, Layout(4, 2), links, "fsdp", "step")
    assert step.rank_bytes == (900 * MB, 900 * MB)  # shards of 25 + the stage gathered, both ways; 50 optimizer
    unknown = layout_cost(plan, ONE_F_ONE_B, Layout(4, 2), links, "fsdp", "micro_batch")
    assert unknown.rank_bytes == step.rank_bytes  # no blocks known: the stage is gathered whole all the same
    blocks = dataclasses.replace(plan, stages=[dataclasses.replace(s, largest_block_bytes=10 * MB,
                                                                   unblocked_param_bytes=5 * MB) for s in plan.stages])
    per_micro_batch = layout_cost(blocks, ONE_F_ONE_B, Layout(4, 2), links, "fsdp", "micro_batch")
    # shards 25 + 5 outside blocks + two blocks of 10; gradients: shards 25 + one block's 10; optimizer 50
    assert per_micro_batch.rank_bytes == (735 * MB, 735 * MB)
    zbv = process_schedule("zbv")
    four = Plan(**{**dataclasses.asdict(plan), "stages": [stage(i) for i in range(4)]})
    assert layout_cost(four, zbv, Layout(1, 2), links).rank_bytes == (2000 * MB, 2000 * MB)  # two stages a rank


def test_fsdp_steps_a_share_of_the_bytes_and_pays_the_dtensor_dispatch_for_every_tensor():
    """FSDP2's sharded AdamW step on DTensors: GPT's 99 tensors on quarter shards took 31-60 ms
    on 4 CPU processes where a quarter of the plain step (7 ms) was predicted."""
    plan = dataclasses.replace(two_stage_plan(), optimizer_step_s=0.04, optimizer_tensor_s=0.0002,
                               stages=[dataclasses.replace(s, param_tensors=50 + 10 * s.index)
                                       for s in two_stage_plan().stages])
    links = Links(4, 100.0, 100.0)
    fsdp = layout_cost(plan, ONE_F_ONE_B, Layout(4, 2), links, "fsdp", "step")
    # each rank: half the bytes (its stage's) over 4 shards, and every tensor of its stage
    assert fsdp.rank_optimizer_s == pytest.approx((0.02 / 4 + 50 * 0.0002, 0.02 / 4 + 60 * 0.0002))
    ddp = layout_cost(plan, ONE_F_ONE_B, Layout(4, 2), links, "ddp")
    assert ddp.rank_optimizer_s == pytest.approx((0.02, 0.02))  # whole plain tensors
    alone = layout_cost(plan, ONE_F_ONE_B, Layout(1, 2), links, "fsdp", "step")
    assert alone.rank_optimizer_s == pytest.approx((0.02, 0.02))  # no replicas: nothing is sharded
    # each position's end: its last task's, then its optimizer's part; the step is the last of them
    free = dataclasses.replace(plan, stages=[dataclasses.replace(s, transfer_s=0.0) for s in plan.stages])
    over_free_links = layout_cost(free, ONE_F_ONE_B, Layout(1, 2), Links(4), "fsdp", "step")
    ends = [max(t.end for t in free.timeline(ONE_F_ONE_B.table(2, plan.chunks)) if t.task.stage == p)
            for p in range(2)]
    assert over_free_links.rank_end_s == pytest.approx(tuple(e + 0.02 + plan.step_overhead_s for e in ends))
    assert ends[0] != ends[1] and over_free_links.step_s == pytest.approx(max(over_free_links.rank_end_s))
    # each position's tasks, each as long as it takes (on accelerators nothing shares their time)
    assert over_free_links.rank_busy_s == pytest.approx(tuple(plan.chunks * (0.01 + 0.02) for _ in range(2)))


def test_a_stage_counts_the_parameter_tensors_it_trains():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    plan = la.partition(la.profile(model, torch.randn(4, 8), progress=False, runtime_overhead=False), 2)
    assert sum(s.param_tensors for s in plan.stages) == 5  # six, one frozen
    assert all(s.param_tensors > 0 for s in plan.stages)


def test_gathering_per_micro_batch_costs_collectives_per_task_and_once_per_step_at_the_step_ends():
    plan = dataclasses.replace(two_stage_plan(chunks=8), stages=[
        dataclasses.replace(s, largest_block_bytes=20 * MB, unblocked_param_bytes=0) for s in two_stage_plan().stages])
    alone = layout_cost(plan, ONE_F_ONE_B, Layout(1, 2), Links(4, 10.0, 10.0))
    slow, fast = Links(4, 10.0, 10.0), Links(4, 1000.0, 1000.0)
    gather = ring_all_gather_s(100 * MB, 2, 10.0)  # ~5 ms: under the 10 ms forward, hidden but the first block
    per_micro_batch = layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), slow, "fsdp", "micro_batch")
    once = layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), slow, "fsdp", "step")
    first_block = ring_all_gather_s(20 * MB, 2, 10.0)
    # once per step: the first block's gather (the rest behind the first forward), the gradients' scatter
    assert once.reduction_s == pytest.approx(first_block + gather, rel=1e-6)
    assert per_micro_batch.reduction_s == 0.0  # every collective is in a task
    assert per_micro_batch.step_s - alone.step_s >= 8 * 2 * first_block  # each forward and backward waits for one
    assert per_micro_batch.step_s > once.step_s  # slow links: eight micro-batches' gathers against one
    assert per_micro_batch.peak_bytes < once.peak_bytes
    quick = layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), fast, "fsdp", "micro_batch")
    assert quick.step_s < per_micro_batch.step_s and quick.step_s - alone.step_s < 0.01



@pytest.mark.parametrize(("dp", "how", "regather", "share"), [(1, "ddp", "step", 1), (2, "ddp", "step", 1),
                                                              (2, "fsdp", "step", 1), (2, "fsdp", "micro_batch", 2)])
def test_each_later_backward_adds_into_the_stage_s_gradients_whole_or_into_its_shard_where_fsdp2_scatters_them(
        dp, how, regather, share):
    """A stage's backwards after its first add their gradients into those already there: DDP and
    FSDP2 gathering once per step keep them whole until the last micro-batch; FSDP2 gathering per
    micro-batch reduce-scatters each backward's, which adds into the rank's shard."""
    plan = dataclasses.replace(two_stage_plan(chunks=4), stages=[
        dataclasses.replace(s, largest_block_bytes=20 * MB, unblocked_param_bytes=0) for s in two_stage_plan().stages])
    rate, links = 1e-10, Links(4, 100.0, 100.0)
    plain, adding = (layout_cost(dataclasses.replace(plan, accumulate_s_per_byte=r), ONE_F_ONE_B, Layout(dp, 2), links,
                                 how, regather) for r in (0.0, rate))
    added = [b - a for a, b in zip(plain.rank_busy_s, adding.rank_busy_s)]
    assert added == pytest.approx([3 * rate * 100 * MB / share] * 2)  # three of four backwards add, on each rank


class Blocks(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)))

    def forward(self, x):
        return self.blocks(x)


def search(world: int, *, stages="auto", schedule="auto", replication="ddp", shared_cores=None, alternatives=0,
           **settings):
    torch.manual_seed(0)
    model = Blocks()
    options = PipelineOptions(use_profile_cache=False, progress=False, **settings)
    return plan_layouts(model, (torch.randn(32, 64),), {}, world,
                        lambda layout, s: [torch.device("cpu")] * s.num_stages(layout.pp),
                        layout_search(stages, schedule, None), Links(per_node=world), options,
                        optimizers=[torch.optim.Adam(model.parameters())], replication=replication,
                        shared_cores=shared_cores, alternatives=alternatives)


def test_with_fsdp_the_search_weighs_both_ways_to_gather_and_per_micro_batch_fits_where_once_per_step_does_not():
    free = search(4, schedule="1f1b", replication="fsdp").plan
    assert {r.get("regather") for r in free.layouts if r["dp"] > 1} == {"micro_batch", "step"}
    assert all("regather" not in r for r in free.layouts if r["dp"] == 1)
    assert (free.regather is None) == (free.layout["dp"] == 1) and free.layout.get("regather") == free.regather
    pure = {(r["regather"], r["chunks"]): r for r in free.layouts if r["dp"] == 4 and "peak_memory_bytes" in r}
    counts = {chunks for _, chunks in pure}
    assert counts and all(pure["micro_batch", c]["peak_memory_bytes"] < pure["step", c]["peak_memory_bytes"]
                          for c in counts)  # a block or two gathered at a time, against all four
    limit = max(pure["micro_batch", c]["peak_memory_bytes"] for c in counts)
    tight = search(4, schedule="1f1b", replication="fsdp", memory_gb=limit / 1e9).plan
    lost = [r for r in tight.layouts if r["dp"] == 4 and r.get("regather") == "step"]
    assert lost and all("over its" in r["lost"] for r in lost)
    assert any("over its" not in r.get("lost", "") for r in tight.layouts if r.get("regather") == "micro_batch")
    assert "FSDP2 gathering" in tight.table()
    for plan in (free, tight):  # the plan chosen adds each backward into its rank's share where FSDP2 scatters it
        assert plan.gradient_shards == (plan.layout["dp"] if plan.regather == "micro_batch" else 1)


def test_auto_weighs_every_layout_schedule_and_count_and_takes_the_fastest_that_fits():
    plan = search(4).plan
    rows = plan.layouts
    assert {(r["dp"], r["pp"]) for r in rows} == {(1, 4), (2, 2), (4, 1)}
    assert {r["schedule"] for r in rows} == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"}
    ran = [r for r in rows if r.get("predicted_step_s") is not None]
    assert len(ran) > 20 and all("lost" in r for r in rows if r is not _chosen(plan))
    best = min(ran, key=lambda r: r["predicted_step_s"])
    assert _chosen(plan)["predicted_step_s"] == best["predicted_step_s"]
    assert plan.layout["dp"] * plan.layout["pp"] == 4 and plan.num_stages == plan.layout["pp"] * plan.layout[
        "virtual_stages"]
    assert plan.chunks == _chosen(plan)["chunks"] and plan.batch_size == 32
    assert "pipeline_parallel_size=auto for batches of 32: chose" in plan.table()
    again = Plan.from_dict(plan.to_dict())  # what rank 0 sends every rank
    assert again.layout == plan.layout and again.layouts == plan.layouts


def test_the_layouts_to_time_are_the_next_fastest_predicted_each_a_plan_of_its_own_and_never_sharded():
    planned = search(4, alternatives=3)
    plan, others = planned.plan, planned.alternatives
    rows = [r for r in plan.layouts if "lost" not in r or r.get("outrun")]
    ranked = sorted(rows, key=lambda r: r["predicted_step_s"])
    assert len(others) == 3 and ranked[0] is _chosen(plan)
    runs = [(o.layout["dp"], o.layout["pp"], o.chunks, o.layout["schedule"] if o.layout["pp"] > 1 else None)
            for o in [plan, *others]]
    assert len(set(runs)) == 4  # one stage a rank runs alike under every schedule: timed once
    first_two = [(o.layout["dp"], o.layout["pp"]) for o in [plan, *others[:2]]]
    assert sorted(first_two) == [(1, 4), (2, 2), (4, 1)]  # each layout of replicas x stages first, at its best
    for other in others[:2]:
        layout = other.layout["dp"], other.layout["pp"]
        best = min(r["predicted_step_s"] for r in rows if (r["dp"], r["pp"]) == layout)
        assert other.predicted_step_s == best >= plan.predicted_step_s
    assert others[0].predicted_step_s <= others[1].predicted_step_s
    for other in others:  # each with its own layout and cut, as the ranks would build it
        (row,) = [r for r in plan.layouts if same_layout(r, other)]
        assert other.predicted_step_s == row["predicted_step_s"] and other.num_stages == row["pp"] * row[
            "virtual_stages"] and other.batch_size == 32 and not other.layouts
        assert Plan.from_dict(other.to_dict()).layout == other.layout
    assert search(4).alternatives == ()
    sharded = search(4, schedule="1f1b", replication="fsdp", alternatives=3)
    assert all(o.regather is None for o in sharded.alternatives)
    assert sharded.alternatives == () or sharded.plan.regather is None


def test_after_the_trials_the_rows_say_what_each_timed_layout_measured_and_the_faster_is_chosen():
    plan = search(4, schedule="1f1b").plan
    rows = plan.layouts
    first, second = sorted((r for r in rows if "predicted_step_s" in r and (r.get("outrun") or "lost" not in r)),
                           key=lambda r: r["predicted_step_s"])[:2]
    first["measured_step_s"], second["measured_step_s"] = 0.020, 0.010
    with_verdicts(rows, second)
    assert "lost" not in second and first["lost"] == "timed slower: 20.0 ms against 10.0 ms (predicted " + (
        f"{1e3 * first['predicted_step_s']:.1f} against {1e3 * second['predicted_step_s']:.1f})")
    untimed = [r for r in rows if r.get("outrun") and "measured_step_s" not in r]
    assert untimed and all(r["lost"].startswith(("slower", "faster", "no faster")) for r in untimed)
    unfit = [r for r in rows if "lost" in r and not r.get("outrun")]
    assert all(not r["lost"].startswith(("slower", "faster", "timed")) for r in unfit)


def test_the_table_names_the_layouts_predicted_within_the_model_s_error_and_the_trials_that_would_settle_it():
    plan = search(4, alternatives=0).plan
    chosen = _chosen(plan)
    others = {(r["dp"], r["pp"]) for r in plan.layouts} - {(chosen["dp"], chosen["pp"])}
    near, far = sorted(others)
    for row in plan.layouts:  # the other layouts' rows as the search might have predicted them
        if (row["dp"], row["pp"]) in others and row.get("outrun"):
            row["predicted_step_s"] = chosen["predicted_step_s"] * (1.03 if (row["dp"], row["pp"]) == near else 1.25)
    table = plan.table()
    assert f"note: dp={near[0]} x pp={near[1]} (+3%) predicted within 15% of the choice" in table
    assert f"dp={far[0]} x pp={far[1]} (+25%)" not in table and "layout_trials=2 times both" in table
    for row in plan.layouts:
        if (row["dp"], row["pp"]) == far and row.get("outrun"):
            row["predicted_step_s"] = chosen["predicted_step_s"] * 0.99  # a layout the choice of least regret passed
    assert "layout_trials=3 times them" in plan.table() and "(-1%)" in plan.table()
    chosen["measured_step_s"] = 0.1  # timed already: nothing to suggest
    assert "note: dp=" not in plan.table()


def test_a_memory_budget_rules_out_the_layouts_that_hold_the_whole_model_on_a_rank():
    free = search(4, schedule="1f1b").plan
    whole = max(r["peak_memory_bytes"] for r in free.layouts if r["pp"] == 1 and "peak_memory_bytes" in r)
    tight = search(4, schedule="1f1b", memory_gb=0.7 * whole / 1e9).plan
    assert tight.layout["pp"] > 1
    assert all("over its" in r["lost"] or "does not fit" in r["lost"] or r["pp"] > 1 for r in tight.layouts
               if r["pp"] == 1)


def test_stages_fixed_with_schedule_auto_weighs_the_schedules_of_that_layout_only():
    plan = search(4, stages=2).plan
    assert {(r["dp"], r["pp"]) for r in plan.layouts} == {(2, 2)}
    assert plan.layout["pp"] == 2


def _chosen(plan: Plan) -> dict:
    (row,) = [r for r in plan.layouts if "lost" not in r]
    return row


def test_auto_options_are_checked_when_given():
    with pytest.raises(ValueError, match="give schedule= too"):
        la.AntichainPipelineStrategy(pipeline_parallel_size="auto")
    with pytest.raises(ValueError, match="leave out plan= and balance="):
        la.AntichainPipelineStrategy(pipeline_parallel_size="auto", schedule="1f1b", balance=[2, 2])
    with pytest.raises(ValueError, match='or "auto", got 0'):
        la.AntichainPipelineStrategy(pipeline_parallel_size=0, schedule="1f1b")
    with pytest.raises(ValueError, match="layout_trials=2 times the layouts the planner weighs: give pipeline_"):
        la.AntichainPipelineStrategy(pipeline_parallel_size=2, schedule="1f1b", layout_trials=2)
    with pytest.raises(ValueError, match="layout_trials=2 times the layouts of stages as processes"):
        la.AntichainPipelineStrategy(layout_trials=2)
    with pytest.raises(ValueError, match="a whole number of at least 1"):
        la.AntichainPipelineStrategy(pipeline_parallel_size="auto", schedule="auto", layout_trials=0)
    assert la.AntichainPipelineStrategy(pipeline_parallel_size="auto", schedule="1f1b", layout_trials=3
                                        )._runtime.process_options.layout_trials == 3
    strategy = la.AntichainPipelineStrategy(pipeline_parallel_size="auto", schedule="auto")
    search = strategy._runtime.ranks.search
    assert len(search.schedules) == 5 and search.pipeline_ranks is None


def test_every_collective_costs_the_links_latency_a_gathered_block_two_a_ddp_bucket_one():
    """Once per step, FSDP2 gathers and reduce-scatters each of a stage's five blocks and what no block
    owns with a collective each: 12 latencies a step; per micro-batch, those of every task; DDP's
    100 MB of gradients go in four buckets of 25 MB."""
    assert BUCKET_BYTES == 25 * MB
    plan = dataclasses.replace(two_stage_plan(chunks=4), stages=[
        dataclasses.replace(s, largest_block_bytes=18 * MB, unblocked_param_bytes=10 * MB, param_blocks=5)
        for s in two_stage_plan().stages])
    latency = 0.01
    links, waiting = Links(4, 10.0, 10.0), Links(4, 10.0, 10.0, latency_s=latency)
    once = [layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), kind, "fsdp", "step") for kind in (links, waiting)]
    assert once[1].reduction_s - once[0].reduction_s == pytest.approx(2 * 6 * latency)
    per_task = [layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), kind, "fsdp", "micro_batch") for kind in (links, waiting)]
    assert per_task[1].step_s - per_task[0].step_s >= 4 * (6 + 11) * latency  # a stage's 4 forwards and 4 backwards
    ddp = [layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), kind) for kind in (links, waiting)]
    # four buckets' latencies a stage, behind its last backward on a GPU but for the last bucket's;
    # the first stage's reduction follows the last stage's (its last backward waits for it)
    assert 2 * latency <= ddp[1].reduction_s - ddp[0].reduction_s <= 2 * 4 * latency + 1e-9
    alone = [layout_cost(plan, ONE_F_ONE_B, Layout(1, 2), kind, "fsdp", "step") for kind in (links, waiting)]
    assert alone[1].step_s == alone[0].step_s  # one replica sends nothing


def test_fsdp2_gathers_and_scatters_at_the_speeds_measured_for_each_kind():
    """gloo's all-gather and reduce-scatter run at speeds of their own: each unit's gather pays the
    gather's latency, each reduce-scatter the scatter's, and halving the scatter's bandwidth doubles
    the time of the gradients' reduce-scatter (100 MB over 2 replicas at 10 GB/s: 5 ms)."""
    plan = dataclasses.replace(two_stage_plan(chunks=4), stages=[
        dataclasses.replace(s, largest_block_bytes=18 * MB, unblocked_param_bytes=10 * MB, param_blocks=5)
        for s in two_stage_plan().stages])
    base = layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), Links(4, 10.0, 10.0), "fsdp", "step").reduction_s
    for kind in ("gather", "scatter"):
        waiting = Links(4, 10.0, 10.0, **{kind: Collective(latency_s=0.01)})
        assert layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), waiting, "fsdp", "step").reduction_s - base == (
            pytest.approx(6 * 0.01))  # five blocks and what no block owns
    slow = Links(4, 10.0, 10.0, scatter=Collective(speed=0.5))
    assert layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), slow, "fsdp", "step").reduction_s - base == pytest.approx(
        ring_all_gather_s(100 * MB, 2, 10.0))
    measured = measured_links(8, {"all_reduce": CollectiveSpeed(0.001, 2.0), "all_gather": CollectiveSpeed(0.002, 1.0),
                                  "reduce_scatter": CollectiveSpeed(0.003, 0.5)})
    assert measured == Links(8, 2.0, 2.0, 0.001, Collective(0.002, 0.5), Collective(0.003, 0.25))
    assert measured_links(8, {k: CollectiveSpeed(0.0, 1.0) for k in ("all_reduce", "all_gather", "reduce_scatter")},
                          within_gbps=5.0).across_gbps == 5.0


def test_a_loss_given_to_the_search_is_timed_on_the_models_output_and_charged_to_the_last_stage(tmp_path):
    """A loss the last stage computes from the module's output costs that stage: given to the
    search (the same profile, read back from the cache), the plan's work grows by what the loss
    takes, all of it on the last stage (a cross-entropy over 20k classes)."""
    classes = 20_000
    targets = torch.randint(0, classes, (32,))
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, classes))
    before = [p.detach().clone() for p in model.parameters()]

    def loss(out):
        return nn.functional.cross_entropy(out, targets[:len(out)])

    timed = loss_seconds(model, (torch.randn(8, 64),), {}, loss)
    assert timed is not None and min(timed) > 0
    assert all(torch.equal(a, p) and p.grad is None for a, p in zip(before, model.parameters()))

    def planned(with_loss):
        torch.manual_seed(0)
        return plan_layouts(model, (torch.randn(32, 64),), {}, 2,
                            lambda layout, s: [torch.device("cpu")] * s.num_stages(layout.pp),
                            LayoutSearch(2, layout_search("auto", "gpipe", None).schedules), Links(per_node=2),
                            PipelineOptions(profile_cache=tmp_path, progress=False, chunks=4),
                            loss=loss if with_loss else None).plan

    plain, charged = planned(False), planned(True)
    added = charged.total_compute_s - plain.total_compute_s
    assert 0.2 * sum(timed) < added < 5 * sum(timed)  # timed apart, on a shared machine
    if [s.nodes for s in charged.stages] == [s.nodes for s in plain.stages]:
        assert charged.stages[-1].compute_s - plain.stages[-1].compute_s == pytest.approx(added)


def test_the_loss_goes_to_the_output_a_loss_reads_the_one_with_the_most_bytes():
    import networkx as nx

    cost = nx.DiGraph([("x", "features"), ("features", "logits"), ("features", "aux")])
    nx.set_node_attributes(cost, {"features": 1000, "logits": 4000, "aux": 8}, "output_bytes")
    cost.graph["outputs"] = ["logits", "aux"]
    with_loss(cost, 0.5, 0.25)
    assert (cost.nodes["logits"]["forward_s"], cost.nodes["logits"]["backward_s"]) == (0.5, 0.25)
    assert "forward_s" not in cost.nodes["aux"]


def test_jobs_sharing_the_cores_end_later_and_staggered_ones_overlap_only_while_both_run():
    single_core = lambda n: 1.0  # noqa: E731
    assert shared_ends([0.0, 1.0], [1.0, 1.0], 1, single_core) == pytest.approx([1.0, 2.0])
    assert shared_ends([0.0, 0.5], [1.0, 1.0], 1, single_core) == pytest.approx([1.5, 2.0])
    assert shared_ends([0.0, 0.0], [1.0, 1.0], 1, lambda n: float(n)) == pytest.approx([1.0, 1.0])
    assert shared_ends([0.0], [1.0], 2, lambda n: 1.0) == pytest.approx([2.0])  # two replicas in step


def test_a_rank_done_first_steps_its_optimizer_on_the_cores_the_other_ranks_reduce_on():
    """gloo's all-reduce between CPU processes keeps a core busy: the MLP's dp=2 x pp=2 stepped its
    second stage's AdamW in 92-96 ms beside the first stage's reduction, predicted 47 without it."""
    stages = [dataclasses.replace(stage(0, param_bytes=400 * MB, cut_bytes=0), device="cpu"),
              dataclasses.replace(stage(1, param_bytes=100 * MB, cut_bytes=0), device="cpu")]
    plan = dataclasses.replace(two_stage_plan(chunks=4, cut_bytes=0), stages=stages, optimizer_step_s=0.2,
                               parallel_capacity=2.0, cpu_cores=2, optimizer_slowdown=2.0)
    slow = Links(per_node=4, within_gbps=0.5, across_gbps=0.5)
    cost = layout_cost(plan, ONE_F_ONE_B, Layout(2, 2), slow)
    # the last stage (a fifth of the bytes: 0.04 s alone) steps while the first stage's replicas
    # reduce 400 MB: four ranks busy on two cores' worth, so twice as long; the first steps alone
    assert cost.rank_optimizer_s == pytest.approx((0.16, 2 * 0.04))
    assert cost.optimizer_s == max(cost.rank_optimizer_s)


def test_a_pipelines_ranks_step_their_optimizers_as_their_backwards_end_and_share_the_cores_only_when_at_once():
    cpu = [dataclasses.replace(s, device="cpu") for s in two_stage_plan(chunks=4, cut_bytes=0).stages]
    plan = dataclasses.replace(two_stage_plan(chunks=4, cut_bytes=0), stages=cpu, optimizer_step_s=0.2,
                               parallel_capacity=1.0, cpu_cores=2, optimizer_slowdown=2.0)
    links = Links(per_node=2, within_gbps=100.0, across_gbps=100.0)
    staggered = layout_cost(plan, ONE_F_ONE_B, Layout(1, 2), links)
    whole = dataclasses.replace(plan, stages=[dataclasses.replace(cpu[0], param_bytes=200 * MB, output_bytes=0)])
    at_once = layout_cost(whole, ONE_F_ONE_B, Layout(2, 1), links)
    # two replicas step the whole model at once: twice one alone; two stages step half each, the
    # last stage's first, while the first still runs its last backward
    assert at_once.optimizer_s == pytest.approx(2 * 0.2)
    assert 0.1 <= staggered.optimizer_s <= 2 * 0.1  # a rank's own step: never slower than all at once
    unstepped = layout_cost(dataclasses.replace(plan, optimizer_step_s=0.0), ONE_F_ONE_B, Layout(1, 2), links)
    # one core's worth: the last stage's rank, done first, steps on the core the first still runs
    # its backwards on, slowing them; the step is all the work, the pipeline's and both steps
    assert staggered.step_s == pytest.approx(unstepped.step_s + 0.2)
    on_gpus = layout_cost(dataclasses.replace(two_stage_plan(chunks=4, cut_bytes=0), optimizer_step_s=0.2),
                          ONE_F_ONE_B, Layout(1, 2), links)
    assert on_gpus.optimizer_s == pytest.approx(0.1)


def test_least_regret_takes_the_layout_that_falls_least_behind_as_the_cores_share_worse_or_better():
    # as measured, worse, better: the first is quickest as measured and falls 30 behind where the
    # cores share worse; the second never falls more than 5 behind
    steps = [(100.0, 160.0, 80.0), (105.0, 130.0, 85.0), (140.0, 150.0, 135.0)]
    assert regrets(steps) == [30.0, 5.0, 55.0]
    assert least_regret(steps) == 1
    assert least_regret([(100.0, 110.0, 90.0), (101.0, 110.0, 90.0)]) == 0  # equal regret: quickest as measured


def test_the_cores_sharing_worse_slows_data_parallel_layouts_more_and_auto_weighs_it_where_the_ranks_measured_it():
    plan = two_stage_plan()
    shared = SharedCores(model=1.5, optimizer=1.3)
    cores = 2
    plan = dataclasses.replace(plan, cpu_cores=cores)
    worse = with_cores_shared(plan, shared, 4, cores, 1 - CAPACITY_SPREAD)
    better = with_cores_shared(plan, shared, 4, cores, 1 + CAPACITY_SPREAD)
    assert worse.parallel_capacity < better.parallel_capacity and worse.optimizer_slowdown > better.optimizer_slowdown
    assert with_cores_shared(plan, SharedCores(model=1.9), 4, cores, 1.5).parallel_capacity == capacity_of_two(
        2.0, 4, cores)  # no more than the cores
    free = search(4, schedule="1f1b", shared_cores=shared).plan
    ran = [r for r in free.layouts if r.get("predicted_step_s") is not None and "over its" not in r.get("lost", "")]
    assert all(len(r["predicted_step_as_cores_vary_s"]) == 2 and r["regret_s"] >= 0 for r in ran)
    assert all(r["predicted_step_as_cores_vary_s"][0] >= r["predicted_step_as_cores_vary_s"][1] for r in ran)
    chosen = next(r for r in free.layouts if "lost" not in r)
    assert chosen["regret_s"] == min(r["regret_s"] for r in ran)
    faster = [r for r in ran if r["predicted_step_s"] < chosen["predicted_step_s"]]
    assert all("behind the best where the ranks share the cores 12% worse or better" in r["lost"] for r in faster)
    assert search(4, schedule="1f1b").plan.layouts[0].get("regret_s") is None  # not measured: the quickest


def test_each_layout_steps_the_optimizer_as_measured_on_the_share_of_the_parameters_its_ranks_step():
    """Memory-bound, an optimizer's steps share the cores better on less: a layout's ranks step
    ``1/pp`` of the parameters (``1/(pp * dp)`` sharded by FSDP2), and the search charges each
    layout the sharing measured for the nearest share."""
    shared = SharedCores(model=1.5, optimizer=1.1, optimizer_shares=((2, 1.5), (4, 1.9)))
    assert [shared.optimizer_at(s) for s in (1, 2, 3, 4, 8)] == [1.1, 1.5, 1.9, 1.9, 1.9]
    assert SharedCores(model=1.5).optimizer_at(2) is None
    assert share_of(Layout(2, 2), "ddp") == 2 and share_of(Layout(2, 2), "fsdp") == 4
    assert optimizer_slowdown(shared, Layout(1, 4), "ddp", 4) == pytest.approx(4 / 1.9)
    assert optimizer_slowdown(shared, Layout(4, 1), "ddp", 4) == pytest.approx(4 / 1.1)
    assert optimizer_slowdown(shared, Layout(4, 1), "fsdp", 4) == pytest.approx(4 / 1.9)
    whole_only = SharedCores(model=1.5, optimizer=1.1)
    # each search times the optimizer again: its parts against those of the layout whose ranks step it all
    parts = []
    for cores in (shared, whole_only):
        found = search(4, schedule="1f1b", shared_cores=cores).plan.layouts
        rows = {(r["dp"], r["chunks"]): r["optimizer_s"] for r in found if r.get("optimizer_s")}
        whole = [s for (dp, _), s in rows.items() if dp == 4]
        assert whole and max(whole) == pytest.approx(min(whole))
        parts.append({key: s / whole[0] for key, s in rows.items() if key[0] < 4})
    pipelines = [key for key in parts[0] if key in parts[1]]
    assert pipelines and all(parts[0][k] < parts[1][k] for k in pipelines)


def test_the_search_scales_its_profiles_to_the_machine_speed_the_ranks_probed():
    """The ranks' probe times one rank's step alone on a replica's share moments before the search
    weighs the layouts; the profiles, timed at another moment, are scaled halfway to it."""
    slow, quick = (search(4, schedule="gpipe", shared_cores=SharedCores(model=1.5, model_alone_s=alone))
                   for alone in (10.0, 1e-4))
    assert all(r["profile_scaled_by"] > 1 for r in slow.plan.layouts)
    assert all(r["profile_scaled_by"] < 1 for r in quick.plan.layouts)
    one = [r for r in slow.plan.layouts if r["dp"] == 4 and r["chunks"] == 1 and r.get("predicted_step_s")]
    factor = slow.plan.layouts[0]["profile_scaled_by"]
    # halfway (geometrically): the share's step alone between the profile's and the probe's
    assert one and all(10.0 / factor <= r["predicted_step_s"] and r["predicted_step_s"] < 10.0 for r in one)
    assert "profile_scaled_by" not in search(4, schedule="gpipe").plan.layouts[0]  # no probe: as profiled
    with_loss = SharedCores(model=1.5, model_alone_s=10.0, with_loss=True)  # timed otherwise than the search counts
    assert "profile_scaled_by" not in search(4, schedule="gpipe", shared_cores=with_loss).plan.layouts[0]
