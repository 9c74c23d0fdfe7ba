"""The ``lightning-antichain`` command's arguments, read and checked before anything heavy is
imported: a mistyped flag, a count below one, a size that is not one, a MODEL path that is not a
model, an unknown ``--gpu`` are each said within a second, not after torch and Lightning load
(26-49 s on a loaded 2-core machine) or after minutes of profiling.

Nothing here imports torch or lightning_antichain; the defaults and choices that mirror the
package's are checked against it by the tests (tests/test_cli.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DESCRIPTION = "plan a model's pipeline from the command line"

#: Lightning's precisions the plan command knows (:data:`lightning_antichain.hf_models.PRECISIONS`)
PRECISION_NAMES = ("32-true", "bf16-true", "bf16-mixed")
#: the partition methods (:data:`lightning_antichain.planner.partition.METHODS`)
METHODS = ("antichain", "uniform", "parameters", "blocks")
#: the GPUs ``--gpu`` knows by name (:data:`lightning_antichain.planner.target_devices.TARGET_DEVICES`)
TARGET_NAMES = ("A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "MI300X")
TARGET_ALIASES = ("A100", "H100")
RECOMPUTE_MODES = ("never", "except_last", "always")


class Defaults:
    """The strategy's defaults the command starts from (:class:`lightning_antichain.plans.options.PipelineOptions`)."""

    chunks: int | str = "auto"
    optimizer_multiplier: float | None = None
    method = "antichain"
    rebalance_rounds = 3
    cpu_threads: int | None = None
    accumulate_grad_batches = 1
    recompute = "never"


DEFAULTS = Defaults()


def parse(argv: list[str]) -> argparse.Namespace:
    """The arguments, each checked as it is read (argparse exits with status 2 on a bad one), then
    what can be checked without importing torch: the MODEL path, ``--gpu``, the paths to write."""
    parser = build_parser()
    args = parser.parse_args(_values_may_start_with_minus(argv))
    if args.command == "plan":
        try:
            if args.chunks == "auto" and args.load_profile and args.ranks is None:
                raise ValueError("--chunks auto (the default) profiles the model at each candidate micro-batch size; "
                                 "it cannot plan from --load-profile. Give --chunks as a number.")
            check_model_path(args.model)
            check_gpu(args.gpu)
            check_paths(args)
        except ValueError as exc:
            parser.exit(2, f"lightning-antichain: error: {exc}\n")
    return args


def _values_may_start_with_minus(argv: list[str]) -> list[str]:
    """``--input-shape -3,32,32`` as ``--input-shape=-3,32,32``, so the value reaches its own check
    instead of argparse taking it for an option."""
    joined: list[str] = []
    for token in argv:
        if joined and joined[-1] in _VALUED and token[:1] == "-" and token[1:2].isdigit():
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


_VALUED = ("--input-shape", "--stages", "--batch-size", "--chunks", "--bandwidth", "--intranode", "--internode",
           "--memory", "--sequence-length")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-antichain", description=DESCRIPTION)
    commands = parser.add_subparsers(required=True, dest="command")
    plan = commands.add_parser("plan", help="profile a model and cut it into pipeline stages")
    plan.add_argument(
        "model", help="import path of a callable returning an nn.Module, e.g. torchvision.models.resnet50; or a "
                      "Hugging Face causal LM's directory or config.json, built on meta from its config alone"
    )
    plan.add_argument("--stages", type=_count_or_auto, required=True,
                      help="number of pipeline stages (devices); with --ranks, processes per pipeline, or auto")
    plan.add_argument("--ranks", type=_at_least_one,
                      help="plan stages as processes: this many ranks (the strategy with schedule=), each on its "
                           "device, as replicas x stages; --stages auto weighs every layout")
    plan.add_argument("--schedule", default="auto",
                      help="with --ranks: the schedule of torch.distributed.pipelining, or auto (the default) to weigh "
                           "them all")
    plan.add_argument("--per-node", type=_at_least_one, help="with --ranks: ranks per node (default: all on one)")
    plan.add_argument("--gpu", help="with --ranks: plan for ranks on this GPU without one at hand, every operation "
                                    f"costed on its roofline: one of {', '.join(TARGET_NAMES)}, or a JSON file "
                                    "describing another (see docs/planner.md)")
    plan.add_argument("--efficiencies", help="with --gpu: a JSON file of the shares of the GPU's peaks each kind of "
                                             "kernel reaches, as Efficiencies.save writes them (default: assumed, "
                                             "see docs/planner.md)")
    plan.add_argument("--internode", type=_link_speed,
                      help="with --ranks: the link between nodes, e.g. 400Gb/s or 50GB/s (a bare number is GB/s; "
                           "default: --gpu's network adapter, else 25 GB/s from a GPU, else --bandwidth)")
    plan.add_argument("--replication", choices=["ddp", "fsdp"], default="ddp",
                      help="with --ranks: how a stage's replicas keep in step (fsdp shards the optimizer state)")
    plan.add_argument("--input-shape", type=_shape, help="shape of one sample, e.g. 3,32,32")
    plan.add_argument("--sequence-length", type=_at_least_one,
                      help="a Hugging Face MODEL: tokens per sample (random token ids, labels= the same)")
    plan.add_argument("--precision", choices=list(PRECISION_NAMES), default="bf16-true",
                      help="a Hugging Face MODEL: the dtype it is planned in, and AdamW's state (bf16-mixed: float32 "
                           "weights and moments, 16 bytes a parameter); default %(default)s")
    plan.add_argument("--rank-device", choices=["cpu", "cuda"],
                      help="with --ranks: the device each rank trains on, where it differs from --device (where the "
                           "model is profiled): cuda plans for GPUs this machine need not have; give --memory then. "
                           "Default: cuda for a Hugging Face MODEL, else --device's")
    plan.add_argument("--batch-size", type=_at_least_one, default=32, help="samples per training step")
    plan.add_argument("--recompute", choices=list(RECOMPUTE_MODES), default=DEFAULTS.recompute,
                      help="activation recomputation, as the strategy's recompute= (always: a stage keeps only its "
                           "inputs per micro-batch and runs its forward again in backward); default %(default)s")
    plan.add_argument("--chunks", type=_count_or_auto, default=DEFAULTS.chunks,
                      help='micro-batches per step, or "auto" (the default, as in the strategy) for the count with '
                           "the best predicted step")
    plan.add_argument("--device", default="cpu", help="device to profile on: cpu or cuda:N")
    plan.add_argument("--bandwidth", "--intranode", type=_link_speed, dest="bandwidth",
                      help="the link between stages or ranks of a node, e.g. 450GB/s (a bare number is GB/s; default: "
                           "--gpu's NVLink, else 16 GB/s between GPUs, free between CPU devices)")
    plan.add_argument("--memory", type=_positive,
                      help="memory per device in GB (default: 90%% of each GPU's, unlimited on CPU)")
    plan.add_argument("--optimizer-multiplier", type=_not_negative, default=DEFAULTS.optimizer_multiplier,
                      help="optimizer state per parameter byte (default 2, as for Adam)")
    plan.add_argument("--model-kwargs", type=_json_object, default={}, help="JSON keyword arguments for MODEL")
    plan.add_argument("--method", choices=METHODS, default=DEFAULTS.method, help="planner (baselines for comparison)")
    plan.add_argument(
        "--fallback",
        choices=["children", "none"],
        default="children",
        help="what to do when no frontend captures the model: plan its top-level children for a look (the default "
        "here; the strategy, which must run the plan, refuses instead), or refuse",
    )
    plan.add_argument("--load-profile", help="plan from a saved cost graph instead of profiling")
    plan.add_argument("--profile-cache", help="directory of cached profiles (default ~/.cache/lightning-antichain)")
    plan.add_argument("--no-profile-cache", action="store_true", help="profile anew and cache nothing")
    plan.add_argument("--no-calibrate", action="store_true",
                      help="predict from the profile alone, without timing a few steps of CPU stages")
    plan.add_argument("--rebalance-rounds", type=int, default=DEFAULTS.rebalance_rounds,
                      help="after timing CPU stages, cut again on their measured times for at most this many "
                           "rounds, keeping the best split measured (0: keep the profile's split; default %(default)s)")
    plan.add_argument("--cpu-threads", type=_at_least_one, default=DEFAULTS.cpu_threads,
                      help="intra-op threads of each CPU stage, which profiling uses too (default: the cores shared "
                           "evenly among the CPU stages)")
    plan.add_argument("--accumulate-grad-batches", type=_at_least_one, default=DEFAULTS.accumulate_grad_batches,
                      help="the Trainer's accumulate_grad_batches, whose adding into gradients the step is charged "
                           "(default %(default)s)")
    plan.add_argument("--save-profile", help="save the cost graph as JSON for later --load-profile")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.add_argument("--output", help="save the plan as JSON to this file")
    plan.add_argument("--plot", help="draw the stage loads and the predicted timeline to this PNG (needs matplotlib)")
    plan.add_argument("--quiet", action="store_true", help="no progress on stderr")
    consolidate = commands.add_parser(
        "consolidate", help="write a checkpoint directory of stage shards as one .ckpt that plain Lightning loads")
    consolidate.add_argument("checkpoint", help="the directory a run with schedule= saved (e.g. epoch=0-step=6.ckpt)")
    consolidate.add_argument("--output", help="the file to write (default: the directory's name + .consolidated)")
    return parser


def check_model_path(model: str) -> None:
    """A MODEL that names a directory or a JSON file must be a Hugging Face config; an import path
    is anything else. Said before any work."""
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{model} is a directory without config.json: give the directory of a Hugging Face model (as "
                         "huggingface-cli download writes it) or its config.json, or an import path of a model "
                         "(package.module.function) with --input-shape")
    if path.suffix == ".json" and not path.is_file():
        raise ValueError(f"{model}: there is no such file; give a Hugging Face model's config.json or its directory")
    if ("/" in model or model.startswith("~")) and not path.exists():  # an import path has no slash
        raise ValueError(f"{model}: there is no such file or directory; give a Hugging Face model's directory or "
                         "its config.json, or an import path of a model (package.module.function)")


def check_gpu(gpu: str | None) -> None:
    """A ``--gpu`` that is neither a GPU known by name nor a JSON file that exists."""
    if gpu is None:
        return
    known = {name.lower() for name in (*TARGET_NAMES, *TARGET_ALIASES)}
    if gpu.endswith(".json"):
        if not Path(gpu).expanduser().is_file():
            raise ValueError(f"--gpu {gpu}: there is no such file")
    elif gpu.lower() not in known:
        raise ValueError(f"--gpu {gpu}: not a GPU this planner knows ({', '.join(TARGET_NAMES)}); describe it in a "
                         "JSON file (see docs/planner.md) and give its path")


def check_paths(args: argparse.Namespace) -> None:
    """Fail before profiling, not after, on paths that cannot be read or written."""
    if args.load_profile and not Path(args.load_profile).is_file():
        raise ValueError(f"--load-profile {args.load_profile}: no such file")
    for flag, path in (("--output", args.output), ("--save-profile", args.save_profile), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag} {path}: the directory {Path(path).resolve().parent} does not exist")


def _count_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return _at_least_one(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f'expected a whole number of at least 1 or "auto", got {text!r}') from None


def _at_least_one(text: str) -> int:
    """A count, checked when the arguments are read, before any work."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _positive(text: str) -> float:
    """A size or speed (GB, GB/s), checked when the arguments are read, before any work."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value


def _link_speed(text: str) -> float:
    """A link's speed in GB/s, from ``400Gb/s`` (bits, as network adapters are sold), ``50GB/s``
    or a bare number of GB/s."""
    number, factor = text, 1.0
    for unit, scale in (("Gb/s", 1 / 8), ("Gbps", 1 / 8), ("Gbit/s", 1 / 8), ("GB/s", 1.0), ("GBps", 1.0)):
        if text.endswith(unit):
            number, factor = text[:-len(unit)], scale
            break
    try:
        return _positive(number.strip()) * factor
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a speed above 0 like 400Gb/s or 50GB/s, got {text!r}") from None


def _not_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of at least 0, got {text!r}")
    return value


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 3,32,32, got {text!r}") from None
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"dimensions must be positive, got {text!r}")
    return shape


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"num_classes\": 10}}', got {text!r}")
    return value


