"""``lightning-antichain``: plan a model's pipeline from the command line.

    lightning-antichain plan torchvision.models.resnet50 --model-kwargs '{"num_classes": 10}' \\
        --stages 4 --input-shape 3,32,32 --batch-size 32 --chunks 4 --json
    lightning-antichain plan torchvision.models.resnet50 --ranks 8 --per-node 4 --stages auto --schedule auto \
        --input-shape 3,32,32 --batch-size 64   # 8 processes on 2 nodes, as pipeline_parallel_size="auto" weighs them
    lightning-antichain plan ~/models/Llama-3.1-8B --gpu H100 --ranks 16 --per-node 8 --stages auto \
        --batch-size 32 --sequence-length 1024   # a Hugging Face causal LM from its config, for H100s
    lightning-antichain consolidate checkpoints/epoch=0-step=6.ckpt   # shards -> one file for plain Lightning

Progress and the table go to stderr and stdout respectively; with ``--json`` stdout holds exactly
one JSON object, so the output can be piped. The arguments are read and checked by
:mod:`lightning_antichain_cli.arguments`, before this module (and torch) is imported.
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

from lightning_antichain_cli.arguments import build_parser, parse

from .capture import UntraceableModelError
from .hf_models import PRECISIONS, causal_lm_on_meta, is_hf_config
from .planner.cost_graph import load_cost_graph, save_cost_graph
from .planner.cost_model import InfeasiblePlanError
from .plans.options import PipelineOptions
from .weights.sharded_checkpoint import ShardedCheckpoint, check_checkpoint

_parser = build_parser  # the parser, for the docs and the tests

DEFAULTS = PipelineOptions()
"""The settings the strategy starts from; the command line starts from the same
(:class:`lightning_antichain_cli.arguments.Defaults`, checked against these by the tests)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Read the arguments and run the command (as the installed ``lightning-antichain`` does,
    which reads them before importing this module: :mod:`lightning_antichain_cli`)."""
    return run(parse(sys.argv[1:] if argv is None else list(argv)))


def run(args: argparse.Namespace) -> int:
    """Run the command of ``args`` as read by :func:`lightning_antichain_cli.arguments.parse`; a
    user error is said on stderr with exit status 2, as argparse's own."""
    commands = {"plan": _plan, "consolidate": _consolidate}
    try:
        return commands[args.command](args)
    except (InfeasiblePlanError, UntraceableModelError, ValueError, ImportError) as exc:
        print(f"lightning-antichain: error: {exc}", file=sys.stderr)
        return 2


def _plan_layout(args: argparse.Namespace) -> int:
    """``plan --ranks N``: the layout search the strategy runs for ``pipeline_parallel_size="auto"`` (or a fixed
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
    _check_device(args.device)
    _check_stage_devices(_stage_devices(args.device, args.stages))
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
