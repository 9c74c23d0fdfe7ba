"""The pipeline runtime against the plain module: float64 parity of outputs and every gradient."""

import copy
import signal
import threading
from collections import Counter

import pytest
import torch
import torchvision
from models import FAIL, DictInTupleOut, Explosive, InceptionBlock, LongSkip, SequentialCNN
from pipelined import assert_pipelined
from torch import nn

import lightning_antichain as la


def frozen_norms(model):
    """BatchNorm in eval mode: per-sample maths, so micro-batching cannot change the result."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()
    return model


CASES = {
    "sequential_cnn": (lambda: SequentialCNN(), lambda n: (torch.randn(n, 3, 8, 8),), {}),
    "resnet18": (
        lambda: frozen_norms(torchvision.models.resnet18(num_classes=7)),
        lambda n: (torch.randn(n, 3, 32, 32),),
        {},
    ),
    "long_skip": (lambda: LongSkip(), lambda n: (torch.randn(n, 12),), {}),
    "inception_block": (lambda: InceptionBlock(), lambda n: (torch.randn(n, 6, 8, 8),), {}),
    "dict_in_tuple_out": (lambda: DictInTupleOut(), lambda n: (), {"image": None, "meta": None}),
}


def make_inputs(name, n, dtype=torch.float64):
    _, args_fn, kw = CASES[name]
    if name == "dict_in_tuple_out":
        return (), {
            "image": torch.randn(n, 10, dtype=dtype),
            "meta": torch.randn(n, 3, dtype=dtype),
            "scale": 0.5,
        }
    return tuple(a.to(dtype) for a in args_fn(n)), {}


def loss_of(output, weights=None):
    """A loss that weighs every output element differently, so every gradient is distinct."""
    leaves = [t for t in _flat(output) if t.is_floating_point()]
    gen = torch.Generator().manual_seed(1)
    return sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in leaves)


def _flat(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return []


def max_relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


_plans = {}


def plan_for(name, model, stages):
    key = (name, stages)
    if key not in _plans:
        args, kwargs = make_inputs(name, 2, torch.float32)
        example = kwargs if kwargs else args
        if kwargs:
            example = {k: v for k, v in kwargs.items()}
        cost = la.profile(model.float(), example if kwargs else args, repeats=1, warmup=0, progress=False)
        model.double()
        _plans[key] = la.partition(cost, stages)
    return _plans[key]


def check_parity(name, stages, chunks, recompute="never", batch=10, input_grad=False, plan=None):
    torch.manual_seed(0)
    model = CASES[name][0]()
    plan = plan or plan_for(name, model, stages)
    model.double()
    args, kwargs = make_inputs(name, batch)
    if input_grad:
        args = tuple(a.requires_grad_() for a in args)
    model.zero_grad(set_to_none=True)
    expected = model(*args, **kwargs)
    loss_of(expected).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    input_reference = [a.grad.clone() for a in args] if input_grad else []
    model.zero_grad(set_to_none=True)
    for a in args:
        a.grad = None

    pipe = la.Pipeline(model, plan, chunks=chunks, recompute=recompute)
    output = pipe(*args, **kwargs)
    for got, want in zip(_flat(output), _flat(expected)):
        assert got.shape == want.shape
        assert max_relative_error(got, want.detach()) <= 1e-12
    loss_of(output).backward()
    assert {stage for stage, _ in assert_pipelined(pipe, stages=plan.num_stages)} == set(range(plan.num_stages))
    for n, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {n}"
        assert max_relative_error(p.grad, reference[n]) <= 1e-9, n
    for a, g in zip(args, input_reference):
        assert max_relative_error(a.grad, g) <= 1e-9
    return plan


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_float64_parity(name, stages, chunks):
    plan = check_parity(name, stages, chunks)
    assert plan.num_stages == stages


@pytest.mark.slow  # 13 s; the zoo's Trainer test runs DenseNet-121 through the pipeline in the default suite
def test_densenet121_parity_on_a_small_input():
    model = frozen_norms(torchvision.models.densenet121(num_classes=5))
    CASES["densenet121"] = (lambda: model, lambda n: (torch.randn(n, 3, 32, 32),), {})
    try:
        for stages, chunks in ((1, 3), (2, 8), (3, 1), (4, 3)):  # each count of stages and of chunks once
            check_parity("densenet121", stages, chunks, batch=10)
    finally:
        del CASES["densenet121"]


@pytest.mark.parametrize("balance", [[2, 6, 4], [2, 4, 2, 4]])
def test_long_skip_really_spans_stages(balance):
    # A fixed split, so the skip's span does not depend on profiling noise.
    cost = la.profile(LongSkip(), torch.randn(2, 12), repeats=1, warmup=0, progress=False)
    plan = check_parity("long_skip", len(balance), 3, plan=la.plan_from_balance(cost, balance))
    stage_of = plan.stage_of()
    assert stage_of["add"] - stage_of["tanh"] >= 2  # the skip tensor crosses at least one whole stage
    middle = plan.stages[stage_of["tanh"] + 1]
    assert "tanh" in middle.inputs and "tanh" in middle.outputs  # relayed through it


@pytest.mark.parametrize("recompute", ["except_last", "always"])
@pytest.mark.parametrize("name", ["sequential_cnn", "resnet18", "long_skip"])
def test_recompute_modes_give_the_same_gradients(name, recompute):
    check_parity(name, 3, 4, recompute=recompute, input_grad=True)


def test_input_gradients_flow_back():
    check_parity("long_skip", 3, 3, input_grad=True)


def test_no_grad_runs_forward_only():
    torch.manual_seed(0)
    model = SequentialCNN().double()
    pipe = la.Pipeline(model, plan_for("sequential_cnn", model, 3), chunks=4)
    x = torch.randn(7, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad
    assert max_relative_error(out, model(x).detach()) <= 1e-12


def test_state_dict_is_the_original_modules():
    model = SequentialCNN()
    keys = list(model.state_dict())
    pipe = la.Pipeline(model, plan_for("sequential_cnn", model, 3), chunks=2)
    assert list(model.state_dict()) == keys
    assert [k.removeprefix("module.") for k in pipe.state_dict()] == keys
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}


def test_fewer_samples_than_chunks_runs_fewer_micro_batches():
    check_parity("sequential_cnn", 2, 8, batch=3)


def stage_threads():
    return [t for t in threading.enumerate() if t.name.startswith("antichain-stage") and t.is_alive()]


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_failing_stage_names_itself_and_the_next_step_works(phase):
    torch.manual_seed(0)
    model = Explosive()
    cost = la.profile(model, torch.randn(2, 4), repeats=1, warmup=0, progress=False)
    plan = la.partition(cost, 3)
    pipe = la.Pipeline(model, plan, chunks=4)
    failing_stage = plan.stage_of()["fuse"]
    x = torch.randn(8, 4)
    others = set(stage_threads())  # other tests' pipelines, not yet collected
    FAIL[phase] = True
    try:
        with pytest.raises(RuntimeError if phase == "forward" else ValueError, match="fuse blew") as info:
            pipe(x).sum().backward()
    finally:
        FAIL[phase] = False
    notes = "".join(getattr(info.value, "__notes__", [])) or str(info.value)
    assert f"stage {failing_stage}" in notes and "micro-batch" in notes and phase in notes
    assert set(stage_threads()) - others == set()
    model.zero_grad()
    pipe(x).sum().backward()
    plain = Explosive()
    plain.load_state_dict(model.state_dict())
    plain(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert len(set(stage_threads()) - others) == 3  # workers stay warm between steps ...
    pipe.close()
    assert set(stage_threads()) - others == set()  # ... until the pipeline is closed


def test_untraceable_model_cannot_be_pipelined_with_a_clear_error():
    from test_trace import DataDependent

    model = DataDependent()
    cost = la.profile(model, torch.randn(2, 3, 8, 8), progress=False)
    with pytest.raises(la.UntraceableModelError, match="control flow"):
        la.Pipeline(model, la.partition(cost, 2))


def test_plan_for_another_model_is_rejected():
    cost = la.profile(LongSkip(), torch.randn(2, 12), repeats=1, warmup=0, progress=False)
    with pytest.raises(ValueError, match="does not match this model"):
        la.Pipeline(SequentialCNN(), la.partition(cost, 2))


def test_keyboard_interrupt_leaves_no_thread_running():
    model = Explosive()
    cost = la.profile(model, torch.randn(2, 4), repeats=1, warmup=0, progress=False)
    pipe = la.Pipeline(model, la.partition(cost, 3), chunks=4)
    pipe(torch.randn(8, 4)).sum().backward()
    workers = list(pipe._pool._threads)
    FAIL["interrupt"] = True
    # Ctrl-C must raise here, whatever earlier code in this process did to SIGINT (Lightning's
    # Trainer ignores it for good once it has handled one)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            pipe(torch.randn(8, 4))
    finally:
        FAIL["interrupt"] = False
        signal.signal(signal.SIGINT, before)
    assert len(workers) == 3 and not any(t.is_alive() for t in workers)
    pipe(torch.randn(8, 4)).sum().backward()
    workers = list(pipe._pool._threads)
    pipe.close()
    assert not any(t.is_alive() for t in workers)


def test_workers_stop_when_the_pipeline_is_collected():
    import gc

    model = LongSkip()
    cost = la.profile(model, torch.randn(2, 12), repeats=1, warmup=0, progress=False)
    pipe = la.Pipeline(model, la.partition(cost, 2), chunks=2)
    pipe(torch.randn(4, 12)).sum().backward()
    workers = list(pipe._pool._threads)
    assert len(workers) == 2 and all(t.is_alive() for t in workers)
    del pipe
    gc.collect()
    assert not any(t.is_alive() for t in workers)


def test_recompute_does_not_update_batchnorm_statistics_twice():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
    cost = la.profile(model, torch.randn(2, 3, 8, 8), repeats=1, warmup=0, progress=False)
    plan = la.partition(cost, 2)
    x = torch.randn(8, 3, 8, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    stats = {}
    for mode in ("never", "always"):
        model.load_state_dict(state)
        la.Pipeline(model, plan, chunks=4, recompute=mode)(x).sum().backward()
        stats[mode] = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    for key, value in stats["never"].items():
        assert torch.equal(value, stats["always"][key]), key
    assert stats["never"]["1.num_batches_tracked"].item() == 4  # one update per micro-batch


@pytest.mark.parametrize("momentum", [0.1, None])
def test_deferred_batch_norm_stores_whole_batch_statistics(momentum):
    # One BatchNorm: the statistics of a later one would see micro-batch-normalised inputs.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Tanh()
    )
    cost = la.profile(model, torch.randn(2, 3, 8, 8), repeats=1, warmup=0, progress=False)
    model.double()
    plan = la.partition(cost, 2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(10, 3, 8, 8, dtype=torch.float64)
    for _ in range(2):
        model(x)  # the plain module on the whole batch, twice
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for recompute in ("never", "always"):
        model.load_state_dict(state)
        pipe = la.Pipeline(model, plan, chunks=3, deferred_batch_norm=True, recompute=recompute)
        for _ in range(2):
            pipe(x).sum().backward()
        for key in ("1.running_mean", "1.running_var"):
            assert max_relative_error(model.state_dict()[key], expected[key]) <= 1e-12, (recompute, key)
        assert model.state_dict()["1.num_batches_tracked"].item() == 2
        assert "forward" not in vars(model[1])  # nothing left patched
    model.load_state_dict(state)
    la.Pipeline(model, plan, chunks=3)(x).sum().backward()
    assert model.state_dict()["1.num_batches_tracked"].item() == 3  # without deferral: once per micro-batch


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("own_devices", [False, True])
def test_tied_parameters_shared_by_first_and_last_stage(stages, own_devices):
    """The embedding is also the output layer's weight, read by the first and the last stage. On
    one device the stages share it; on devices of their own (``device_slots``: what CPU devices
    stand for, and what GPUs are) each device reads a leaf of its own, and the gradients of both
    reach the parameter: two steps of SGD equal plain training's, and the copy follows the step."""
    from models import TiedEmbedding

    torch.manual_seed(0)
    model = TiedEmbedding()
    tokens = torch.randint(0, 40, (10, 7))
    cost = la.profile(model, tokens[:2], repeats=1, warmup=0, progress=False)
    plan = la.partition(cost, stages)
    stage_of = plan.stage_of()
    assert stage_of["embed"] == 0 and stage_of["head"] == stages - 1  # the tie really spans stages
    model.double()
    plain = copy.deepcopy(model)
    slots = tuple(range(stages)) if own_devices else None
    with la.Pipeline(model, plan, chunks=4, device_slots=slots) as pipe:
        for step in range(2):
            for net, run in ((plain, plain), (model, pipe)):
                net.zero_grad(set_to_none=True)
                loss_of(run(tokens)).backward()
            for (n, p), q in zip(model.named_parameters(), plain.parameters()):
                assert max_relative_error(p.grad, q.grad) <= 1e-9, (step, n)
            for net in (plain, model):
                with torch.no_grad():
                    for p in net.parameters():
                        p -= 0.1 * p.grad
        assert len(pipe.tied) == (1 if own_devices else 0)
        assert model.head.weight is model.embed.weight  # the user's model stays tied
        leaves = pipe.tied.leaves()
        assert len(leaves) == (2 if own_devices else 0)
        assert all(leaf.grad is None for leaf in leaves)  # every gradient went to the parameter
    if own_devices:  # the last stage's leaf is a copy: it took the second step's values before the third forward
        assert not torch.equal(leaves[-1], model.embed.weight)
        pipe(tokens)
        assert torch.equal(leaves[-1], model.embed.weight) and leaves[-1].data_ptr() != model.embed.weight.data_ptr()
        assert leaves[0].data_ptr() == model.embed.weight.data_ptr()  # on the parameter's own device: no copy


def test_a_task_that_raises_reaches_the_caller_and_leaves_its_worker_serving():
    from lightning_antichain.in_process.worker import WorkerPool

    pool = WorkerPool(2, name="raising")
    ran = []

    def fails():
        raise RuntimeError("boom")

    try:
        with pytest.raises(RuntimeError, match="boom"):
            pool.run([fails, lambda: ran.append(1)], lambda: None)
        pool.run([lambda: ran.append(2), lambda: ran.append(3)], lambda: None)  # hung before: worker 0 was gone
        assert sorted(ran) == [1, 2, 3]
    finally:
        pool.shutdown()


def test_the_evidence_of_a_pipelined_run_counts_each_stage_on_its_own_worker():
    torch.manual_seed(0)
    model = LongSkip().double()
    x = torch.randn(8, 12, dtype=torch.float64)
    cost = la.profile(model, x[:2], repeats=1, warmup=0, progress=False)
    with la.Pipeline(model, la.partition(cost, 3, chunks=4), chunks=4) as pipe:
        assert not pipe.tasks_run
        pipe(x).sum().backward()  # the first call also checks the batch, with a forward of its own
        first = assert_pipelined(pipe)
        pipe(x).sum().backward()
        tasks = assert_pipelined(pipe, since=first)
    # 4 forwards and 4 backwards per stage, each stage always on the same worker, one worker per stage
    assert sorted(tasks.values()) == [8, 8, 8]
    assert len({thread for _, thread in tasks}) == 3
    with pytest.raises(AssertionError, match="did not run"):
        assert_pipelined(Counter({(0, 1): 8}))  # what a plain module would leave: no stage tasks at all
    with pytest.raises(AssertionError, match="thread"):
        assert_pipelined(Counter({(0, 1): 8, (1, 1): 8}))
    with pytest.raises(AssertionError, match="calling thread"):
        assert_pipelined(Counter({(0, 1): 8, (1, threading.get_ident()): 8}))


def test_batch_norm_trains_when_the_output_needs_a_grown_run_to_find_its_batch_dim():
    """An output of 4 features from micro-batches of 4 samples: the pipeline runs the stages once
    more, on a grown micro-batch, to tell the batch dim, and undoes that run's BatchNorm updates.
    Putting the running statistics back must not count as changing what the step's backward saved."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4)).double()
    plain = copy.deepcopy(model)
    x = torch.randn(16, 16, dtype=torch.float64)
    cost = la.profile(model, x[:4], progress=False, repeats=1, warmup=0)
    with la.Pipeline(model, la.partition(cost, 2, chunks=4), chunks=4) as pipe:
        pipe(x).sum().backward()
    for chunk in x.chunk(4):  # what micro-batching does to BatchNorm: statistics per micro-batch
        plain(chunk).sum().backward()
    torch.testing.assert_close(model[1].running_mean, plain[1].running_mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad, rtol=1e-9, atol=1e-12)
