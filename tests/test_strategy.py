"""AntichainPipelineStrategy in the real Lightning Trainer, against plain single-device training."""

import re
import warnings

import pytest
import torch
from lit_models import TinyClassifier, first_of_two_epochs, loader, trainer
from pipelined import assert_pipelined
from torch import nn

import lightning_antichain as la


def strategy(**kwargs):
    return la.AntichainPipelineStrategy(**{"chunks": 4, "profile_cache": False, **kwargs})


def fit(model, strategy_arg="auto", devices=1, **kwargs):
    torch.manual_seed(0)
    t = trainer(strategy=strategy_arg, devices=devices, **kwargs)
    t.fit(model, loader(), loader(64, seed=1))
    return t


@pytest.fixture(scope="module")
def plain_run():
    torch.manual_seed(0)
    model = TinyClassifier()
    t = fit(model, max_steps=20, val_check_interval=10, limit_val_batches=4)
    return model.losses, t.callback_metrics["val_acc"].item()


@pytest.mark.parametrize("devices", [2, 4])
def test_losses_and_accuracy_match_plain_training(plain_run, devices):
    torch.manual_seed(0)
    model = TinyClassifier()
    t = fit(model, strategy(), devices, max_steps=20, val_check_interval=10, limit_val_batches=4)
    losses, accuracy = plain_run
    assert len(model.losses) == 20
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert t.callback_metrics["val_acc"].item() == accuracy
    assert t.strategy.plan.num_stages == devices
    assert {stage for stage, _ in assert_pipelined(t)} == set(range(devices))


def test_registered_name_and_trainer_flags():
    torch.manual_seed(0)
    t = trainer(strategy="antichain_pipeline", devices=2, max_steps=2)
    assert isinstance(t.strategy, la.AntichainPipelineStrategy)
    assert t.num_devices == 2 and t.world_size == 1 and t.global_rank == 0
    t.fit(TinyClassifier(), loader())


def test_validate_test_predict_return_what_they_return_without_it():
    torch.manual_seed(0)
    model = TinyClassifier()
    plain = trainer(devices=1)
    piped = trainer(devices=2, strategy=strategy())
    assert piped.validate(model, loader(64)) == plain.validate(model, loader(64))
    assert piped.test(model, loader(64)) == plain.test(model, loader(64))
    a, b = piped.predict(model, loader(64)), plain.predict(model, loader(64))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_checkpoint_from_four_devices_resumes_on_two_and_without_the_strategy(tmp_path):
    steps = 5  # one epoch: 80 samples in batches of 16
    path = tmp_path / "four.ckpt"
    uninterrupted, _ = first_of_two_epochs(strategy(), 4, path)
    saved = torch.load(path, weights_only=True)
    assert list(saved["state_dict"]) == list(TinyClassifier().state_dict())
    assert all(v.device.type == "cpu" for v in saved["state_dict"].values())
    assert saved["antichain_pipeline"]["plan"]["stages"] and len(saved["antichain_pipeline"]["devices"]) == 4

    for devices, strategy_arg in [(2, strategy()), (1, "auto")]:
        resumed = TinyClassifier()
        torch.manual_seed(0)
        trainer(devices=devices, strategy=strategy_arg, max_epochs=2).fit(resumed, loader(80), ckpt_path=path)
        torch.testing.assert_close(
            torch.tensor(resumed.losses), torch.tensor(uninterrupted.losses[steps:]), rtol=1e-5, atol=0
        )
    plain = TinyClassifier.load_from_checkpoint(path)  # plain Lightning, no strategy
    assert torch.equal(plain.net[0].weight, saved["state_dict"]["net.0.weight"])


class ManualTwoOptimizers(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(first, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        first.step()
        second.step()

    def configure_optimizers(self):
        head = list(self.net[4:].parameters())
        body = list(self.net[:4].parameters())
        return torch.optim.SGD(body, lr=0.1), torch.optim.Adam(head, lr=1e-2)


@pytest.mark.parametrize(
    "make, flags",
    [
        (TinyClassifier, {"gradient_clip_val": 0.3, "accumulate_grad_batches": 2}),
        (ManualTwoOptimizers, {}),
    ],
    ids=["clip-and-accumulate", "manual-two-optimizers"],
)
def test_optimization_features_match_plain(make, flags):
    runs = []
    for strategy_arg, devices in [("auto", 1), (strategy(), 3)]:
        torch.manual_seed(0)
        model = make()
        t = fit(model, strategy_arg, devices, max_steps=8, limit_val_batches=0, **flags)
        runs.append(model.losses)
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=1e-5, atol=0)
    assert_pipelined(t)
    assert t.strategy.plan.accumulate_grad_batches == flags.get("accumulate_grad_batches", 1)


def test_bf16_mixed_on_cpu_trains_like_plain_bf16():
    runs = []
    for strategy_arg, devices in [("auto", 1), (strategy(), 2)]:
        torch.manual_seed(0)
        model = TinyClassifier()
        t = fit(model, strategy_arg, devices, max_steps=10, limit_val_batches=0, precision="bf16-mixed")
        runs.append(torch.tensor(model.losses))
    torch.testing.assert_close(runs[1], runs[0], rtol=2e-2, atol=1e-2)
    assert_pipelined(t)
    assert runs[1][-1] < runs[1][0]


@pytest.mark.parametrize("recompute", ["except_last", "always"])
def test_bf16_mixed_with_recomputation_trains_as_without_it(recompute):
    """The recomputed forward runs under the forward's autocast, though backward runs outside it."""
    runs = []
    for mode in ("never", recompute):
        torch.manual_seed(0)
        model = TinyClassifier()
        t = fit(model, strategy(recompute=mode, calibrate=False), 2, max_steps=6, limit_val_batches=0,
                precision="bf16-mixed")
        assert_pipelined(t)
        runs.append(torch.tensor(model.losses))
    assert len(runs[1]) == 6
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


def test_fixed_balance_and_saved_plan_skip_planning(tmp_path):
    t = fit(TinyClassifier(), strategy(balance=[3, 4]), 2, max_steps=2, limit_val_batches=0)
    assert t.strategy.plan.method == "balance" and t.strategy.plan.balance == [4, 4]  # input pinned in 0
    path = tmp_path / "plan.json"
    t.strategy.plan.save(path)
    t2 = fit(TinyClassifier(), strategy(plan=str(path)), 2, max_steps=2, limit_val_batches=0)
    assert [s.nodes for s in t2.strategy.plan.stages] == [s.nodes for s in t.strategy.plan.stages]


def test_profile_cache_skips_profiling_the_second_time(tmp_path, capsys):
    for _ in range(2):
        fit(
            TinyClassifier(),
            strategy(profile_cache=str(tmp_path)),
            2,
            max_steps=1,
            limit_val_batches=0,
        )
    assert len(list(tmp_path.glob("profile-*.json"))) == 1
    assert capsys.readouterr().err.count("profiling TinyClassifier: ") == 1  # profiled once, not twice


def test_more_stages_than_devices_is_a_clear_error():
    with pytest.raises(ValueError, match="3 stages but the Trainer gives 2 devices"):
        fit(TinyClassifier(), strategy(balance=[2, 2, 3]), 2, max_steps=1)


def test_chunks_larger_than_the_batch_is_a_clear_error():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="chunks=32 is larger than the batch of 16 samples"):
        fit(TinyClassifier(), strategy(chunks=32), 2, max_steps=1, limit_val_batches=0)


class Untraceable(TinyClassifier):
    def forward(self, x):
        if x.sum() > 0:
            return self.net(x)
        return -self.net(x)


def test_untraceable_model_is_a_clear_error():
    with pytest.raises(la.UntraceableModelError, match="control flow") as info:
        fit(Untraceable(), strategy(), 2, max_steps=1, limit_val_batches=0)
    message = str(info.value)
    assert "leaf_modules=" in message and "module=" in message
    assert "fallback" not in message  # the strategy has no such option


class Asserting(TinyClassifier):
    def forward(self, x):
        assert x.dim() == 2, "expected [batch, features]"
        return self.net(x)


def test_an_assert_that_fx_cannot_trace_points_to_torch_assert():
    from lightning_antichain.capture import capture

    with pytest.raises(la.UntraceableModelError, match=r"fx: .*assert x.dim\(\) == 2.*torch._assert\(condition"):
        capture(Asserting(), frontends=("fx",))
    assert capture(Asserting(), torch.randn(2, 16)).frontend == "export"  # the chain takes it anyway


class CallsSubmodule(TinyClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)  # never calls self(x)
        self.losses.append(loss.item())
        return loss


def test_a_step_that_never_calls_the_pipelined_module_is_a_clear_error():
    with pytest.raises(RuntimeError, match="never called the pipelined module"):
        fit(CallsSubmodule(), strategy(), 2, max_steps=1, limit_val_batches=0)
    model = CallsSubmodule()
    t = fit(model, strategy(module="net"), 2, max_steps=3, limit_val_batches=0)
    assert t.strategy.plan.num_stages == 2 and len(model.losses) == 3


def test_devices_not_a_multiple_of_stages_is_a_clear_error():
    with pytest.raises(ValueError, match="devices=3 is not a multiple of pipeline_parallel_size=2"):
        fit(TinyClassifier(), strategy(pipeline_parallel_size=2), 3, max_steps=1)


class WithExample(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.example_input_array = torch.randn(2, 16)


def test_example_input_array_is_profiled_in_setup_and_the_summary_runs_through_the_pipeline(plain_run):
    torch.manual_seed(0)
    model = WithExample()
    t = trainer(
        devices=2,
        strategy=strategy(),
        max_steps=20,
        val_check_interval=10,
        limit_val_batches=4,
        enable_model_summary=True,
    )
    t.fit(model, loader(), loader(64, seed=1))
    # the example (2 samples) was planned in setup, so the summary ran through a pipeline; training's
    # micro-batches (16 / 4 chunks) were then planned again
    assert t.strategy.plan.micro_batch_size == 4
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(plain_run[0]), rtol=1e-5, atol=0)
    assert "forward" not in vars(model)  # the pipelined forward is gone after teardown


def test_stage_busy_times_are_measured_and_logged(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    t = trainer(
        devices=2,
        strategy=strategy(log_stage_times=True),
        max_steps=4,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
    )
    t.fit(TinyClassifier(), loader())
    text = next(tmp_path.rglob("metrics.csv")).read_text()
    header = text.splitlines()[0]
    assert "pipeline/stage0_busy_ms" in header and "pipeline/stage1_busy_ms" in header
    values = [
        float(v)
        for line in text.splitlines()[1:]
        for v in line.split(",")[header.split(",").index("pipeline/stage0_busy_ms")].split()
        if v
    ]
    assert values and all(v > 0 for v in values)


class MixedArguments(TinyClassifier):
    def forward(self, x, scale=None):
        return self.net(x) * scale

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x, scale=torch.full((x.shape[0], 1), 0.5)), y)
        self.losses.append(loss.item())
        return loss


def test_positional_and_keyword_arguments_together():
    runs = []
    for strategy_arg, devices in [("auto", 1), (strategy(), 2)]:
        torch.manual_seed(0)
        model = MixedArguments()
        t = fit(model, strategy_arg, devices, max_steps=3, limit_val_batches=0)
        runs.append(torch.tensor(model.losses))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=0)
    assert_pipelined(t)


def _drop_a_node(data):
    data["nodes"] = [n for n in data["nodes"] if n["name"] != data["edges"][-1][1]]


def _rename_a_node(data):
    old = data["nodes"][-1]["name"]
    data["nodes"][-1]["name"] = "renamed"
    data["edges"] = [[u, "renamed" if v == old else v, b] for u, v, b in data["edges"]]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_drop_a_node, "only named by its edges"),
        (_rename_a_node, "operations differ from the model's"),
        (lambda d: d["nodes"][1].update(forward_s="fast"), "cannot be read"),
        (lambda d: d["nodes"][1].update(backward_s=None), "cannot be read"),
        (lambda d: d["nodes"][1].pop("output_bytes"), "output_bytes = None, not a non-negative number"),
        (lambda d: d["edges"].pop(), "dependencies differ"),
        (lambda d: d.update(nodes=[]), "only named by its edges"),
        (lambda d: "null", "cannot be read"),
    ],
)
def test_a_damaged_profile_cache_entry_is_ignored_with_a_warning_and_rewritten(tmp_path, damage, reason):
    import json

    def run():
        return fit(TinyClassifier(), strategy(profile_cache=str(tmp_path)), 2, max_steps=1,
                   limit_val_batches=0)

    run()
    (entry,) = tmp_path.glob("profile-*.json")
    data = json.loads(entry.read_text())
    replaced = damage(data)
    entry.write_text(replaced if isinstance(replaced, str) else json.dumps(data))
    with pytest.warns(UserWarning, match=f"ignoring the cached profile {re.escape(str(entry))}: .*{reason}"):
        assert run().strategy.plan.num_stages == 2
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lightning-antichain")  # rewritten: taken without a word
        run()


@pytest.mark.parametrize("chunks", [2.5, True, 0, "4"])
def test_chunks_that_are_not_a_count_are_a_clear_error(chunks):
    with pytest.raises(ValueError, match=f"chunks is the number of micro-batches per batch, a whole number of at "
                                         f"least 1, or \"auto\" to let the planner choose; "
                                         f"got {re.escape(repr(chunks))}"):
        la.AntichainPipelineStrategy(chunks=chunks)
    with pytest.raises(ValueError, match="chunks is the number of micro-batches"):
        la.Pipeline(nn.Linear(2, 2), la.partition(la.profile(nn.Linear(2, 2), torch.randn(2, 2), progress=False), 1),
                    chunks=chunks)


@pytest.mark.parametrize("balance", [[], [0, 3], [2.5, 1]])
def test_a_balance_that_is_not_counts_per_stage_is_a_clear_error(balance):
    with pytest.raises(ValueError, match=r"balance lists how many operations each stage runs: one positive whole "
                                         r"number per stage, got .*Leave it out to let the planner choose"):
        la.AntichainPipelineStrategy(balance=balance)


def test_a_plan_file_that_is_not_json_names_the_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("stage 0: net.0 .. net.3\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))} is not a plan saved by Plan.save.*JSONDecodeError"):
        fit(TinyClassifier(), strategy(plan=str(path)), 2, max_steps=1)


def test_an_empty_first_batch_says_so_instead_of_asking_for_fewer_chunks():
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    batches = [[], list(range(16)), list(range(16, 32))]

    def collate(items):
        if not items:
            return torch.empty(0, 16), torch.empty(0, dtype=torch.long)
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

    empty_first = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_sampler=batches,
                                              collate_fn=collate)
    with pytest.raises(ValueError, match=r"the first training batch is empty \(0 samples\). Check the DataLoader"):
        trainer(strategy=strategy(), devices=2, max_steps=2, limit_val_batches=0).fit(TinyClassifier(), empty_first)


def test_fit_one_model_then_validate_another_plans_the_other():
    torch.manual_seed(0)
    first, second = TinyClassifier(), TinyClassifier()
    second.net = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    expected = trainer(devices=1).validate(second, loader(seed=1), verbose=False)
    t = trainer(strategy=strategy(), devices=2, max_steps=2)
    t.fit(first, loader())  # no validation loader: the first model is never validated
    first_plan = t.strategy.plan
    result = t.validate(second, loader(seed=1), verbose=False)
    assert t.strategy.plan is not first_plan and t.strategy.plan.num_stages == 2
    assert {n for s in t.strategy.plan.stages for n in s.nodes} >= {"net_0", "net_1", "net_2"}
    torch.testing.assert_close(result[0]["val_loss"], expected[0]["val_loss"], rtol=1e-5, atol=0)


class OneSampleExample(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.example_input_array = torch.randn(1, 16)


@pytest.mark.parametrize("first", ["example", "sanity_check"])
def test_the_plan_is_made_for_the_micro_batch_training_runs(first, caplog):
    model = OneSampleExample() if first == "example" else TinyClassifier()
    t = trainer(strategy=strategy(chunks=2), devices=2, max_steps=2, num_sanity_val_steps=1)
    t.fit(model, loader(64, batch_size=64), loader(8, batch_size=8))  # validation batches of 8 come first
    assert t.strategy.plan.micro_batch_size == 32
    assert "2 micro-batches of 32" in t.strategy.plan.table()
    assert "the plan was made for micro-batches of " in caplog.text
    assert "training runs micro-batches of 32; profiling and planning again" in caplog.text
