"""Any value may cross a cut between stages as processes: zoo models cut where it is hardest.

Four models whose cuts carry what torch's stages alone cannot send, each cut where such a value
crosses, one float64 training step on 2 gloo processes under 1F1B (2 stages) and ZBV (4 stages in a
V), every gradient against the plain module's:

- an ``nn.GRU`` whose output tuple crosses a cut before its ``getitem`` (a nested value);
- ``nn.Transformer`` with its causal mask made in ``forward``, whose attention reshapes by products
  of sizes (``bsz * num_heads``: numbers crossing cuts);
- T5, an encoder-decoder whose relative-position buckets are integer tensors crossing cuts (torch's
  own shape inference runs a trial forward on uninitialised inputs, and the embedding then reads
  garbage indices);
- timm's ViT, whose attention unpacks ``B, N, C = x.shape`` (numbers again, from fx).

The values crossing each cut are found on fake tensors before the first step
(:mod:`lightning_antichain.processes.cut_values`), so the stages never run on uninitialised inputs.
"""

from __future__ import annotations

import os
import time
from queue import Empty

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from launch import free_port, process_context
from torch import nn
from zoo import ZOO, ZooEntry

pytestmark = pytest.mark.processes

CHUNKS, BATCH, RANKS = 4, 8, 2
CUTS_PER_KIND = 2  # cuts of each kind of crossing value tried, per model


class GRUTagger(nn.Module):
    """A token tagger around ``nn.GRU``: its ``(output, hidden)`` tuple is read in two places."""

    def __init__(self, vocab: int = 30, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, hidden = self.gru(self.embed(tokens))
        return self.head(out + hidden[-1].unsqueeze(1))


MODELS = {
    "gru": ZooEntry(GRUTagger, lambda n: ((torch.randint(0, 30, (n, 7)),), {}), "torch.nn"),
    "nn_transformer": ZOO["nn_transformer"],
    "hf_t5": ZOO["hf_t5"],
    "timm_vit": ZOO["timm_vit"],
}


def _floating(value):
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _double(value):
    return pytree.tree_map(lambda a: a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a, value)


def _kind(value) -> str:
    """What crosses a cut, as this test sorts cuts."""
    if isinstance(value, torch.Tensor):
        return "float tensor" if value.is_floating_point() else "integer tensor"
    if isinstance(value, (int, float, bool)):
        return "number"
    return "nested" if isinstance(value, (tuple, list, dict)) else "other"


def _cuts(graph, cost, call) -> dict[str, list[int]]:
    """For each kind of value crossing a 2-stage cut, the first few cuts (operations in the first
    stage) where one crosses."""
    import lightning_antichain as la

    values = {recorded.node.name: recorded.output for recorded in graph.record_calls(*call[0], **call[1])}
    operations = sum(1 for n in graph.nodes if n.kind != "placeholder")
    found: dict[str, list[int]] = {}
    for first in range(1, operations):
        plan = la.plan_from_balance(cost, [first, operations - first], chunks=CHUNKS)
        for kind in {_kind(values[name]) for name in plan.stages[0].outputs if name in values}:
            if len(found.setdefault(kind, [])) < CUTS_PER_KIND:
                found[kind].append(first)
    return found


def _step(model, graph, plan, schedule, rank, args, kwargs, weights):
    """One training step through this rank's stages; the error of each gradient it holds."""
    from lightning_antichain.batches import microbatch
    from lightning_antichain.processes.process_pipeline import ProcessPipeline

    pipeline = ProcessPipeline(graph, plan, schedule, rank, RANKS, torch.device("cpu"))
    calls = microbatch.scatter((args, kwargs), CHUNKS)
    parts = [[torch.tensor_split(w, CHUNKS)[m] for w in weights] for m in range(CHUNKS)]

    def loss(output, m):
        return sum((t * w).sum() for t, w in zip(_floating(output), parts[m]))

    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        pipeline.run(("shape", CHUNKS), calls if pipeline.holds_first else None, loss, CHUNKS, train=True)
    pipeline.tied.sum_gradients()
    return {id(p): p.grad.clone() for p in pipeline.parameters() if p.grad is not None and not p.is_meta}


def _worker(rank: int, port: int, names: list[str], queue) -> None:
    import lightning_antichain as la
    from lightning_antichain.batches.batch_dims import first_micro_batch
    from lightning_antichain.capture import capture_call
    from lightning_antichain.plans.process_schedules import process_schedule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        for name in names:
            torch.manual_seed(0)
            entry = MODELS[name]
            model = entry.model()
            args, kwargs = _double(entry.batch(BATCH))
            expected = model(*args, **kwargs)
            generator = torch.Generator().manual_seed(1)
            weights = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in _floating(expected)]
            sum((t * w).sum() for t, w in zip(_floating(expected), weights)).backward()
            reference = {id(p): (n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None}
            scale = max(g.abs().max().item() for _, g in reference.values())
            first = first_micro_batch(model, args, kwargs, CHUNKS, 0)
            graph = capture_call(model, *first)
            cost = la.profile(model, first[1] or first[0], op_graph=graph, repeats=1, warmup=0, progress=False)
            operations = sum(1 for n in graph.nodes if n.kind != "placeholder")
            cuts = _cuts(graph, cost, first)
            runs = [("1f1b", (c, operations - c)) for kind in sorted(cuts) for c in cuts[kind]]
            for kind in sorted(cuts):  # 4 stages in a V: a cut of that kind among three
                points = sorted({cuts[kind][0], max(1, operations // 3), max(2, 2 * operations // 3)})
                if len(points) == 3 and points[-1] < operations:
                    runs.append(("zbv", (points[0], points[1] - points[0], points[2] - points[1],
                                         operations - points[2])))
            for schedule_name, balance in dict.fromkeys(runs):
                plan = la.plan_from_balance(cost, list(balance), chunks=CHUNKS)
                grads = _step(model, graph, plan, process_schedule(schedule_name), rank, args, kwargs, weights)
                error = max((((g - reference[key][1]).abs().max().item()
                              / max(reference[key][1].abs().max().item(), 1e-6 * scale)) for key, g in grads.items()),
                            default=0.0)
                held = sorted(reference[key][0] for key in grads if key in reference)
                queue.put((rank, name, graph.frontend, sorted(cuts), schedule_name, balance, error, held,
                           sorted(n for n, _ in reference.values())))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("names", [["gru", "timm_vit"], pytest.param(["nn_transformer", "hf_t5"],
                                                                     marks=pytest.mark.slow)])
def test_values_of_any_kind_cross_process_cuts_and_train_as_the_plain_module(names):
    context = process_context()
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(rank, port, names, queue)) for rank in range(RANKS)]
    for process in processes:
        process.start()
    reports, deadline = [], time.monotonic() + 600
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        try:  # read while they run: a child cannot end before the queue takes what it put
            reports.append(queue.get(timeout=1))
        except Empty:
            pass
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
    while not queue.empty():
        reports.append(queue.get())
    errors = [r for r in reports if r[1] == "error"]
    assert not errors, errors
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    for name in names:
        mine = [r for r in reports if r[1] == name]
        kinds = mine[0][3]
        assert {"number", "nested", "integer tensor"} & set(kinds), (name, kinds)  # the hard cuts were tried
        assert {r[4] for r in mine} == {"1f1b", "zbv"}
        for rank, _, frontend, _, schedule, balance, error, _, _ in mine:
            assert error <= 1e-9, f"{name} ({frontend}) under {schedule}, balance {balance}, rank {rank}: {error:.1e}"
        for schedule, balance in {(r[4], tuple(r[5])) for r in mine}:  # every gradient, from some rank
            both = [r for r in mine if r[4] == schedule and tuple(r[5]) == balance]
            assert len(both) == RANKS and set(both[0][7]) | set(both[1][7]) == set(both[0][8]), (name, balance)
    expected_kinds = {"gru": "nested", "timm_vit": "number", "nn_transformer": "number", "hf_t5": "integer tensor"}
    for name in names:
        assert expected_kinds[name] in next(r for r in reports if r[1] == name)[3], name


def _function_worker(rank: int, port: int, queue) -> None:
    """Custom autograd Functions (tests/scripts/differential_cases.py) cut right before, right after
    and around them, under 1F1B and ZBV: each rank's gradient error against the plain module's."""
    import sys
    from pathlib import Path

    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.capture.autograd_functions import FunctionCall
    from lightning_antichain.plans.process_schedules import process_schedule

    sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
    from differential_cases import FunctionCalls

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        for function in ("reverse", "saved"):
            torch.manual_seed(0)
            model = FunctionCalls(function).double()
            x = torch.randn(BATCH, 8, dtype=torch.float64)
            expected = model(x)
            weights = [torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)]
            (expected * weights[0]).sum().backward()
            reference = {id(p): (n, p.grad.clone()) for n, p in model.named_parameters()}
            graph = capture_call(model, (x[: BATCH // CHUNKS],), {})
            cost = la.profile(model, x[: BATCH // CHUNKS], op_graph=graph, repeats=1, warmup=0, progress=False)
            operations = [n.name for n in graph.nodes if n.kind != "placeholder"]
            call = next(n for n in graph.graph_module.graph.nodes if isinstance(n.target, FunctionCall))
            at = operations.index(call.name)  # the operations before it
            runs = [("1f1b", (at, len(operations) - at)), ("1f1b", (at + 1, len(operations) - at - 1)),
                    ("zbv", (1, at - 1, 1, len(operations) - at - 1))]  # the Function alone in stage 2
            for schedule_name, balance in runs:
                plan = la.plan_from_balance(cost, list(balance), chunks=CHUNKS)
                grads = _step(model, graph, plan, process_schedule(schedule_name), rank, (x,), {}, weights)
                error = max((((g - reference[key][1]).abs().max().item() / max(reference[key][1].abs().max().item(),
                                                                               1e-12)) for key, g in grads.items()),
                            default=0.0)
                queue.put((rank, function, schedule_name, balance, error, sorted(reference[k][0] for k in grads)))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


def test_a_custom_function_cut_before_after_and_alone_trains_as_the_plain_module_in_processes():
    context = process_context()
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_function_worker, args=(rank, port, queue)) for rank in range(RANKS)]
    for process in processes:
        process.start()
    reports, deadline = [], time.monotonic() + 300
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        try:
            reports.append(queue.get(timeout=1))
        except Empty:
            pass
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
    while not queue.empty():
        reports.append(queue.get())
    assert not [r for r in reports if r[1] == "error"], reports
    assert len(reports) == 2 * 2 * 3
    for rank, function, schedule, balance, error, _ in reports:
        assert error <= 1e-9, f"{function} under {schedule}, balance {balance}, rank {rank}: {error:.1e}"
    for function in ("reverse", "saved"):  # every parameter's gradient came from some rank
        for schedule, balance in {(r[2], r[3]) for r in reports if r[1] == function}:
            held = [set(r[5]) for r in reports if r[1] == function and (r[2], r[3]) == (schedule, balance)]
            assert held[0] | held[1] == {"a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias", "gain"}
