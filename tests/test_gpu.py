"""The runtime on a GPU: parity, the stream machinery under stress, the strategy under mixed
precision, and memory against the plan.

Run with ``python -m pytest -m gpu`` on a machine with CUDA (``--gpu-device cuda:N`` picks the
GPU); without one every test here is skipped. ``--gpu-device cpu`` runs them on the CPU as a dry
run. Several stages share the one GPU a test gets, each on its own compute stream, and mixed
cases put stages on the CPU beside it. No check calls ``torch.cuda.synchronize()``: results are
read on the caller's stream, so a missing stream dependency shows up as a wrong value.
"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys

import lightning as L
import pytest
import torch
from lit_models import TinyClassifier, loader
from pipelined import assert_pipelined
from torch import nn

import lightning_antichain as la
from lightning_antichain.device import ship, stage_streams

pytestmark = pytest.mark.gpu

MODES = ["never", "except_last", "always"]


def convnet(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
        nn.Linear(64, 10),
    ).to(dtype)


@pytest.fixture(scope="module")
def convnet_cost():
    return la.profile(convnet(), torch.randn(4, 3, 8, 8, dtype=torch.float64), repeats=1, warmup=0, progress=False,
                      runtime_overhead=False)


def pipelined_grads(model, cost, devices, chunks, recompute, batches):
    """Gradients (on the CPU) and outputs of ``model`` pipelined over ``devices``, summed over ``batches``."""
    plan = la.partition(cost, stages=len(devices), chunks=chunks, devices=[str(d) for d in devices])
    outputs = []
    with la.Pipeline(model, plan, chunks=chunks, recompute=recompute, output_device=devices[-1]) as pipe:
        for x in batches:
            out = pipe(x.to(devices[0]))
            out.square().mean().backward()
            outputs.append(out.detach().cpu())
        assert_pipelined(pipe, stages=min(len(devices), 2) if len(devices) > 1 else 1)
    return [p.grad.cpu() for p in model.parameters()], outputs


def plain_grads(model, device, batches):
    model = model.to(device)
    outputs = []
    for x in batches:
        out = model(x.to(device))
        out.square().mean().backward()
        outputs.append(out.detach().cpu())
    return [p.grad.cpu() for p in model.parameters()], outputs


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("recompute", MODES)
def test_float64_parity_with_stages_sharing_one_device(gpu_device, convnet_cost, stages, chunks, recompute):
    batches = [torch.randn(10, 3, 8, 8, dtype=torch.float64) for _ in range(2)]
    model = convnet()
    expected = plain_grads(copy.deepcopy(model), gpu_device, batches)
    got = pipelined_grads(model, convnet_cost, [gpu_device] * stages, chunks, recompute, batches)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("layout", [("cpu", "gpu"), ("gpu", "cpu"), ("cpu", "gpu", "cpu"), ("gpu", "cpu", "gpu")])
@pytest.mark.parametrize("recompute", MODES)
def test_float64_parity_with_stages_on_the_cpu_and_the_gpu(gpu_device, convnet_cost, layout, recompute):
    devices = [gpu_device if kind == "gpu" else torch.device("cpu") for kind in layout]
    batches = [torch.randn(9, 3, 8, 8, dtype=torch.float64) for _ in range(2)]
    model = convnet()
    expected = plain_grads(copy.deepcopy(model), "cpu", batches)
    got = pipelined_grads(model, convnet_cost, devices, 3, recompute, batches)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_float32_parity_is_as_close_to_float64_as_plain_float32_is(gpu_device, convnet_cost, chunks):
    """Micro-batching only reorders float32 sums (per-sample work is the same), so the pipeline's
    float32 gradients may be no further from the float64 truth than plain float32's, up to a factor
    for the reordering (4) and cuDNN picking other kernels for other batch sizes (TF32 convolutions
    are allowed by default, so the absolute floor follows the gradient's scale)."""
    batches = [torch.randn(16, 3, 8, 8) for _ in range(2)]
    truth, _ = plain_grads(convnet(), "cpu", [x.double() for x in batches])
    plain, _ = plain_grads(convnet(torch.float32), gpu_device, batches)
    piped, _ = pipelined_grads(convnet(torch.float32), convnet_cost, [gpu_device] * 3, chunks, "except_last", batches)
    for t, p, q in zip(truth, piped, plain):
        plain_error = (q.double() - t).abs().max().item()
        piped_error = (p.double() - t).abs().max().item()
        assert piped_error <= 4 * plain_error + 1e-6 * t.abs().max().item(), (piped_error, plain_error)


def test_many_steps_of_uneven_micro_batches_train_like_the_plain_module(gpu_device):
    """Forty SGD steps with momentum, four stages on one device, batch sizes that do not divide
    into the micro-batches (and one smaller than their count): every loss and the final weights
    equal plain training's. The optimizer runs on the caller's stream between steps, so the
    stages must wait for it, and the caller must wait for their gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(256, 256), nn.Tanh())],
                          nn.Linear(256, 8)).double()
    plain = copy.deepcopy(model).to(gpu_device)
    cost = la.profile(model, torch.randn(4, 256, dtype=torch.float64), repeats=1, warmup=0, progress=False,
                      runtime_overhead=False)
    plan = la.partition(cost, stages=4, chunks=8, devices=[str(gpu_device)] * 4)
    sizes = [29, 8, 31, 17, 3, 64] * 7
    data = [torch.randn(n, 256, dtype=torch.float64) for n in sizes[:40]]
    losses, plain_losses = [], []
    with la.Pipeline(model, plan, chunks=8, recompute="except_last") as pipe:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
        for x in data:
            for net, optimizer, kept in ((pipe, opt, losses), (plain, plain_opt, plain_losses)):
                loss = net(x.to(gpu_device)).sin().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                kept.append(loss.detach())
        assert_pipelined(pipe, stages=4)
        busy = pipe.last_step.busy_s  # on a GPU: each stage's tasks timed by events on its stream
        assert len(busy) == 4 and all(0 < b < 60 for b in busy), busy
    torch.testing.assert_close(torch.stack(losses).cpu(), torch.stack(plain_losses).cpu(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close([p.cpu() for p in model.parameters()], [p.cpu() for p in plain.parameters()],
                               rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_strategy_trains_like_plain_lightning_under_each_precision(gpu_device, precision):
    accelerator = "gpu" if gpu_device.type == "cuda" else "cpu"
    if accelerator == "cpu" and precision == "16-mixed":
        pytest.skip("16-mixed needs a GPU")
    runs = {}
    for name, strategy in (("plain", "auto"), ("piped", la.AntichainPipelineStrategy(chunks=4,
                                                                                   profile_cache=False))):
        torch.manual_seed(0)
        model = TinyClassifier()
        trainer = L.Trainer(accelerator=accelerator, devices=[gpu_device.index or 0] if accelerator == "gpu" else 1,
                            strategy=strategy, precision=precision, max_steps=20, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, loader())
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        runs[name] = (model.losses, scaler.get_scale() if scaler is not None else None, trainer)
    (plain, plain_scale, _), (piped, piped_scale, trainer) = runs["plain"], runs["piped"]
    assert len(piped) == 20
    # 16-bit rounding differs between micro-batches of 4 and a batch of 16 (other kernels); the
    # losses follow the same course within a few units of the format's precision
    tolerance = {"32-true": 1e-5, "16-mixed": 1e-2, "bf16-mixed": 3e-2}[precision]
    torch.testing.assert_close(torch.tensor(piped), torch.tensor(plain), rtol=tolerance, atol=0)
    assert piped_scale == plain_scale  # the GradScaler skipped the same steps and grew alike
    assert trainer.strategy.tasks_run


def test_what_each_recompute_mode_saves_on_each_stage_is_what_the_plan_predicts(gpu_device):
    """One stage at a time on the GPU (the other on the CPU), so the allocator's peak over a forward
    and backward is that stage's. Costs the plan does not model (the cuBLAS workspace, the
    allocator's rounding) cancel in the difference between recompute modes: what ``except_last``
    and ``always`` save against ``never`` must be the plan's saving within 20% (and 8 MiB)."""
    if gpu_device.type != "cuda":
        pytest.skip("counts CUDA allocator peaks")
    torch.manual_seed(0)
    width, batch, chunks = 1024, 4096, 4
    model = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(width, width), nn.GELU())])
    cost = la.profile(model, torch.randn(batch // chunks, width), str(gpu_device), repeats=1, warmup=1,
                      progress=False, runtime_overhead=False)
    ops = len([v for v in cost if not cost.nodes[v].get("pinned")])
    peaks, predicted = {}, {}
    for on_gpu in (0, 1):
        devices = [str(gpu_device) if k == on_gpu else "cpu" for k in range(2)]
        for recompute in MODES:
            gc.collect()
            torch.cuda.empty_cache()
            net = copy.deepcopy(model)
            plan = la.plan_from_balance(cost, [ops // 2, ops - ops // 2], chunks=chunks, devices=devices,
                                        recompute=recompute, optimizer_multiplier=0.0)
            with la.Pipeline(net, plan, chunks=chunks, recompute=recompute, output_device="cpu") as pipe:
                x = torch.randn(batch, width)
                pipe(x).square().mean().backward()  # first step: workspace and gradients exist after it
                before = torch.cuda.memory_allocated(gpu_device)
                torch.cuda.reset_peak_memory_stats(gpu_device)
                pipe(x).square().mean().backward()
                peaks[on_gpu, recompute] = torch.cuda.max_memory_allocated(gpu_device) - before
            predicted[on_gpu, recompute] = plan.stages[on_gpu].memory_bytes
            del net, pipe
    report = []
    for on_gpu in (0, 1):
        for recompute in MODES[1:]:
            saved = peaks[on_gpu, "never"] - peaks[on_gpu, recompute]
            saving = predicted[on_gpu, "never"] - predicted[on_gpu, recompute]
            report.append((on_gpu, recompute, saved >> 20, saving >> 20))
            assert abs(saved - saving) <= 0.2 * saving + 8 * 2**20, report
    print("stage, mode, MiB saved against never: measured, predicted:", report)


@pytest.mark.parametrize("kind", ["module", "functional"])
@pytest.mark.parametrize("layout", [("gpu", "gpu"), ("gpu", "gpu", "gpu"), ("cpu", "gpu")])
@pytest.mark.parametrize("recompute", MODES)
def test_recomputed_dropout_on_the_gpu_draws_the_masks_the_output_saw(gpu_device, kind, layout, recompute):
    """The GPU's generators under recomputation: every gradient is the true gradient of the output
    the loss saw, read back from the output's own masks (see test_randomness.py)."""
    from test_randomness import MODELS

    devices = [str(gpu_device) if k == "gpu" else "cpu" for k in layout]
    model = MODELS[kind](layers=2 * len(devices)).double()
    cost = la.profile(model, torch.rand(2, 64, dtype=torch.float64) + 0.1, repeats=1, warmup=0, progress=False,
                      runtime_overhead=False)
    ops = sum(1 for v in cost.nodes if not cost.nodes[v].get("pinned"))
    balance = [ops // len(devices)] * len(devices)
    balance[-1] += ops - sum(balance)
    plan = la.plan_from_balance(cost, balance, devices=devices)
    with la.Pipeline(model, plan, chunks=4, recompute=recompute, output_device=devices[-1]) as pipe:
        for seed in range(2):
            torch.manual_seed(seed)
            x = torch.rand(16, 64, dtype=torch.float64, device=devices[0]) + 0.1
            model.zero_grad()
            y = pipe(x)
            assert (y == 0).any() and (y != 0).any()
            c = torch.randn_like(y)
            (c * y).sum().backward()
            column_sums = (c * y).detach().sum(0).cpu()
            for w in model.w:  # the output is linear in each weight: its gradient is the output's over it
                torch.testing.assert_close(w.grad.cpu(), column_sums / w.detach().cpu(), rtol=1e-12, atol=1e-12)


def test_plan_command_profiles_and_plans_on_the_device_asked_for(gpu_device, tmp_path):
    out = tmp_path / "plan.json"
    command = [sys.executable, "-m", "lightning_antichain", "plan", "torchvision.models.resnet18", "--model-kwargs",
               '{"num_classes": 10}', "--stages", "1", "--input-shape", "3,32,32", "--batch-size", "8", "--chunks",
               "2", "--device", str(gpu_device), "--output", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert la.Plan.load(out).stages[0].device == str(gpu_device)


def test_streams_of_a_stage_on_the_gpu(gpu_device):
    if gpu_device.type != "cuda":
        pytest.skip("streams exist on CUDA only")
    streams = stage_streams(gpu_device)
    assert len({streams.compute, streams.send, streams.receive}) == 3
    with torch.cuda.stream(streams.compute):
        x = torch.randn(1000, device=gpu_device) * 2
        moved, event = ship([x], streams, stage_streams(gpu_device))
    assert moved[0].data_ptr() == x.data_ptr() and event is not None  # same device: an order, no copy
    to_cpu, event = ship([x], streams, stage_streams("cpu"))
    assert event is None and torch.equal(to_cpu[0], x.cpu())
    back, event = ship([to_cpu[0]], stage_streams("cpu"), streams)
    torch.cuda.current_stream(gpu_device).wait_event(event)
    assert torch.equal(back[0], x)


class MetaBuilt(TinyClassifier):
    """TinyClassifier's network built in configure_model(), on meta under empty_init."""

    def __init__(self) -> None:
        super().__init__()
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


class _StagesNotBefore(L.Callback):
    """Where the pipelined module's parameters are when training starts, before the first forward."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.devices = {p.device.type for p in pl_module.parameters()}
        self.allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("empty_init", [False, True])
def test_the_root_device_gets_no_stage_before_the_pipeline_places_it(gpu_device, empty_init):
    """A model built on the CPU (or on meta) waits there until each stage goes to its device: the
    root GPU is never handed the whole model first. Four stages share the GPU (placement)."""
    accelerator = "gpu" if gpu_device.type == "cuda" else "cpu"
    probe = _StagesNotBefore()
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, placement=[0, 0, 0, 0],
                                            empty_init=empty_init)
    trainer = L.Trainer(accelerator=accelerator, devices=[gpu_device.index or 0] if accelerator == "gpu" else 1,
                        strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe])
    model = MetaBuilt() if empty_init else TinyClassifier()
    trainer.fit(model, loader())
    assert probe.devices == ({"meta"} if empty_init else {"cpu"})
    assert trainer.strategy.plan.num_stages == 4
    assert {p.device.type for p in model.net.parameters()} == {"cpu"}  # teardown brings it back
    assert len(model.losses) == 3 and all(torch.isfinite(torch.tensor(model.losses)))


def test_a_model_too_big_for_a_quarter_of_the_gpu_is_profiled_one_operation_at_a_time(gpu_device):
    """The profiler's automatic choice, forced by a tiny memory limit is not possible, so the
    just-in-time profile is asked for on the GPU: its memory per operation is the whole profile's,
    and the GPU's peak while profiling stays below the model's bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(1024, 1024), nn.GELU())])
    example = torch.randn(8, 1024)
    whole = la.profile(model, example, str(gpu_device), repeats=1, warmup=1, progress=False, runtime_overhead=False)
    streamed = la.profile(model, example, str(gpu_device), repeats=1, warmup=1, progress=False,
                          runtime_overhead=False, just_in_time=True)
    keys = ["output_bytes", "saved", "storages", "saved_bytes", "param_bytes"]
    for node in whole.nodes:
        assert {k: streamed.nodes[node][k] for k in keys} == {k: whole.nodes[node][k] for k in keys}
    if gpu_device.type == "cuda":
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert streamed.graph["profile_peak_bytes"] < model_bytes / 2


def test_operations_are_timed_in_context_on_each_stage_stream(gpu_device, convnet_cost):
    """The op clock (measure/op_clock.py) on a GPU stage marks its compute stream with events: each
    operation is timed, outputs and gradients are those of the plain module, and a pass's times
    fit in its task's time on the device."""
    from lightning_antichain.device import seconds_between
    from lightning_antichain.measure.op_clock import OpClock

    batch = torch.randn(10, 3, 8, 8, dtype=torch.float64)
    model = convnet()
    expected = plain_grads(copy.deepcopy(model), gpu_device, [batch])
    plan = la.partition(convnet_cost, stages=2, chunks=1, devices=[str(gpu_device)] * 2)
    with la.Pipeline(model, plan, chunks=1, output_device=gpu_device) as pipe:
        pipe(batch.to(gpu_device))  # the stages exist after a first call
        model.zero_grad()
        clocks = [OpClock(gpu_device) for _ in pipe.stages]
        for stage, clock in zip(pipe.stages, clocks):
            stage.clock = clock
        out = pipe(batch.to(gpu_device))
        out.square().mean().backward()
        record = pipe.last_step
        for stage in pipe.stages:
            stage.clock = None
    got = [p.grad.cpu() for p in model.parameters()], [out.detach().cpu()]
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    for k, clock in enumerate(clocks):
        tasks, marks = record.timed[k], record.marks[k]
        spans = {t.task.phase: (marks[i] if marks else (record.started_at + t.start, record.started_at + t.end))
                 for i, t in enumerate(tasks)}
        clock.backward_ended(spans["backward"][1])
        computed = {n.name for n in pipe.stages[k].module.graph.nodes
                    if n.op in ("call_function", "call_method", "call_module")}
        assert set(clock.forward_s) == computed and set(clock.backward_s) <= computed and clock.backward_s
        for phase, times in (("forward", clock.forward_s), ("backward", clock.backward_s)):
            assert all(v >= 0 for v in times.values())
            assert sum(times.values()) <= seconds_between(*spans[phase]) * 1.01 + 1e-4


def test_a_hugging_face_decoder_built_on_meta_is_loaded_from_its_shards_into_stages_on_the_gpu(gpu_device, tmp_path):
    """Each stage reads its own tensors from the memory-mapped shards onto the GPU; the losses are
    plain Lightning's on the CPU (float64)."""
    pytest.importorskip("transformers")
    from test_hf_meta import STEPS, CausalLM, data, plain_losses, reference_state, save

    accelerator = "gpu" if gpu_device.type == "cuda" else "cpu"
    model = CausalLM("llama", save("llama", tmp_path, "sharded"))
    seen: list[set[str]] = []

    class Where(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            seen.append({p.device.type for p in pl_module.net.parameters()})

    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, empty_init=True, placement=[0, 0])
    trainer = L.Trainer(accelerator=accelerator, devices=[gpu_device.index or 0] if accelerator == "gpu" else 1,
                        strategy=strategy, precision="64-true", max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Where()])
    trainer.fit(model, data())
    assert seen and seen[0] == {gpu_device.type}
    for key, value in reference_state("llama").items():
        assert torch.equal(model.initial[key].cpu(), value), key
    torch.testing.assert_close(model.losses, plain_losses("llama", reference_state("llama")), rtol=1e-6, atol=0)


@pytest.mark.parametrize("stages", [1, 2])
def test_plans_on_the_gpu_are_calibrated_on_the_stage_streams_and_leave_the_model_as_it_was(gpu_device, tmp_path,
                                                                                            stages):
    """Calibration runs GPU plans too: each stage's forward and backward are its time on the device
    (events on its compute stream), every stage's operations are timed in context, and the model
    keeps its parameters, gradients and devices."""
    if gpu_device.type == "cpu" and stages == 1:
        pytest.skip("a single CPU stage shares the CPU with nothing: it is not calibrated")
    model = convnet(torch.float32)
    x = torch.randn(16, 3, 8, 8)
    before = copy.deepcopy(model.state_dict())
    plan = la.plan(model, x, [str(gpu_device)] * stages, chunks=4, profile_cache=str(tmp_path), progress=False,
                   rebalance_rounds=0)
    found = plan.calibration
    assert found is not None and found["steps"] >= 3
    assert all(t > 0 for t in [*found["forward_s"], *found["backward_s"]])
    timed = set(found["operations"])
    assert timed and all(set(stage.nodes) & timed for stage in plan.stages)
    assert all(p.grad is None for p in model.parameters())
    for name, value in model.state_dict().items():  # on the CPU still, where the plan's capture saw them
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
        assert value.device == before[name].device


def test_stages_as_processes_on_the_gpus_equal_plain_lightning(tmp_path, gpu_device):
    """One process per GPU (NCCL) under 1F1B, or on a one-GPU machine one process holding two
    virtual stages (interleaved 1F1B): float64 losses equal plain Lightning's on the same GPU."""
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parent / "scripts" / "stage_processes.py"
    accelerator = "cpu" if gpu_device.type == "cpu" else "gpu"
    count = torch.cuda.device_count() if accelerator == "gpu" else 1
    layout = ["--devices", str(count), "--schedule", "1f1b"] if count > 1 else [
        "--devices", "1", "--schedule", "interleaved-1f1b"]

    def fit(name: str, *args: str) -> list[float]:
        out = tmp_path / name
        out.mkdir()
        done = subprocess.run([sys.executable, str(script), "--out", str(out), "--accelerator", accelerator, *args],
                              capture_output=True, text=True, timeout=600, cwd=out)
        assert done.returncode == 0, done.stderr[-4000:]
        return [json.loads(p.read_text())["losses"] for p in sorted(out.glob("rank*.json"))]

    (plain,) = fit("plain", "--plain")
    for losses in fit("stages", *layout):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=1e-6, atol=0)


@pytest.mark.parametrize("layout", ["gpu,gpu", "gpu,cpu"])
def test_a_weight_tied_across_devices_is_read_through_a_leaf_on_each_and_trains_as_plain(gpu_device, layout):
    """The embedding is also the output layer's weight: the first stage reads it where it lives,
    the last through a copy on its own device (the GPU as a second device of its own, or the CPU
    beside it). Both gradients reach the parameter on the backward's own streams, and after an
    SGD step the copy takes the new values: two steps equal the plain module's in float64."""
    from models import TiedEmbedding

    torch.manual_seed(0)
    model = TiedEmbedding().double()
    tokens = torch.randint(0, 40, (12, 7))
    cost = la.profile(model, tokens[:3], repeats=1, warmup=0, progress=False, runtime_overhead=False)
    devices = [gpu_device if kind == "gpu" else torch.device("cpu") for kind in layout.split(",")]
    plan = la.partition(cost, 2, chunks=4, devices=[str(d) for d in devices])
    plain = copy.deepcopy(model).to(devices[0])
    with la.Pipeline(model, plan, chunks=4, devices=devices, device_slots=(0, 1)) as pipe:
        for step in range(2):
            for net, run in ((plain, plain), (model, pipe)):
                net.zero_grad(set_to_none=True)
                out = run(tokens.to(devices[0]))
                (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype, device=out.device)).sum().backward()
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=1e-9, atol=1e-12, msg=f"{step} {name}")
            for net in (plain, model):
                with torch.no_grad():
                    for p in net.parameters():
                        p -= 0.1 * p.grad
        assert len(pipe.tied) == 1 and model.head.weight is model.embed.weight


class MixesTheBatch(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x - x.mean(0))


def test_a_float32_resnet_under_tf32_is_per_sample_and_one_mixing_the_batch_is_not(gpu_device):
    """cuDNN runs float32 convolutions in TF32 by default, by an algorithm picked per batch size:
    the check refused a float32 ResNet-50 (off by 0.0146 between the whole batch and its halves on
    an H200) until it ran in full precision. It must still refuse a model that mixes the batch."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=10).to(gpu_device)
    x = torch.randn(8, 3, 64, 64, device=gpu_device)
    before = torch.backends.cudnn.conv.fp32_precision
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    try:
        la.check_micro_batchable(model, (x,), {}, 0)
        with pytest.raises(la.BatchDependenceError, match="MixesTheBatch"):
            la.check_micro_batchable(MixesTheBatch(model), (x,), {}, 0)
    finally:
        torch.backends.cudnn.conv.fp32_precision = before
