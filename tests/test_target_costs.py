"""Planning for a GPU that is not here: each operation costed on the GPU's roofline from shapes on
meta (planner/roofline.py, planner/target_profile.py), the same cost graph the measured profile
writes, and the plan command's --gpu."""

import dataclasses
import json
import math

import pytest
import torch
from test_cli import run_main, tiny_llama_config
from torch import nn

from lightning_antichain.capture import trace
from lightning_antichain.hf_models import causal_lm_on_meta
from lightning_antichain.planner.deeper import Depth, fewest_layers
from lightning_antichain.planner.efficiency_fit import TimedOperation, fit_efficiencies
from lightning_antichain.planner.just_in_time import meta_copy, profile_just_in_time
from lightning_antichain.planner.partition import partition
from lightning_antichain.planner.profiler import _time_once, profile
from lightning_antichain.planner.roofline import Efficiencies, FusedAttention, RooflineClock, attention_flops, kind_of
from lightning_antichain.planner.target_devices import TARGET_DEVICES, target_device
from lightning_antichain.planner.target_profile import TargetModel

H100 = target_device("H100")
EFF = Efficiencies()


def meta(*shape, dtype=torch.bfloat16, grad=True) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


def test_a_matrix_product_costs_its_flops_at_the_derated_peak_forward_and_twice_that_backward():
    x, w = meta(2048, 4096), meta(8192, 4096)
    clock = RooflineClock(H100)
    forward, y = clock(lambda: nn.functional.linear(x, w))
    flops = 2 * 2048 * 4096 * 8192
    assert forward == pytest.approx(flops / (989e12 * EFF.compute["matmul"]))
    assert clock.tally.flops == flops and clock.tally.bytes == 2 * (2048 * 4096 + 8192 * 4096 + 2048 * 8192)
    backward, _ = clock(lambda: torch.autograd.grad([y], [x, w], [torch.empty_like(y)]))
    assert backward == pytest.approx(2 * forward)
    fp32, _ = RooflineClock(H100)(lambda: nn.functional.linear(x.float(), w.float()))
    assert fp32 > forward * 989 / 494.5 * 0.99  # TF32's peak, and the copies to float32


def test_an_elementwise_map_costs_its_bytes_at_the_derated_bandwidth_and_a_view_nothing():
    x = meta(4096, 8192)
    clock = RooflineClock(H100)
    seconds, _ = clock(lambda: nn.functional.silu(x))
    assert seconds == pytest.approx(2 * x.numel() * 2 / (3350e9 * EFF.memory["elementwise"]))
    assert kind_of(torch.ops.aten.view.default) is None and kind_of(torch.ops.aten.t.default) is None
    assert kind_of(torch.ops.aten.add_.Tensor) == "elementwise"  # in place: a kernel, not a view
    seconds, _ = clock(lambda: x.view(-1).t() if x.dim() == 1 else x.view(8192, 4096))
    assert clock.tally.gpu_s == 0 and seconds == clock.tally.host_s > 0


def test_attention_is_costed_as_the_fused_kernel_half_the_work_under_a_causal_mask():
    q, k = meta(2, 32, 1024, 128), meta(2, 8, 1024, 128)
    clock = RooflineClock(H100)
    forward, out = clock(lambda: nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True,
                                                                            enable_gqa=True))
    assert out.shape == q.shape
    flops = 2 * 2 * 32 * 1024 * 1024 * 256 / 2
    assert attention_flops(q, k, k, True) == flops and clock.tally.flops == flops
    # Q, K, V, the output and each row's log-sum-exp: never the scores
    assert clock.tally.bytes == 2 * 2 * 1024 * 128 * (32 + 8 + 8 + 32) + 4 * 2 * 32 * 1024
    full, _ = RooflineClock(H100)(lambda: nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True))
    assert full == pytest.approx(2 * forward)
    backward, _ = clock(lambda: torch.autograd.grad([out], [q, k], [torch.empty_like(out)]))
    assert backward > 2.5 * forward


def test_each_operation_costed_alone_adds_up_to_the_whole_model_costed_at_once(tmp_path):
    """A tiny Llama's operations costed one at a time on meta: its repeated layers, which take the
    first layer's costs, cost what they do run; its matrix products what one forward and backward
    of the whole model costs at once; its parameters their bytes."""
    tiny_llama_config(tmp_path / "llama")
    built = causal_lm_on_meta(str(tmp_path / "llama"), 4, 32)
    graph = trace(built.model, built.batch, progress=False)
    cost = TargetModel(H100).profile(built.model, graph, (), built.batch, progress=False)
    assert cost.graph["repeated_blocks"] and cost.graph["cost_source"].startswith("roofline of H100-SXM")
    parameters = sum(p.numel() * p.element_size() for p in built.model.parameters())
    assert sum(a["param_bytes"] for _, a in cost.nodes(data=True)) == parameters

    matmuls: list[float] = []

    def timer(fn):
        seconds, out = clock(fn)
        matmuls.append(clock.tally.by_kind["matmul"])
        return seconds, out

    clock = RooflineClock(H100)
    with FusedAttention():
        every = profile_just_in_time(graph, (), built.batch, torch.device("meta"),
                                     lambda call: _time_once(call, timer), 1, 0, lambda: None, repeats_once=False)
    assert not every.repeated
    assert sum(map(sum, (s[0] for s in every.samples))) == pytest.approx(
        sum(a["forward_s"] + a["backward_s"] for _, a in cost.nodes(data=True)), rel=1e-9)

    work = meta_copy(graph.graph_module)
    inputs = graph.bind((), {k: v.to("meta") for k, v in built.batch.items()})
    _, out = clock(lambda: work(*inputs))
    whole = clock.tally.by_kind["matmul"]
    loss = next(t for t in _tensors(out) if t.dim() == 0)
    clock(lambda: torch.autograd.grad([loss], [p for p in work.parameters()], allow_unused=True))
    whole += clock.tally.by_kind["matmul"]
    assert whole > 0 and sum(matmuls) == pytest.approx(whole, rel=1e-9)


def _tensors(value):
    from lightning_antichain.capture.pytrees import iter_tensors

    return list(iter_tensors(value))


def test_saved_tensors_are_counted_alike_on_meta_and_on_real_values(tmp_path):
    """What each operation keeps for backward, counted on meta (where every storage's address is
    0) as on the CPU's real tensors: the activation memory the plan for a GPU weighs."""
    tiny_llama_config(tmp_path / "llama")
    built = causal_lm_on_meta(str(tmp_path / "llama"), 2, 16, "32-true")
    graph = trace(built.model, built.batch, progress=False)
    on_meta = TargetModel(H100).profile(built.model, graph, (), built.batch, progress=False)
    measured = profile(built.model, built.batch, "cpu", op_graph=graph, progress=False, warmup=0, repeats=1,
                       runtime_overhead=False)
    for key in ("saved_bytes", "output_bytes", "param_bytes"):
        assert {n: a[key] for n, a in on_meta.nodes(data=True)} == {n: a[key] for n, a in measured.nodes(data=True)}
    assert sum(a["saved_bytes"] for _, a in on_meta.nodes(data=True)) > 0


def test_the_command_plans_for_a_named_gpu_with_its_memory_links_and_roofline(tmp_path):
    tiny_llama_config(tmp_path / "llama")
    result = run_main("plan", str(tmp_path / "llama"), "--gpu", "H100", "--ranks", "4", "--per-node", "2",
                      "--stages", "auto", "--batch-size", "8", "--sequence-length", "32", "--internode", "400Gb/s",
                      "--quiet", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert all(stage["device"].startswith("cuda:") for stage in plan["stages"])
    assert plan["profiled_on"].startswith("roofline of H100-SXM")
    assert all(stage["memory_limit_bytes"] == pytest.approx(0.9 * 80e9) for stage in plan["stages"])
    assert plan["bandwidth_gbps"] == pytest.approx(450 * EFF.link)
    # the step on an H100 is milliseconds where the CPU takes far longer
    assert 0 < plan["predicted_step_s"] < 0.05


@pytest.mark.parametrize("gpu, message", [
    ("V100", "not a GPU this planner knows"),
    ("{missing}.json", "there is no such file"),
])
def test_an_unknown_gpu_says_which_are_known_or_how_to_describe_one(tmp_path, gpu, message):
    tiny_llama_config(tmp_path / "llama")
    gpu = gpu.format(missing=tmp_path / "missing")
    result = run_main("plan", str(tmp_path / "llama"), "--gpu", gpu, "--ranks", "2", "--stages", "auto",
                      "--sequence-length", "16")
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_gpu_described_in_a_file_is_checked_and_planned_for(tmp_path):
    fields = {"memory_gb": 24, "hbm_gbps": 1000, "bf16_tflops": 165, "fp32_tflops": 82.6, "intranode_gbps": 32,
              "internode_gbit": 100}
    (tmp_path / "L4x.json").write_text(json.dumps(fields))
    found = target_device(str(tmp_path / "L4x.json"))
    assert found.name == "L4x" and found.internode_gbps == 12.5 and found.tf32_tflops is None
    (tmp_path / "bad.json").write_text(json.dumps({**fields, "hbm_gbps": -1, "clock": 2}))
    with pytest.raises(ValueError, match="unknown clock"):
        target_device(str(tmp_path / "bad.json"))
    del fields["memory_gb"]
    (tmp_path / "short.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="missing memory_gb"):
        target_device(str(tmp_path / "short.json"))


def test_efficiencies_load_as_saved_and_refuse_shares_out_of_range(tmp_path):
    fitted = Efficiencies(compute={**EFF.compute, "matmul": 0.62}, source="fitted on an H200")
    fitted.save(tmp_path / "eff.json")
    assert Efficiencies.load(tmp_path / "eff.json") == fitted
    with pytest.raises(ValueError, match="a share in"):
        Efficiencies(memory={**EFF.memory, "norm": 1.5})


def test_the_gpu_table_says_where_each_figure_comes_from():
    assert {"A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "MI300X"} <= set(TARGET_DEVICES)
    assert all(d.source and d.bf16_tflops > d.fp32_tflops for d in TARGET_DEVICES.values())


def _gemma2_config(directory) -> None:
    import transformers

    transformers.Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=9,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                              sliding_window=8).save_pretrained(directory)


def _mixtral_config(directory) -> None:
    import transformers

    transformers.MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               num_local_experts=4, num_experts_per_tok=2).save_pretrained(directory)


@pytest.mark.parametrize("make, period, layers, captured", [
    (lambda d: tiny_llama_config(d, num_hidden_layers=7), 1, 7, 3), (_gemma2_config, 2, 9, 7),
    (_mixtral_config, 1, 7, 3)], ids=["llama", "gemma2-sliding-and-full", "mixtral-experts"])
def test_a_config_captured_with_its_fewest_layers_costs_as_the_whole_depth_captured(tmp_path, make, period, layers,
                                                                                   captured):
    """A config's layers captured whole, and the fewest from which the rest repeat, and a period
    more (3 of Llama's and Mixtral's, whose first MoE layer issues more operations than the
    next; 7 of Gemma-2's alternating sliding and full attention), extended to the config's depth:
    the same operations, wiring, parameters, costs and bytes, and the same plans."""
    make(tmp_path / "model")
    target = TargetModel(H100)
    whole = causal_lm_on_meta(str(tmp_path / "model"), 2, 32)
    few = causal_lm_on_meta(str(tmp_path / "model"), 2, 32, fewest_layers=True)
    assert few.period == period and few.config_layers == layers
    assert len(few.model.get_submodule(few.layers_path)) == captured
    full = target.profile(whole.model, trace(whole.model, whole.batch, progress=False), (), whole.batch,
                          progress=False)
    depth = Depth(few.layers_path, captured, layers, few.period)
    extended = dataclasses.replace(target, depth=depth).profile(
        few.model, trace(few.model, few.batch, progress=False), (), few.batch, progress=False)
    assert extended.number_of_nodes() == full.number_of_nodes()
    assert extended.number_of_edges() == full.number_of_edges()
    for key in ("forward_s", "backward_s", "param_bytes", "saved_bytes", "output_bytes"):
        assert sum(a[key] for _, a in extended.nodes(data=True)) == pytest.approx(
            sum(a[key] for _, a in full.nodes(data=True)), rel=1e-12)
    assert sorted(p for _, a in extended.nodes(data=True) for p in a["params"]) == sorted(
        p for _, a in full.nodes(data=True) for p in a["params"])
    assert target.trainable_bytes(whole.model) == dataclasses.replace(target, depth=depth).trainable_bytes(few.model)
    for stages in (3, 4):
        plans = [partition(cost, stages, chunks=2, devices=[f"cuda:{i}" for i in range(stages)], bandwidth_gbps=100)
                 for cost in (full, extended)]
        assert [(s.forward_s, s.backward_s, s.memory_bytes, s.param_bytes, len(s.nodes)) for s in plans[0].stages] == [
            (s.forward_s, s.backward_s, s.memory_bytes, s.param_bytes, len(s.nodes)) for s in plans[1].stages]


@pytest.mark.parametrize("kinds, fewest", [
    ([0] * 80, 2), (["sliding", "full"] * 21, 4), (["sliding", "full"] * 21 + ["sliding"], 5),
    (["dense"] * 3 + ["moe"] * 58, 5), ([0, 1, 2], 3), ([], 0),
])
def test_the_fewest_layers_show_each_kind_twice_after_what_does_not_repeat(kinds, fewest):
    assert fewest_layers(kinds) == fewest


def test_where_nothing_fits_each_layout_says_why_on_its_line_and_the_flags_name_the_fewest_nodes(tmp_path):
    """A tiny Llama whose training state alone needs more than 4 ranks of the --memory given: one
    line per layout with the memory that ruled it out, the fewest ranks the state needs by
    arithmetic, and the flags that would change the answer."""
    tiny_llama_config(tmp_path / "llama")
    built = causal_lm_on_meta(str(tmp_path / "llama"), 2, 16, "bf16-mixed")
    state = sum(p.numel() for p in built.model.parameters()) * 16  # bf16 weights and gradients, AdamW in float32
    memory_gb = state / 5.5 / 1e9  # six ranks' worth: four cannot hold it
    result = run_main("plan", str(tmp_path / "llama"), "--gpu", "H100", "--ranks", "4", "--per-node", "2",
                      "--stages", "auto", "--batch-size", "4", "--sequence-length", "16", "--precision", "bf16-mixed",
                      "--memory", str(memory_gb), "--quiet")
    assert result.returncode == 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert lines[0] == ("lightning-antichain: error: no layout of 4 ranks (2 nodes of 2) fits in "
                        f"{memory_gb:.3g} GB a rank:")
    layouts = [line for line in lines if line.startswith("  dp=")]
    assert {line.split()[0] for line in layouts} == {"dp=1", "dp=2", "dp=4"} and len(layouts) >= 5
    assert all(": memory, " in line or "no micro-batch" in line for line in layouts)
    assert f"at least {math.ceil(state / (memory_gb * 1e9))} ranks" in result.stderr
    assert lines[-1].startswith("to fit, give --ranks ") and "--replication fsdp" in lines[-1]
    assert "--precision bf16-true" in lines[-1] and "memory_gb" not in result.stderr


@pytest.mark.parametrize("internode, bound", [("0.01", True), ("100000", False)])
def test_each_layout_says_what_decides_its_step_and_what_a_rank_sends(tmp_path, internode, bound):
    """Four ranks on four nodes: a ring all-reduce of DDP sends 2 x 3/4 of the gradients from each
    rank whatever the links; over links of 10 MB/s the replicas' collectives outlast the compute
    (communication-bound, the collective decides the step), over 100 TB/s they do not."""
    import lightning_antichain as la

    tiny_llama_config(tmp_path / "llama")
    built = causal_lm_on_meta(str(tmp_path / "llama"), 8, 32)
    rows = {}
    for replication in ("ddp", "fsdp"):
        plan = la.plan_layout(built.model, built.batch, 4, device="cuda", per_node=1, replication=replication,
                              internode_gbps=float(internode), target=TargetModel(H100), progress=False)
        rows[replication] = next(r for r in plan.layouts if (r["dp"], r["pp"]) == (4, 1) and "moved_bytes" in r)
    weights = sum(p.numel() * p.element_size() for p in built.model.parameters())
    assert rows["ddp"]["moved_bytes"] == int(2 * 3 / 4 * weights)
    assert rows["ddp"]["communication_bound"] is bound
    assert (rows["ddp"]["decided_by"] == "all-reduce") is bound
    assert rows["fsdp"]["moved_bytes"] >= int(2 * 3 / 4 * weights)  # gathers the weights, scatters the gradients
    assert rows["fsdp"]["communication_bound"] is bound


def test_a_mixture_of_experts_costs_its_routed_tokens_against_one_expert_each_and_holds_every_expert(tmp_path):
    """Mixtral's experts as one grouped product: the FLOPs of each token's top-k rows against one
    expert's matrices (not every expert's), while every expert's parameters are held."""
    _mixtral_config(tmp_path / "mixtral")
    built = causal_lm_on_meta(str(tmp_path / "mixtral"), 2, 16)
    moe = built.model.model.layers[0].mlp
    x = meta(2, 16, 64)
    clock = RooflineClock(H100)
    clock(lambda: moe(x))
    tokens, top_k, hidden, inter = 32, 2, 64, 128
    experts = 2 * tokens * top_k * hidden * (2 * inter) + 2 * tokens * top_k * inter * hidden
    router = 2 * tokens * hidden * 4
    # every kernel's FLOPs: the products, and a little elementwise work
    assert experts + router <= clock.tally.flops < 1.1 * (experts + router)
    held = sum(p.numel() for p in moe.parameters())
    assert held == 4 * 3 * hidden * inter + hidden * 4  # all four experts' gate, up and down, and the router


def _kernels_of(fn, *shapes, gpu=None):
    """The kernels the roofline counts for ``fn``'s forward and backward on meta inputs."""
    clock = RooflineClock(gpu or target_device("H100"))
    inputs = [torch.empty(*s, device="meta", dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    _, out = clock(lambda: fn(*inputs))
    forward = clock.tally
    clock(lambda: torch.autograd.grad(out, inputs, torch.empty_like(out)))
    return forward, clock.tally


def test_the_roofline_priced_again_from_its_kernels_gives_what_it_tallied():
    gpu = target_device("H100")
    for forward in _kernels_of(lambda a, b: torch.nn.functional.linear(a, b).relu(), (512, 256), (1024, 256)):
        op = TimedOperation("x", tuple(forward.kernels), forward.dispatches, 1.0)
        assert op.predicted_s(gpu, Efficiencies()) == pytest.approx(forward.seconds, rel=1e-12)
        assert {k.kind for k in forward.kernels} <= {"matmul", "elementwise"}


def test_efficiencies_fitted_to_timings_made_at_known_efficiencies_recover_them():
    """Timings priced at known shares (matmul 0.55 of the peak, attention 0.3, elementwise and
    norm 0.6 and 0.5 of the bandwidth, 12 us of host time a call): fitted from the assumed shares,
    each comes back and every operation is predicted at its time."""
    gpu = target_device("H100")
    truth = dataclasses.replace(Efficiencies(), compute={**Efficiencies().compute, "matmul": 0.55, "attention": 0.3},
                                memory={**Efficiencies().memory, "elementwise": 0.6, "norm": 0.5}, dispatch_s=12e-6)
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    cases = [(torch.nn.functional.linear, (4096, 4096), (4096, 4096)),
             (torch.nn.functional.linear, (16384, 4096), (14336, 4096)),
             (sdpa, (1, 32, 4096, 128), (1, 32, 4096, 128), (1, 32, 4096, 128)),
             (torch.add, (16384, 4096), (16384, 4096)),
             (lambda g, u: torch.nn.functional.silu(g) * u, (8192, 14336), (8192, 14336)),
             (lambda x: torch.softmax(x, -1), (8192, 8192)),
             (lambda x: x.view(4, -1).t().reshape(-1), (8,))]
    timed = []
    for fn, *shapes in cases:
        for half in _kernels_of(fn, *shapes):
            op = TimedOperation(str(fn), tuple(half.kernels), half.dispatches, 0.0)
            timed.append(dataclasses.replace(op, measured_s=op.predicted_s(gpu, truth)))
    fitted = fit_efficiencies(timed, gpu, "a test")
    assert fitted.source == "a test"
    for kind in ("matmul", "attention"):
        assert fitted.compute[kind] == pytest.approx(truth.compute[kind], rel=0.02)
    for kind in ("elementwise", "norm"):
        assert fitted.memory[kind] == pytest.approx(truth.memory[kind], rel=0.02)
    assert fitted.dispatch_s == pytest.approx(truth.dispatch_s, rel=0.02)
    for op in timed:
        assert op.predicted_s(gpu, fitted) == pytest.approx(op.measured_s, rel=0.03)
    assert max(abs(op.predicted_s(gpu, Efficiencies()) / op.measured_s - 1) for op in timed) > 0.2
