"""The ``lightning-antichain plan`` command, run as a user runs it: a real subprocess.

Checks of the command's own messages call its ``main`` in this process instead (``run_main``):
the same code from argument parsing to the exit status, without paying for a fresh interpreter
importing torch and Lightning each time.
"""

import contextlib
import io
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest


def run_cli(*args, check=True):
    exe = shutil.which("lightning-antichain")
    command = [exe] if exe else [sys.executable, "-m", "lightning_antichain"]
    result = subprocess.run(command + list(args), capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def run_main(*args):
    """``lightning-antichain ARGS`` through its ``main`` in this process: returncode, stdout, stderr."""
    from lightning_antichain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_a_user_error_from_the_installed_command_is_status_2_on_stderr():
    result = run_cli("plan", "no.such.module", "--stages", "2", "--input-shape", "3,8,8", check=False)
    assert result.returncode == 2
    assert "cannot import" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # 34 s; the command's other tests stay in the default suite
def test_issue_command_prints_the_plan_as_json(tmp_path):
    output = tmp_path / "plan.json"
    result = run_cli(
        "plan",
        "torchvision.models.resnet50",
        "--model-kwargs",
        '{"num_classes": 10}',
        "--stages",
        "4",
        "--input-shape",
        "3,32,32",
        "--batch-size",
        "32",
        "--chunks",
        "4",
        "--json",
        "--output",
        str(output),
    )
    plan = json.loads(result.stdout)
    assert len(plan["stages"]) == 4
    for stage in plan["stages"]:
        assert {"nodes", "compute_s", "transfer_s", "memory_bytes"} <= set(stage)
    for key in ("bottleneck_s", "lower_bound_s", "solve_s", "profile_s", "num_states"):
        assert plan[key] > 0
    assert plan["bottleneck_s"] >= plan["lower_bound_s"]
    assert json.loads(output.read_text())["stages"] == plan["stages"]
    assert "profiling" in result.stderr  # progress is shown, on stderr


def test_table_and_saved_profile(tmp_path):
    profile = tmp_path / "cost.json"
    first = run_cli(
        "plan",
        "torchvision.models.squeezenet1_0",
        "--model-kwargs",
        '{"num_classes": 10}',
        "--stages",
        "2",
        "--input-shape",
        "3,32,32",
        "--batch-size",
        "8",
        "--chunks",
        "2",
        "--save-profile",
        str(profile),
        "--quiet",
        "--no-calibrate",
    )
    assert "stage" in first.stdout and "bottleneck" in first.stdout
    again = run_main(  # the saved profile, read back (the command's own process is the first call's)
        "plan", "torchvision.models.squeezenet1_0", "--stages", "3", "--chunks", "2", "--load-profile", str(profile),
        "--json"
    )
    assert len(json.loads(again.stdout)["stages"]) == 3
    assert again.stderr == ""  # no profiling the second time


@pytest.mark.slow  # the plan's path is the table's (test_table_and_saved_profile); this adds matplotlib's drawing
def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    picture = tmp_path / "plan.png"
    run_cli(
        "plan",
        "torchvision.models.squeezenet1_0",
        "--model-kwargs",
        '{"num_classes": 10}',
        "--stages",
        "3",
        "--input-shape",
        "3,32,32",
        "--batch-size",
        "8",
        "--chunks",
        "4",
        "--quiet",
        "--no-calibrate",
        "--plot",
        str(picture),
    )
    data = picture.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.mark.parametrize(
    "args, message",
    [
        (["no.such.module", "--stages", "2", "--input-shape", "3,8,8"], "cannot import"),
        (["torchvision.models.resnet18", "--stages", "2", "--input-shape", "3,x,8"], "comma-separated"),
        (
            [
                "torchvision.models.resnet18",
                "--stages",
                "2",
                "--input-shape",
                "3,32,32",
                "--batch-size",
                "2",
                "--chunks",
                "4",
            ],
            "smaller than --chunks",
        ),
        (
            [
                "torchvision.models.squeezenet1_0",
                "--stages",
                "2",
                "--input-shape",
                "3,32,32",
                "--memory",
                "0.0001",
                "--quiet",
            ],
            "GB",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(args, message):
    result = run_main("plan", *args)
    assert result.returncode == 2
    assert message in result.stderr


RESNET = ["torchvision.models.resnet18", "--stages", "2", "--input-shape", "3,32,32", "--quiet"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["torch.nn.Linear", "--stages", "2", "--input-shape", "4"],
         "cannot build MODEL torch.nn.Linear with --model-kwargs {}: "),
        ([*RESNET, "--model-kwargs", '{"num_classes": "ten"}'], "cannot build MODEL torchvision.models.resnet18"),
        ([*RESNET, "--model-kwargs", "[10]"], "expected a JSON object"),
        ([*RESNET, "--model-kwargs", "{num_classes: 10}"], "not JSON"),
        (["collections.OrderedDict", "--stages", "2", "--input-shape", "4"],
         "returned a OrderedDict, not a torch.nn.Module"),
        ([*RESNET, "--device", "gpu0"], "is not a device; use cpu or cuda:N"),
        ([*RESNET, "--chunks", "2", "--load-profile", "missing.json"], "--load-profile missing.json: no such file"),
        ([*RESNET[:-1], "--output", "no/such/dir/plan.json"], "--output no/such/dir/plan.json: the directory"),
        (["torchvision.models.resnet18", "--stages", "2", "--input-shape", "-3,32,32"], "dimensions must be positive"),
        ([*RESNET[:2], "auto", *RESNET[3:]], "--stages auto weighs the layouts of stages as processes: give --ranks"),
        ([*RESNET[:2], "3", *RESNET[3:], "--ranks", "4"], "--stages a divisor of --ranks"),
        ([*RESNET, "--memory", "-5"], "argument --memory: expected a number above 0, got '-5'"),
        ([*RESNET, "--batch-size", "0"], "argument --batch-size: expected a whole number of at least 1, got '0'"),
        ([*RESNET[:2], "0", *RESNET[3:]], "argument --stages: expected a whole number of at least 1 or \"auto\""),
        ([*RESNET, "--ranks", "4", "--internode", "0"], "argument --internode: expected a speed above 0 like 400Gb/s"),
        (["tests", "--stages", "2"], "tests is a directory without config.json: give the directory of a Hugging Face"),
        (["missing/config.json", "--stages", "2"], "missing/config.json: there is no such file"),
        (["/no/such/model", "--stages", "2"], "/no/such/model: there is no such file or directory"),
    ],
)
def test_every_user_error_is_one_line_and_status_2(args, message):
    result = run_main("plan", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
    assert "profiling" not in result.stderr  # found before any profiling


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_a_gpu_device_without_a_gpu_is_one_line_and_status_2():
    result = run_main("plan", *RESNET, "--device", "cuda:0")
    assert result.returncode == 2
    assert "asks for a GPU, but torch sees no CUDA device here; use --device cpu" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_damaged_saved_profile_names_the_file(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text('{"format": "lightning-antichain/cost-graph/1", "nodes": null}')
    result = run_main("plan", *RESNET, "--chunks", "2", "--load-profile", str(path))
    assert result.returncode == 2
    assert f"--load-profile {path} is not a cost graph saved by --save-profile" in result.stderr


def test_the_cli_and_the_library_take_one_planning_path_with_the_same_defaults(tmp_path):
    import torch
    import torchvision

    from lightning_antichain import load_cost_graph
    from lightning_antichain.planner import planning

    profile = tmp_path / "cost.json"
    run_main("plan", "torchvision.models.resnet18", "--stages", "2", "--input-shape", "3,32,32", "--batch-size", "8",
            "--chunks", "4", "--quiet", "--save-profile", str(profile), "--no-profile-cache", "--no-calibrate")
    result = run_main("plan", "torchvision.models.resnet18", "--stages", "3", "--chunks", "4", "--load-profile",
                     str(profile), "--json")
    from_cli = json.loads(result.stdout)
    planned = planning.plan_model(None, (), {}, ["cpu"] * 3, chunks=4, cost=load_cost_graph(profile))
    from_library = json.loads(planned.plan.to_json())
    window = json.loads(run_main("plan", "torchvision.models.resnet18", "--stages", "3", "--chunks", "4",
                                 "--load-profile", str(profile), "--json", "--accumulate-grad-batches", "4").stdout)
    accumulating = json.loads(planning.plan_model(None, (), {}, ["cpu"] * 3, chunks=4, cost=load_cost_graph(profile),
                                                  accumulate_grad_batches=4).plan.to_json())
    for plan in (from_cli, from_library, window, accumulating):
        plan.pop("solve_s")
    assert from_cli == from_library
    assert window == accumulating and window["accumulate_grad_batches"] == 4  # the Trainer's window, as the strategy
    assert planning.default_bandwidth_gbps([torch.device("cpu")]) is None
    assert planning.default_memory_gb([torch.device("cpu")] * 2) == [None, None]
    # the profile the CLI cached is the one the library finds for the same module and micro-batch
    # (calibration, which reads no profile from the cache, is left out of both for time)
    cache = tmp_path / "cache"
    run_main("plan", "torchvision.models.resnet18", "--stages", "2", "--input-shape", "3,32,32", "--batch-size", "8",
            "--chunks", "4", "--quiet", "--profile-cache", str(cache), "--no-calibrate")
    model = torchvision.models.resnet18()
    again = planning.plan_model(model, (torch.randn(2, 3, 32, 32),), {}, ["cpu", "cpu"], chunks=4,
                                profile_cache=cache, progress=False, calibrate=False)
    assert again.cached_from is not None and again.cached_from.parent == cache


def test_the_cli_starts_from_the_strategys_defaults():
    import lightning_antichain as la
    from lightning_antichain.cli import _parser
    from lightning_antichain.plans.options import PipelineOptions

    parsed = _parser().parse_args(["plan", "torch.nn.Linear", "--stages", "2"])
    strategy = la.AntichainPipelineStrategy()
    assert strategy.options == PipelineOptions()
    for name in ("chunks", "method", "optimizer_multiplier", "accumulate_grad_batches"):
        assert getattr(parsed, name) == getattr(strategy.options, name), name
    assert parsed.no_calibrate is not strategy.options.calibrate
    assert parsed.no_profile_cache is not strategy.options.use_profile_cache
    # and by default it weighs the micro-batch counts, as the strategy does
    result = run_main("plan", "torchvision.models.squeezenet1_0", "--model-kwargs", '{"num_classes": 10}', "--stages",
                     "2", "--input-shape", "3,32,32", "--batch-size", "4", "--quiet", "--json", "--no-profile-cache",
                     "--no-calibrate")
    plan = json.loads(result.stdout)
    assert [c["chunks"] for c in plan["candidates"]] == [1, 2, 4]
    assert plan["chunks"] in (1, 2, 4)


def test_stage_devices_start_at_the_profiled_gpu():
    import torch

    from lightning_antichain.cli import _check_stage_devices, _stage_devices

    assert _stage_devices("cuda:2", 3) == ["cuda:2", "cuda:3", "cuda:4"]
    assert _stage_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    assert _stage_devices("cpu", 2) == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="fewer --stages"):
        _check_stage_devices(_stage_devices(f"cuda:{torch.cuda.device_count()}", 1))


VIT = {"model_name": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 8, "depth": 2, "num_classes": 4}


def test_a_plan_saved_by_the_command_trains_a_fresh_capture_with_plan(tmp_path):
    """The command captures the model in its own process; the strategy captures it again in this
    one and must find the plan's operations under the same names (a ViT, whose forward takes
    attn_mask=None, a constant the capture bakes in)."""
    import lightning as L
    import timm
    import torch
    from lit_models import trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_antichain as la

    path = tmp_path / "vit.json"
    run_cli("plan", "timm.create_model", "--model-kwargs", json.dumps(VIT), "--stages", "2", "--input-shape",
            "3,32,32", "--batch-size", "8", "--chunks", "4", "--output", str(path), "--quiet", "--no-calibrate")

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = timm.create_model(**VIT)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.model(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(24, 3, 32, 32, generator=generator), torch.randint(0, 4, (24,), generator=generator)
    data = TensorDataset(images, labels)
    runs = []
    for strategy in ("auto", la.AntichainPipelineStrategy(plan=str(path), module="model")):
        torch.manual_seed(0)
        model = Classifier()
        fit = trainer(strategy=strategy, devices=1 if strategy == "auto" else 2, max_steps=3)
        fit.fit(model, DataLoader(data, batch_size=8))
        runs.append(model.losses)
    assert fit.strategy.plan.num_stages == 2
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=0)


def test_the_command_weighs_the_layouts_of_ranks_on_two_nodes_as_the_strategy_does(tmp_path):
    """``--ranks 4 --per-node 2 --stages auto``: every layout of 4 processes over 2 nodes, with
    every schedule, each with its prediction or why it could not run; the chosen one named in the
    plan, whose stage count is its pipeline's; and ``la.plan_layout`` on the same profile makes the
    same plan (one path for the command, the library and the strategy)."""
    import torch
    import torchvision

    import lightning_antichain as la

    cache = tmp_path / "profiles"
    result = run_main("plan", "torchvision.models.resnet18", "--model-kwargs", '{"num_classes": 10}', "--ranks", "4",
                      "--per-node", "2", "--stages", "auto", "--input-shape", "3,32,32", "--batch-size", "16",
                      "--profile-cache", str(cache), "--quiet", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    layouts = plan["layouts"]
    assert {(row["dp"], row["pp"]) for row in layouts} == {(1, 4), (2, 2), (4, 1)}
    assert {row["schedule"] for row in layouts} == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"}
    chosen = [row for row in layouts if "lost" not in row]
    assert len(chosen) == 1 and chosen[0]["dp"] == plan["layout"]["dp"]
    assert len(plan["stages"]) == plan["layout"]["pp"] * plan["layout"]["virtual_stages"]
    assert all(row.get("predicted_step_s") is not None or row["lost"] for row in layouts)
    library = la.plan_layout(torchvision.models.resnet18(num_classes=10), torch.randn(16, 3, 32, 32), 4, per_node=2,
                             profile_cache=str(cache), calibrate=False, progress=False)
    assert library.layout == plan["layout"]
    assert [stage.nodes for stage in library.stages] == [stage["nodes"] for stage in plan["stages"]]


def tiny_llama_config(directory, **overrides) -> None:
    import transformers

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    transformers.LlamaConfig(**{**shape, **overrides}).save_pretrained(directory)


def test_the_command_plans_a_hugging_face_config_on_meta_for_gpus_it_does_not_have(tmp_path):
    """A model directory holding only ``config.json``: built on meta, fed token ids with
    ``labels=``, weighed for 4 GPUs on 2 nodes within ``--memory``; the same plan from the
    library's one entry point."""
    import torch

    import lightning_antichain as la
    from lightning_antichain.hf_models import causal_lm_on_meta

    tiny_llama_config(tmp_path / "llama")
    cache = tmp_path / "profiles"

    def plan_for(memory_gb: float):
        result = run_main("plan", str(tmp_path / "llama"), "--ranks", "4", "--per-node", "2", "--memory",
                          str(memory_gb), "--stages", "auto", "--batch-size", "8", "--sequence-length", "32",
                          "--replication", "fsdp", "--profile-cache", str(cache), "--quiet", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    roomy = plan_for(1.0)
    assert all(stage["device"].startswith("cuda:") for stage in roomy["stages"])  # the ranks', not the profile's
    assert sum(len(stage["nodes"]) for stage in roomy["stages"]) > 100  # the operations, not the top-level children
    peaks = sorted(row["peak_memory_bytes"] for row in roomy["layouts"] if row.get("peak_memory_bytes"))
    limit = peaks[len(peaks) // 2]  # half the candidates need more
    plan = plan_for(limit / 1e9)
    chosen = next(row for row in plan["layouts"] if "lost" not in row)
    assert chosen["peak_memory_bytes"] <= limit
    assert any(row.get("lost", "").startswith("needs") for row in plan["layouts"])
    built = causal_lm_on_meta(str(tmp_path / "llama"), 8, 32)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in built.model.parameters())
    library = la.plan_layout(built.model, built.batch, 4, device="cuda", per_node=2, profile_device="cpu",
                             replication="fsdp", memory_gb=limit / 1e9, optimizer_multiplier=2.0,
                             profile_cache=str(cache), calibrate=False, progress=False)
    assert library.layout == plan["layout"]
    assert [stage.nodes for stage in library.stages] == [stage["nodes"] for stage in plan["stages"]]


def test_the_command_plans_a_hugging_face_config_as_stages_in_one_process_from_its_directory_or_file(tmp_path):
    tiny_llama_config(tmp_path / "llama")
    plans = []
    for path in (tmp_path / "llama", tmp_path / "llama" / "config.json"):
        result = run_main("plan", str(path), "--stages", "2", "--batch-size", "8", "--sequence-length", "32",
                          "--chunks", "4", "--no-calibrate", "--profile-cache", str(tmp_path / "profiles"), "--quiet",
                          "--json")
        assert result.returncode == 0, result.stderr
        plans.append(json.loads(result.stdout))
    assert len(plans[0]["stages"]) == 2 and plans[0]["chunks"] == 4 and plans[0]["micro_batch_size"] == 2
    assert [s["nodes"] for s in plans[1]["stages"]] == [s["nodes"] for s in plans[0]["stages"]]


@pytest.mark.parametrize("args, message", [
    (("--ranks", "2", "--batch-size", "4", "--memory", "1"), "give --sequence-length"),
    (("--ranks", "2", "--batch-size", "4", "--sequence-length", "16"), "give their memory, --memory GB"),
    (("--ranks", "2", "--batch-size", "4", "--sequence-length", "999", "--memory", "1"), "max_position_embeddings"),
    (("--ranks", "2", "--batch-size", "4", "--sequence-length", "16", "--memory", "1", "--precision", "fp8"),
     "invalid choice"),
])
def test_a_hugging_face_plan_missing_what_it_needs_says_what_to_give(tmp_path, args, message):
    tiny_llama_config(tmp_path / "llama")
    result = run_main("plan", str(tmp_path / "llama"), "--stages", "auto", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_sequence_length_for_an_import_path_is_refused():
    result = run_main("plan", "torchvision.models.resnet18", "--stages", "2", "--sequence-length", "16")
    assert result.returncode == 2 and "--sequence-length is for a Hugging Face MODEL" in result.stderr


@pytest.mark.parametrize("saved", ["float32", "bfloat16"])
@pytest.mark.parametrize("precision, dtype, per_parameter", [("bf16-true", "bfloat16", 8), ("32-true", "float32", 16),
                                                             ("bf16-mixed", "bfloat16", 16)])
def test_the_precision_asked_for_decides_the_bytes_whatever_dtype_the_config_names(tmp_path, saved, precision, dtype,
                                                                                  per_parameter):
    """A downloaded config names the dtype it was saved in (Gemma-2-9B's float32): the plan takes
    --precision's dtype for the weights, and AdamW's state from it (a float32 config under bf16
    was planned at 2.09x the bytes)."""
    import torch

    from lightning_antichain.cli import _optimizer_multiplier, _parser
    from lightning_antichain.hf_models import causal_lm_on_meta

    tiny_llama_config(tmp_path / "llama")
    written = json.loads((tmp_path / "llama" / "config.json").read_text())
    written["torch_dtype"] = written["dtype"] = saved
    (tmp_path / "saved.json").write_text(json.dumps(written))
    model = causal_lm_on_meta(str(tmp_path / "saved.json"), 2, 8, precision).model
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    args = _parser().parse_args(["plan", str(tmp_path / "saved.json"), "--stages", "2", "--precision", precision])
    weight = getattr(torch, dtype).itemsize
    assert weight * (2 + _optimizer_multiplier(args, True)) == per_parameter  # weight, gradient, AdamW's state


def test_the_command_reads_its_arguments_before_it_imports_torch(tmp_path):
    """A mistake in the arguments is said before torch, Lightning or the package load (each took
    26-49 s on a loaded machine): the entry point reads them first, and a bad one ends there."""
    script = ("import sys\nfrom lightning_antichain_cli import main\n"
              "try:\n    main(sys.argv[1:])\nexcept SystemExit as exit:\n    code = exit.code\n"
              "loaded = sorted(m for m in ('torch', 'lightning', 'lightning_antichain') if m in sys.modules)\n"
              "print(code, loaded)\n")
    for args in (["plan", "x", "--stages", "2", "--memory", "-5"], ["plan", str(tmp_path), "--stages", "2"],
                 ["plan", "x", "--stages", "0"], ["plan", "m.json", "--stages", "2"],
                 ["plan", "x", "--stages", "2", "--gpu", "V100"], ["plan", "x", "--stages", "2", "--output", "/no/x"],
                 ["plan", "/no/such/model", "--stages", "2"]):
        result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60)
        assert result.stdout.strip() == "2 []", (args, result.stdout, result.stderr)
        assert result.stderr.strip().splitlines()[-1].startswith(("lightning-antichain", "usage")), result.stderr


def test_the_arguments_defaults_and_choices_are_the_packages():
    """The entry point's copies of what the package defines (it may not import the package)."""
    from lightning_antichain.hf_models import PRECISIONS
    from lightning_antichain.planner.partition import METHODS
    from lightning_antichain.planner.target_devices import TARGET_DEVICES
    from lightning_antichain.plans.options import RECOMPUTE_MODES, PipelineOptions
    from lightning_antichain_cli import arguments

    defaults = PipelineOptions()
    for name in ("chunks", "optimizer_multiplier", "method", "rebalance_rounds", "cpu_threads",
                 "accumulate_grad_batches", "recompute"):
        assert getattr(arguments.DEFAULTS, name) == getattr(defaults, name), name
    assert arguments.PRECISION_NAMES == tuple(PRECISIONS) and arguments.METHODS == tuple(METHODS)
    assert arguments.TARGET_NAMES == tuple(TARGET_DEVICES) and arguments.RECOMPUTE_MODES == tuple(RECOMPUTE_MODES)
