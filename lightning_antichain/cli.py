"""``lightning-antichain``: plan a model's pipeline from the command line.

    lightning-antichain plan torchvision.models.resnet50 --model-kwargs '{"num_classes": 10}' \\
        --stages 4 --input-shape 3,32,32 --batch-size 32 --chunks 4 --json
    lightning-antichain plan torchvision.models.resnet50 --ranks 8 --per-node 4 --stages auto --schedule auto \
        --input-shape 3,32,32 --batch-size 64   # the layout of 8 processes on 2 nodes, as stages="auto" weighs it
    lightning-antichain plan ~/models/Llama-3.1-8B --ranks 16 --per-node 8 --memory 80 --stages auto \
        --batch-size 32 --sequence-length 1024   # a Hugging Face causal LM from its config, on meta
    lightning-antichain consolidate checkpoints/epoch=0-step=6.ckpt   # shards -> one file for plain Lightning

Progress and the table go to stderr and stdout respectively; with ``--json`` stdout holds exactly
one JSON object, so the output can be piped.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .capture import UntraceableModelError
from .hf_models import PRECISIONS, causal_lm_on_meta, is_hf_config
from .planner.cost_graph import load_cost_graph, save_cost_graph
from .planner.cost_model import InfeasiblePlanError
from .planner.partition import METHODS
from .plans.options import PipelineOptions
from .weights.sharded_checkpoint import ShardedCheckpoint, check_checkpoint

DEFAULTS = PipelineOptions()
"""The settings the strategy starts from; the command line starts from the same."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; a user error is one line on stderr and exit status 2, as argparse's own."""
    parser = _parser()
    args = parser.parse_args(_values_may_start_with_minus(sys.argv[1:] if argv is None else list(argv)))
    try:
        return args.run(args)
    except (InfeasiblePlanError, UntraceableModelError, ValueError, ImportError) as exc:
        print(f"lightning-antichain: error: {exc}", file=sys.stderr)
        return 2


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

#: the GPUs ``--gpu`` knows by name (:data:`lightning_antichain.planner.target_devices.TARGET_DEVICES`)
TARGET_NAMES = ("A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "MI300X")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-antichain", description=__doc__.split("\n")[0])
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
                                             "kernel reaches (as benchmarks/roofline_gpu.py fits them on a GPU)")
    plan.add_argument("--internode", type=_link_speed,
                      help="with --ranks: the link between nodes, e.g. 400Gb/s or 50GB/s (a bare number is GB/s; "
                           "default: --gpu's network adapter, else 25 GB/s from a GPU, else --bandwidth)")
    plan.add_argument("--replication", choices=["ddp", "fsdp"], default="ddp",
                      help="with --ranks: how a stage's replicas keep in step (fsdp shards the optimizer state)")
    plan.add_argument("--input-shape", type=_shape, help="shape of one sample, e.g. 3,32,32")
    plan.add_argument("--sequence-length", type=_at_least_one,
                      help="a Hugging Face MODEL: tokens per sample (random token ids, labels= the same)")
    plan.add_argument("--precision", choices=list(PRECISIONS), default="bf16-true",
                      help="a Hugging Face MODEL: the dtype it is planned in, and AdamW's state (bf16-mixed: float32 "
                           "weights and moments, 16 bytes a parameter); default %(default)s")
    plan.add_argument("--rank-device", choices=["cpu", "cuda"],
                      help="with --ranks: the device each rank trains on, where it differs from --device (where the "
                           "model is profiled): cuda plans for GPUs this machine need not have; give --memory then. "
                           "Default: cuda for a Hugging Face MODEL, else --device's")
    plan.add_argument("--batch-size", type=_at_least_one, default=32, help="samples per training step")
    plan.add_argument("--recompute", choices=["never", "except_last", "always"], default=DEFAULTS.recompute,
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
    plan.set_defaults(run=_plan)
    consolidate = commands.add_parser(
        "consolidate", help="write a checkpoint directory of stage shards as one .ckpt that plain Lightning loads")
    consolidate.add_argument("checkpoint", help="the directory a run with schedule= saved (e.g. epoch=0-step=6.ckpt)")
    consolidate.add_argument("--output", help="the file to write (default: the directory's name + .consolidated)")
    consolidate.set_defaults(run=_consolidate)
    return parser


def _plan_layout(args: argparse.Namespace) -> int:
    """``plan --ranks N``: the layout search the strategy runs for ``stages="auto"`` (or a fixed
    ``--stages`` with ``--schedule auto``), on a batch of ``--batch-size`` random samples."""
    from .planner.public import plan_layout

    if args.ranks < 1 or args.batch_size < 1 or (args.stages != "auto" and args.ranks % args.stages):
        raise ValueError("--ranks and --batch-size must be at least 1, and --stages a divisor of --ranks (or auto)")
    _check_device(args.device)
    hf = is_hf_config(args.model)
    target = _target(args)
    rank_device = args.rank_device or ("cuda" if hf or target else torch.device(args.device).type)
    if target is not None and rank_device != "cuda":
        raise ValueError(f"--gpu {args.gpu} plans ranks on GPUs: leave out --rank-device {rank_device}")
    if target is None and rank_device != torch.device(args.device).type and args.memory is None:
        raise ValueError(f"--rank-device {rank_device} plans for devices other than the one profiled on "
                         f"({args.device}): give their memory, --memory GB")
    options = PipelineOptions(
        method=args.method, bandwidth_gbps=args.bandwidth, memory_gb=args.memory, recompute=args.recompute,
        optimizer_multiplier=_optimizer_multiplier(args, hf), profile_cache=args.profile_cache,
        use_profile_cache=not args.no_profile_cache, calibrate=False, cpu_threads=args.cpu_threads,
        accumulate_grad_batches=args.accumulate_grad_batches, progress=not args.quiet)
    model, example, depth = _model_and_batch(args, args.batch_size, fewest_layers=target is not None)
    if depth is not None:
        target = dataclasses.replace(target, depth=depth)
    try:
        plan = plan_layout(model, example, args.ranks, options, device=rank_device, per_node=args.per_node,
                           stages=args.stages, schedule=args.schedule, replication=args.replication,
                           internode_gbps=args.internode, profile_device=args.device, target=target)
    except InfeasiblePlanError as exc:
        memory_gb = args.memory or (target.memory_gb if target is not None else None)
        if not exc.layouts or memory_gb is None:
            raise
        raise ValueError(_nothing_fits(exc, args, model, depth, memory_gb, options.optimizer_multiplier)) from None
    if args.output:
        plan.save(args.output)
    print(plan.to_json() if args.json else plan.table())
    if target is None and rank_device != torch.device(args.device).type and not args.json:
        print(f"times are {args.device}'s, where the model was profiled, not the {rank_device} ranks': they rank the "
              "layouts; the memory is the ranks' own")
    return 0


def _nothing_fits(error: InfeasiblePlanError, args: argparse.Namespace, model: Any, depth: Any, memory_gb: float,
                  multiplier: float | None) -> str:
    """The report of a layout search that found nothing to fit (:mod:`.planner.nothing_fits`)."""
    from .planner.nothing_fits import nothing_fits

    trainable = [p for p in model.parameters() if p.requires_grad]
    weight_bytes = sum(p.numel() * p.element_size() for p in trainable)
    weight_bytes += depth.added_trainable_bytes(model) if depth is not None else 0
    itemsize = trainable[0].element_size() if trainable else 4
    multiplier = DEFAULTS.optimizer_multiplier if multiplier is None else multiplier
    multiplier = 2.0 if multiplier is None else multiplier
    return nothing_fits(error, args.ranks, args.per_node or args.ranks, memory_gb, int(weight_bytes * (2 + multiplier)),
                        itemsize * (2 + multiplier), args.replication,
                        args.precision if is_hf_config(args.model) else None)


def _target(args: argparse.Namespace) -> Any:
    """The cost model of ``--gpu`` (with ``--efficiencies``), or ``None``."""
    if args.gpu is None:
        if args.efficiencies:
            raise ValueError("--efficiencies are a GPU's: give --gpu too")
        return None
    from .planner.roofline import Efficiencies
    from .planner.target_devices import target_device
    from .planner.target_profile import TargetModel

    efficiencies = Efficiencies()
    if args.efficiencies:
        try:
            efficiencies = Efficiencies.load(args.efficiencies)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"--efficiencies {args.efficiencies}: {_one_line(exc)}") from None
    return TargetModel(target_device(args.gpu), efficiencies)


def _check_model_path(model: str) -> None:
    """A MODEL that names a directory or a JSON file must be a Hugging Face config; an import path
    is anything else. Said before any work."""
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{model} is a directory without config.json: give the directory of a Hugging Face model (as "
                         "huggingface-cli download writes it) or its config.json, or an import path of a model "
                         "(package.module.function) with --input-shape")
    if path.suffix == ".json" and not path.is_file():
        raise ValueError(f"{model}: there is no such file; give a Hugging Face model's config.json or its directory")


def _model_and_batch(args: argparse.Namespace, samples: int, fewest_layers: bool = False) -> tuple[Any, Any, Any]:
    """MODEL, and a batch of ``samples`` for it: random floats of ``--input-shape``, or for a
    Hugging Face MODEL, random token ids of ``--sequence-length`` (with ``labels=``); and, where
    a Hugging Face MODEL is built with its ``fewest_layers`` only, the depth its cost graph is
    extended to (:class:`~lightning_antichain.planner.deeper.Depth`), else ``None``."""
    if is_hf_config(args.model):
        if args.sequence_length is None:
            raise ValueError(f"{args.model} is a Hugging Face model: give --sequence-length (tokens per sample)")
        built = causal_lm_on_meta(args.model, samples, args.sequence_length, args.precision,
                                  fewest_layers=fewest_layers)
        depth = None
        if built.layers_path is not None and built.config_layers:
            from .planner.deeper import Depth

            captured = len(built.model.get_submodule(built.layers_path))
            if captured < built.config_layers:
                depth = Depth(built.layers_path, captured, built.config_layers, built.period)
        return built.model, built.batch, depth
    if args.sequence_length is not None:
        raise ValueError("--sequence-length is for a Hugging Face MODEL (a model directory or config.json); give "
                         "--input-shape for an import path")
    if args.input_shape is None:
        raise ValueError("--input-shape is required (the shape of one sample, e.g. 3,32,32)")
    return _build_model(args.model, args.model_kwargs), torch.randn(samples, *args.input_shape), None


def _optimizer_multiplier(args: argparse.Namespace, hf: bool) -> float | None:
    """Optimizer state per parameter byte: as given, else AdamW's in ``--precision`` for a
    Hugging Face MODEL, else the planner's default."""
    if args.optimizer_multiplier is not None or not hf:
        return args.optimizer_multiplier
    return PRECISIONS[args.precision][1]


def _consolidate(args: argparse.Namespace) -> int:
    source = Path(args.checkpoint)
    check_checkpoint(source)
    if not source.is_dir():
        raise ValueError(f"{source} is a checkpoint file, which plain Lightning loads as it is: only a directory of "
                         "shards needs consolidating")
    output = Path(args.output) if args.output else source.with_suffix(source.suffix + ".consolidated")
    if output.exists():
        raise ValueError(f"{output} exists: give another --output, or move it away")
    torch.save(ShardedCheckpoint(source).whole(), output)
    print(output)
    return 0


def _stage_devices(device: str, stages: int) -> list[str]:
    """One device per stage of the kind profiled: for ``cuda:N``, the GPUs cuda:N..N+K-1; the same CPU otherwise."""
    kind, _, index = device.partition(":")
    first = int(index or 0)
    return [f"cuda:{first + k}" for k in range(stages)] if kind == "cuda" else [device] * stages


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


def _check_device(device: str) -> None:
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device; use cpu or cuda:N") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError(f"--device {device} asks for a GPU, but torch sees no CUDA device here; use --device cpu")
        if (parsed.index or 0) >= count:
            raise ValueError(f"--device {device}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    elif parsed.type != "cpu":
        raise ValueError(f"--device {device!r}: profiling runs on cpu or cuda:N")


def _check_stage_devices(devices: list[str]) -> None:
    import torch

    count = torch.cuda.device_count()
    missing = [d for d in devices if torch.device(d).type == "cuda" and (torch.device(d).index or 0) >= count]
    if missing:
        raise ValueError(f"the {len(devices)} stages would run on {devices[0]} to {devices[-1]}, but torch sees "
                         f"{count} CUDA device(s): ask for fewer --stages or an earlier --device")


def _check_paths(args: argparse.Namespace) -> None:
    """Fail before profiling, not after, on paths that cannot be read or written."""
    if args.load_profile and not Path(args.load_profile).is_file():
        raise ValueError(f"--load-profile {args.load_profile}: no such file")
    for flag, path in (("--output", args.output), ("--save-profile", args.save_profile), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag} {path}: the directory {Path(path).resolve().parent} does not exist")


def _build_model(path: str, kwargs: dict[str, Any]) -> Any:
    from torch import nn

    factory = load_model_factory(path)
    try:
        model = factory(**kwargs)
    except TypeError as exc:
        raise ValueError(
            f"cannot build MODEL {path} with --model-kwargs {json.dumps(kwargs)}: {_one_line(exc)}. Pass its "
            "arguments as a JSON object, e.g. --model-kwargs '{\"num_classes\": 10}'"
        ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"MODEL {path} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def load_model_factory(path: str) -> Callable[..., Any]:
    """The callable named by ``package.module.attr`` or ``package.module:attr``."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"MODEL must be an import path like torchvision.models.resnet50, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import {module_name!r} for MODEL {path!r}: {_one_line(exc)}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ImportError(f"{module_name!r} has no callable {attr!r}")
    return factory


def _plan(args: argparse.Namespace) -> int:
    from .planner.planning import plan_model

    _check_model_path(args.model)
    if args.ranks is not None:
        return _plan_layout(args)
    if args.stages == "auto":
        raise ValueError("--stages auto weighs the layouts of stages as processes: give --ranks too")
    if args.gpu is not None:
        raise ValueError(f"--gpu {args.gpu} plans the layout of ranks on such GPUs: give --ranks (the GPUs in all) "
                         "and --per-node")

    auto = args.chunks == "auto"
    if args.stages < 1 or (not auto and args.chunks < 1) or args.batch_size < 1:
        raise ValueError("--stages, --chunks and --batch-size must be at least 1")
    if not auto and args.batch_size < args.chunks:
        raise ValueError(f"--batch-size {args.batch_size} is smaller than --chunks {args.chunks}")
    if auto and args.load_profile:
        raise ValueError("--chunks auto (the default) profiles the model at each candidate micro-batch size; it "
                         "cannot plan from --load-profile. Give --chunks as a number.")
    _check_device(args.device)
    _check_stage_devices(_stage_devices(args.device, args.stages))
    _check_paths(args)
    micro_batch = args.batch_size if auto else -(-args.batch_size // args.chunks)
    cost = None
    if args.load_profile:
        try:
            cost = load_cost_graph(args.load_profile)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--load-profile {args.load_profile} is not a cost graph saved by --save-profile: "
                             f"{type(exc).__name__}: {exc}") from None
        model, example = None, None
    else:
        model, example, _ = _model_and_batch(args, micro_batch)
    options = PipelineOptions(
        chunks=args.chunks,
        recompute=args.recompute,
        method=args.method,
        bandwidth_gbps=args.bandwidth,
        memory_gb=args.memory,
        optimizer_multiplier=_optimizer_multiplier(args, is_hf_config(args.model)),
        fallback=None if args.fallback == "none" else "children",
        profile_cache=args.profile_cache,
        use_profile_cache=not args.no_profile_cache,
        calibrate=not args.no_calibrate,
        rebalance_rounds=args.rebalance_rounds,
        cpu_threads=args.cpu_threads,
        accumulate_grad_batches=args.accumulate_grad_batches,
        progress=not args.quiet,
    )
    call = ((), example) if isinstance(example, dict) else ((example,), {})
    planned = plan_model(model, *call, _stage_devices(args.device, args.stages), options, name=args.model, cost=cost)
    plan = planned.plan
    if args.save_profile:
        save_cost_graph(planned.cost, args.save_profile)
    if args.output:
        plan.save(args.output)
    if args.plot:
        from .planner.plot import plot_plan

        plot_plan(plan, args.plot)
    print(plan.to_json() if args.json else plan.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def _one_line(exc: BaseException) -> str:
    """The message of an error raised by the user's code, on one line (a user error is one line)."""
    return " ".join(str(exc).split())
