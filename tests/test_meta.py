"""A model built on the meta device becomes real stage by stage, each stage on its own device."""


import pytest
import torch
from live_bytes import LiveBytes
from pipelined import assert_pipelined
from torch import nn
from zoo import ZOO

import lightning_antichain as la


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.LayerNorm(64),
                         nn.Linear(64, 4)).double()


def test_a_model_built_on_meta_trains_like_the_plain_module_with_an_optimizer_made_before():
    torch.manual_seed(0)
    plain = build()
    cost = la.profile(plain, torch.randn(4, 16, dtype=torch.float64), repeats=1, warmup=0, progress=False)
    with torch.device("meta"):
        model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # made on the meta model
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    with la.Pipeline(model, la.partition(cost, 3, chunks=4), chunks=4) as pipe:
        assert not [name for name, t in model.state_dict().items() if t.is_meta]
        model.load_state_dict(plain.state_dict())
        losses, plain_losses = [], []
        for _ in range(3):
            x = torch.randn(12, 16, dtype=torch.float64)
            for net, opt, kept in ((pipe, optimizer, losses), (plain, plain_optimizer, plain_losses)):
                loss = net(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                kept.append(loss.item())
        assert_pipelined(pipe, stages=3)
    assert losses[0] != losses[-1]  # the optimizer made on meta moved the real weights
    torch.testing.assert_close(losses, plain_losses, rtol=1e-12, atol=0)
    torch.testing.assert_close(list(model.parameters()), list(plain.parameters()), rtol=1e-12, atol=1e-14)


def test_each_module_is_initialised_by_its_reset_parameters():
    torch.manual_seed(0)
    cost = la.profile(build(), torch.randn(4, 16, dtype=torch.float64), repeats=1, warmup=0, progress=False)
    with torch.device("meta"):
        model = build()
    la.Pipeline(model, la.partition(cost, 2), chunks=2).close()
    norm = model[4]
    assert torch.equal(norm.weight, torch.ones(64, dtype=torch.float64))  # LayerNorm's own reset
    first = model[0].weight
    assert first.abs().max() <= 1 / 16**0.5 and first.std() > 0  # Linear's kaiming-uniform bound


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return x * self.w


def test_a_meta_module_without_reset_parameters_is_named():
    real = nn.Sequential(nn.Linear(16, 16), Scale())
    cost = la.profile(real, torch.randn(4, 16), repeats=1, warmup=0, progress=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), Scale())
    with pytest.raises(la.UninitializedTensorError,
                       match=r"1 \(Scale\) has parameters or buffers on the meta device \(1.w\) but no reset_par.*"
                             r"param_init_fn=.*la.load_checkpoint"):
        la.Pipeline(model, la.partition(cost, 2), chunks=2)


MEMORY_KEYS = ["output_bytes", "saved", "storages", "mutates", "saved_bytes", "param_bytes", "buffer_bytes", "params",
               "uses"]


@pytest.mark.parametrize("name", ["resnet18", "hf_bert", "nanogpt", "nn_transformer"])
def test_a_model_on_meta_is_profiled_with_the_memory_of_the_real_one(name):
    """fx with BatchNorm and in-place ReLUs, export with views of buffers (a mask's slices, token
    types), concrete capture with chunked projection weights."""
    entry = ZOO[name]
    torch.manual_seed(0)
    real = entry.build()
    with torch.device("meta"):
        meta = entry.build()
    args, kwargs = entry.batch(2)
    example = kwargs or args
    whole = la.profile(real, example, repeats=1, warmup=0, progress=False, runtime_overhead=False)
    streamed = la.profile(meta, example, repeats=1, warmup=0, progress=False, runtime_overhead=False)
    assert not whole.graph["just_in_time"] and streamed.graph["just_in_time"]
    assert list(streamed.nodes) == list(whole.nodes)
    assert set(streamed.edges) == set(whole.edges)
    for node in whole.nodes:
        assert {k: streamed.nodes[node][k] for k in MEMORY_KEYS} == {k: whole.nodes[node][k] for k in MEMORY_KEYS}
    assert sum(streamed.nodes[n]["forward_s"] for n in streamed) > 0
    assert sum(streamed.nodes[n]["backward_s"] for n in streamed) > 0
    assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])  # the caller's model stays as it was


def deep() -> nn.Module:
    return nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(256, 256), nn.GELU())]).double()


def test_profiling_a_model_on_meta_holds_a_few_layers_at_a_time():
    with torch.device("meta"):
        model = deep()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    with LiveBytes() as live:
        cost = la.profile(model, torch.randn(8, 256, dtype=torch.float64), repeats=2, warmup=1, progress=False)
    layer = whole / 12
    assert live.peak["cpu"] < 3 * layer, f"the profile held {live.peak['cpu'] / layer:.1f} layers at once"
    assert sum(cost.nodes[n]["param_bytes"] for n in cost) == whole


def test_a_state_dict_file_loads_straight_into_the_stages(tmp_path):
    torch.manual_seed(0)
    plain = build()
    torch.save(plain.state_dict(), tmp_path / "weights.pt")
    cost = la.profile(plain, torch.randn(4, 16, dtype=torch.float64), repeats=1, warmup=0, progress=False)
    with torch.device("meta"):
        model = build()
    la.load_state_dict(model, torch.load(tmp_path / "weights.pt", mmap=True, weights_only=True))
    assert all(p.is_meta for p in model.parameters())  # the values wait for their stages
    with la.Pipeline(model, la.partition(cost, 3, chunks=2), chunks=2) as pipe:
        for name, value in plain.state_dict().items():
            assert torch.equal(model.state_dict()[name], value), name
        x = torch.randn(6, 16, dtype=torch.float64)
        torch.testing.assert_close(pipe(x), plain(x), rtol=1e-12, atol=0)


def test_a_state_dict_that_does_not_match_is_refused_like_torch_refuses_it():
    with torch.device("meta"):
        model = build()
    state = build().state_dict()
    with pytest.raises(RuntimeError, match=r"missing keys \['5.bias'\], unexpected keys \['5.offset'\]"):
        la.load_state_dict(model, {**{k: v for k, v in state.items() if k != "5.bias"}, "5.offset": torch.zeros(4)})
    with pytest.raises(RuntimeError, match=r"size mismatch for 0.weight"):
        la.load_state_dict(model, {**state, "0.weight": torch.zeros(3, 3)})


def test_a_real_model_profiled_just_in_time_is_left_as_it_was_and_costs_the_same_memory():
    torch.manual_seed(0)
    model = deep()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    example = torch.randn(4, 256, dtype=torch.float64)
    whole = la.profile(model, example, repeats=1, warmup=0, progress=False, runtime_overhead=False)
    with LiveBytes() as live:
        streamed = la.profile(model, example, repeats=1, warmup=0, progress=False, runtime_overhead=False,
                              just_in_time=True)
    assert streamed.graph["just_in_time"]
    for node in whole.nodes:
        assert {k: streamed.nodes[node][k] for k in MEMORY_KEYS} == {k: whole.nodes[node][k] for k in MEMORY_KEYS}
    layer = sum(p.numel() * p.element_size() for p in model.parameters()) / 12
    assert live.peak["cpu"] < 3 * layer  # never a copy of all of it
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_repeated_blocks_are_profiled_once_with_the_memory_of_every_block_and_the_plan_says_so(monkeypatch):
    """nanoGPT's 4 blocks are equal but for their names: blocks 1-3 take block 0's measurements,
    node for node, and their memory counts equal a whole profile of the real model's, key for key."""
    from lightning_antichain.planner import profiler

    entry = ZOO["nanogpt"]
    torch.manual_seed(0)
    real = entry.build()
    with torch.device("meta"):
        meta = entry.build()
    args, _ = entry.batch(2)
    whole = la.profile(real, args, repeats=1, warmup=0, progress=False, runtime_overhead=False)
    timed = []
    time_once = profiler._time_once
    monkeypatch.setattr(profiler, "_time_once",
                        lambda call, timer: timed.append(call.node.name) or time_once(call, timer))
    streamed = la.profile(meta, args, repeats=1, warmup=0, progress=False, runtime_overhead=False)
    assert streamed.graph["repeated_blocks"] == {"h.0": ["h.1", "h.2", "h.3"]}
    block = [n for n in streamed.nodes if streamed.nodes[n]["owner"].startswith("h.0")]
    repeats = [n for n in streamed.nodes if streamed.nodes[n]["owner"].startswith(("h.1", "h.2", "h.3"))]
    assert len(repeats) == 3 * len(block) and not set(repeats) & set(timed)  # never run
    assert set(block) <= set(timed)
    for node in whole.nodes:
        assert {k: streamed.nodes[node][k] for k in MEMORY_KEYS} == {k: whole.nodes[node][k] for k in MEMORY_KEYS}
    for a, b in zip(block, repeats):  # node for node
        assert streamed.nodes[b]["forward_s"] == streamed.nodes[a]["forward_s"]
    plan = la.partition(streamed, 2, chunks=2)
    assert "profiled once: h.1 .. h.3 (3 blocks) repeat h.0" in plan.table()


@pytest.mark.parametrize(("seconds", "kept"), [((0.001, 0.002), 5), ((0.6, 0.5), 1), ((0.3, 0.2), 1)])
def test_an_operation_profiled_just_in_time_is_replayed_fewer_times_where_its_replays_take_long(seconds, kept):
    """Seven replays (two warm-ups) of a short operation; of one whose replays add up past a second,
    one more replay after that, timed and kept: the progress still counts all seven."""
    from lightning_antichain.planner.just_in_time import _timed

    replays, steps = [], []
    measured = _timed(None, lambda call: replays.append(call) or seconds, 7, 2, lambda: steps.append(1))
    assert measured == [seconds] * kept and len(steps) == 7
    assert len(replays) == {5: 7, 1: 2 if sum(seconds) >= 1 else 3}[kept]
