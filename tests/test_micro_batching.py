"""What micro-batching may change, and the clear errors where it would change a result.

The pipeline runs forward once per micro-batch and joins the outputs on dim 0. That is exact for
per-sample outputs only; anything else must be refused, never joined silently.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lit_models import trainer
from pipelined import assert_pipelined
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la
from lightning_antichain.batches.microbatch import MicroBatchError
from lightning_antichain.capture import capture


class Net(nn.Module):
    def __init__(self, extra: str) -> None:
        super().__init__()
        self.extra = extra
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x):
        h = self.net(x)
        if self.extra == "weight":
            return h, self.net[0].weight.norm(dim=1)
        if self.extra == "sum":
            return h, (h**2).sum().reshape(1)
        if self.extra == "similarity":
            return h, h @ h.T
        return h, h.softmax(-1)


def _pipe(model, x, chunks):
    graph = capture(model, x[: len(x) // chunks])
    cost = la.profile(model, x[: len(x) // chunks], op_graph=graph, repeats=1, warmup=0, progress=False)
    return la.Pipeline(model, la.partition(cost, 2, chunks=chunks), chunks=chunks, graph=graph)


@pytest.mark.parametrize(("extra", "shapes"), [("weight", r"\[\(16,\), \(16,\)\]"), ("sum", r"\[\(1,\), \(1,\)\]")])
@pytest.mark.parametrize("grad", [True, False])
def test_an_output_that_is_not_per_sample_is_refused_not_joined(extra, shapes, grad):
    torch.manual_seed(0)
    model = Net(extra).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    with _pipe(model, x, chunks=2) as pipe, torch.set_grad_enabled(grad):
        with pytest.raises(MicroBatchError, match=rf"no dim that follows the samples: shapes {shapes} for "
                                                  r"micro-batches of \[4, 4\] samples, the same whatever the "
                                                  r"micro-batch holds.*compute the rest outside"):
            pipe(x)


def test_an_output_relating_samples_to_each_other_is_refused():
    torch.manual_seed(0)
    model = Net("similarity").double()
    x = torch.randn(8, 4, dtype=torch.float64)
    with _pipe(model, x, chunks=2) as pipe, pytest.raises(
        MicroBatchError, match=r"an output of shape \(4, 4\) grows in dims \[0, 1\].*relates samples to each other"
    ):
        pipe(x)


def test_per_sample_outputs_are_still_joined():
    torch.manual_seed(0)
    model = Net("softmax").double()
    x = torch.randn(9, 4, dtype=torch.float64)  # 3, 3, 3
    with _pipe(model, x, chunks=3) as pipe:
        for got, expected in zip(pipe(x), model(x)):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


class SequenceFirst(nn.Module):
    """``nn.GRU`` with its default ``batch_first=False``: inputs are [time, batch, features]."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        out, h_n = self.gru(x)
        return self.head(out[-1]), out, h_n


class WithLengths(SequenceFirst):
    """Time-major ``x`` and batch-major ``lengths``: a batch dim per input."""

    def forward(self, x, lengths):
        out, h_n = self.gru(x)
        return self.head(out[lengths - 1, torch.arange(out.shape[1])]), out, h_n


@pytest.mark.parametrize("batch_dim", [1, {"x": 1}])
def test_a_sequence_first_gru_is_split_on_the_batch_and_joined_per_output(batch_dim):
    torch.manual_seed(0)
    model = (SequenceFirst() if batch_dim == 1 else WithLengths()).double()
    x = torch.randn(5, 12, 8, dtype=torch.float64)  # time 5, batch 12
    call = {"x": x} if batch_dim == 1 else {"x": x, "lengths": torch.randint(1, 6, (12,))}
    example = {k: v[:, :3] if k == "x" else v[:3] for k, v in call.items()}
    graph = capture(model, example)
    cost = la.profile(model, example, op_graph=graph, repeats=1, warmup=0, progress=False)
    expected = model(**call)
    sum(t.sum() for t in expected).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with la.Pipeline(model, la.partition(cost, 2, chunks=4), chunks=4, graph=graph, batch_dim=batch_dim) as pipe:
        output = pipe(**call)
        sum(t.sum() for t in output).backward()
        assert_pipelined(pipe)
    for got, want in zip(output, expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[n], rtol=1e-10, atol=1e-14, msg=n)


def test_splitting_time_is_warned_about_and_a_bad_batch_dim_is_a_clear_error():
    model = SequenceFirst().double()
    x = torch.randn(5, 12, 8, dtype=torch.float64)
    graph = capture(model, x[:, :3])
    cost = la.profile(model, x[:, :3], op_graph=graph, repeats=1, warmup=0, progress=False)
    with pytest.warns(UserWarning, match=r"gru is sequence-first \(batch_first=False\).*pass batch_dim=1"):
        la.Pipeline(model, la.partition(cost, 2), graph=graph).close()
    with pytest.raises(ValueError, match=r"batch_dim is the dim of the inputs that holds the samples.*got -1"):
        la.Pipeline(model, la.partition(cost, 2), graph=graph, batch_dim=-1)
    with pytest.raises(ValueError, match=r"batch_dim names \['lenghts'\], but SequenceFirst.forward\(\) takes \['x'\]"):
        la.Pipeline(model, la.partition(cost, 2), graph=graph, batch_dim={"lenghts": 0})
    model = WithLengths().double()
    lengths = torch.ones(12, dtype=torch.long)
    graph = capture(model, (x[:, :3], lengths[:3]))
    cost = la.profile(model, (x[:, :3], lengths[:3]), op_graph=graph, repeats=1, warmup=0, progress=False)
    with la.Pipeline(model, la.partition(cost, 2), graph=graph, batch_dim=1) as pipe, \
            pytest.raises(MicroBatchError, match=r"batch_dim=1, but an input of shape \(12,\) has no dim 1"):
        pipe(x, lengths)


class SequenceModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = SequenceFirst()
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)[0]

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x.transpose(0, 1)), y)  # [batch, time, f] -> [time, batch, f]
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_sequence_first_gru_trains_through_the_trainer_like_plain_lightning():
    def run(devices):
        torch.manual_seed(0)
        model = SequenceModule()
        x = torch.randn(96, 6, 8, generator=torch.Generator().manual_seed(1))
        y = (x[:, -1, :3]).argmax(1)
        strategy = "auto" if devices == 1 else la.AntichainPipelineStrategy(chunks=4, batch_dim=1,
                                                                             profile_cache=False)
        t = trainer(strategy=strategy, devices=devices, max_steps=10)
        t.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
        if devices > 1:
            assert_pipelined(t)
        return model.losses

    plain = run(1)
    assert len(plain) == 10
    torch.testing.assert_close(torch.tensor(run(2)), torch.tensor(plain), rtol=1e-5, atol=0)


class ReadsBatchSize(nn.Module):
    def __init__(self, mix: bool = False) -> None:
        super().__init__()
        self.mix = mix
        self.net = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x):
        if self.mix:
            return self.net(x - x.mean(0))  # centres each sample on the batch
        return self.net(x + torch.arange(x.shape[0], dtype=x.dtype).unsqueeze(1))


class BatchDependentModule(L.LightningModule):
    def __init__(self, mix: bool) -> None:
        super().__init__()
        self.net = ReadsBatchSize(mix)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("mix", [False, True])
def test_forward_that_depends_on_the_batch_is_refused_before_training(mix):
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    model = BatchDependentModule(mix)
    before = [p.detach().clone() for p in model.parameters()]
    t = trainer(strategy=la.AntichainPipelineStrategy(chunks=4, profile_cache=False), devices=2, max_steps=2)
    with pytest.raises(la.BatchDependenceError, match=r"BatchDependentModule.forward gives a sample another output "
                                                      r"when the batch around it changes.*module=\.\.\."):
        t.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q.detach().cpu())  # refused before any step
    plain = ReadsBatchSize(mix)  # a Pipeline that captures on its first call checks too
    graph = capture(plain, x[:4], frontends=("export",))
    plan = la.partition(la.profile(plain, x[:4], op_graph=graph, progress=False), 2)
    with la.Pipeline(plain, plan, chunks=4) as pipe, pytest.raises(la.BatchDependenceError, match="ReadsBatchSize"):
        pipe(x)


def test_indexing_with_arange_over_the_batch_is_per_sample_and_passes_the_check():
    torch.manual_seed(0)
    model = WithLengths().double()
    x, lengths = torch.randn(5, 12, 8, dtype=torch.float64), torch.randint(1, 6, (12,))
    cost = la.profile(model, {"x": x[:, :3], "lengths": lengths[:3]}, progress=False)
    with la.Pipeline(model, la.partition(cost, 2, chunks=4), chunks=4, batch_dim={"x": 1}) as pipe:
        for got, want in zip(pipe(x, lengths), model(x, lengths)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_pipeline_checks_the_batch_on_its_first_call_whatever_graph_it_was_given(frontend):
    x = torch.randn(16, 16)
    model = ReadsBatchSize()
    graph = capture(model, x[:4], frontends=(frontend,))
    plan = la.partition(la.profile(model, x[:4], op_graph=graph, progress=False), 2)
    with la.Pipeline(model, plan, chunks=4, graph=graph) as pipe, pytest.raises(la.BatchDependenceError):
        pipe(x)
    with la.Pipeline(model, plan, chunks=4, graph=graph, check_batch=False) as pipe:
        assert pipe(x).shape == (16, 4)  # meant: the model is run micro-batch by micro-batch, as asked


def test_the_strategy_trains_an_intended_batch_dependence_with_check_batch_off():
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    model = BatchDependentModule(mix=True)
    before = [p.detach().clone() for p in model.parameters()]
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, check_batch=False)
    trainer(strategy=strategy, devices=2, max_steps=2).fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    assert any(not torch.equal(p, q.detach().cpu()) for p, q in zip(before, model.parameters()))


def test_the_check_leaves_every_submodule_in_its_own_mode():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model[1].eval()  # frozen statistics, a common fine-tuning set-up
    la.check_micro_batchable(model, (torch.randn(8, 4),), {}, 0)
    assert model.training and model[0].training and not model[1].training


class NotesPrecision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.seen: list[tuple[str, str]] = []

    def forward(self, x):
        self.seen.append((torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision))
        return self.linear(x)


def test_the_check_runs_float32_in_full_precision_and_gives_the_settings_back():
    """cuDNN runs float32 convolutions in TF32 by default, by an algorithm picked per batch size: the
    whole batch and its halves differ by TF32's rounding compounded over the layers, which the check
    would take for a sample depending on the batch (ResNet-50 on a GPU)."""
    model = NotesPrecision()
    before = torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    torch.backends.cudnn.conv.fp32_precision = torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        la.check_micro_batchable(model, (torch.randn(8, 4),), {}, 0)
        after = torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    finally:
        torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = before
    assert model.seen == [("ieee", "ieee")] * 4 and after == ("tf32", "tf32")


class KeepsHidden(nn.Module):
    """Sequence-first, and keeps its last output as an attribute, [time, batch, features]."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.gru(x)
        self.last = out.detach()
        return self.head(out)


@pytest.mark.parametrize("frontend", ["export", "concrete"])
def test_assigned_attributes_are_joined_on_their_batch_dim(frontend):
    torch.manual_seed(0)
    model = KeepsHidden().double()
    x = torch.randn(4, 8, 8, dtype=torch.float64)  # time 4, batch 8: micro-batches of 4 make [4, 4, 6]
    graph = capture(model, x[:, :4], frontends=(frontend,), batch_dim=1)
    plan = la.partition(la.profile(model, x[:, :4], op_graph=graph, progress=False, batch_dim=1), 2)
    with la.Pipeline(model, plan, chunks=2, graph=graph, batch_dim=1) as pipe:
        got = pipe(x)
        got_last = model.last
    want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got_last, model.last, rtol=1e-12, atol=0)


def test_export_keeps_the_given_batch_dim_symbolic():
    model = KeepsHidden()
    x = torch.randn(5, 4, 8)
    graph = capture(model, x, frontends=("export",), batch_dim=1)
    (dim, lower, _), = [r for r in graph.specialization.batch_ranges if r is not None]
    assert dim == 1 and lower <= 1
    values = graph.bind((torch.randn(5, 3, 8),), {})
    assert graph.specialization.holds_for(values)  # another batch size: the same graph
    assert not graph.specialization.holds_for(graph.bind((torch.randn(6, 4, 8),), {}))  # another length: not
    assert all(leaf.per_sample for a in graph.assignments for leaf in a.leaves if hasattr(leaf, "per_sample"))


class OptionalScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x, scale=None, double=False):
        h = self.a(x)
        if scale is not None:
            h = h * scale
        if double:
            h = h * 2
        return self.b(h)


def test_fx_takes_absent_optional_arguments_as_the_constants_they_are():
    torch.manual_seed(0)
    model = OptionalScale().double()
    x, scale = torch.randn(8, 4, dtype=torch.float64), torch.rand(8, 1, dtype=torch.float64)
    graph = capture(model, x[:4])
    assert graph.frontend == "fx"  # traced as placeholders, `scale is not None` took the wrong branch
    plan = la.partition(la.profile(model, x[:4], op_graph=graph, progress=False), 2)
    with la.Pipeline(model, plan, chunks=2, graph=graph) as pipe:
        torch.testing.assert_close(pipe(x), model(x), rtol=1e-12, atol=0)
        # another branch: another graph, captured for it, never the planned one run
        torch.testing.assert_close(pipe(x, scale), model(x, scale), rtol=1e-12, atol=0)
        assert pipe.graph is not graph and len(pipe.graph) > len(graph)
        torch.testing.assert_close(pipe(x), model(x), rtol=1e-12, atol=0)
        assert pipe.graph is graph
    graph = capture(model, {"x": x[:4], "scale": scale[:4], "double": True})
    plan = la.partition(la.profile(model, {"x": x[:4], "scale": scale[:4], "double": True}, op_graph=graph,
                                   progress=False), 2)
    with la.Pipeline(model, plan, chunks=2, graph=graph) as pipe:
        torch.testing.assert_close(pipe(x, scale, double=True), model(x, scale, double=True), rtol=1e-12, atol=0)
        torch.testing.assert_close(pipe(x, scale), model(x, scale), rtol=1e-12, atol=0)  # double=False: another
