"""The settings of one pipeline, planning and running alike, in checked frozen objects, and every
check of what a user gives for them.

The strategy and the CLI build a :class:`PipelineOptions` from what the user gave and hand the same
object to the planner (:func:`~lightning_antichain.planner.planning.plan_model`) and to the
:class:`~lightning_antichain.in_process.pipeline.Pipeline`, so a setting has one name, one default and
one check, wherever it is used. The process runtime's own settings are a :class:`ProcessOptions`.
The strategy's arguments are checked here too (:func:`check_strategy_arguments`), each error
naming the argument, so that no other module judges what a user gave.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..batches.batch_dims import check_batch_dim
from .plan import RECOMPUTE_MODES, check_chunks
from .process_schedules import SCHEDULE_NAMES, process_schedule
from .schedule import SCHEDULES

PLANNING_METHODS = ("antichain", "uniform", "parameters", "blocks")
FALLBACKS = (None, "children")
#: how a stage is kept in step with its replicas where stages are processes
REPLICATIONS = ("ddp", "fsdp")
#: how the strategy's processes start: as Lightning's DDP (a new interpreter each), or by multiprocessing
START_METHODS = ("popen", "spawn", "fork")
#: asking the planner to choose (``chunks``, ``pipeline_parallel_size``, ``schedule``)
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How to plan and run a pipeline.

    Running: ``chunks`` micro-batches per batch (``"auto"``: the planner chooses; a Pipeline runs
    its plan's count), ``recompute`` (activation recomputation: ``"never"``, ``"except_last"``,
    ``"always"``), ``batch_dim`` (the inputs' dim that holds the samples, or a dict of them by
    argument name), ``check_batch`` (refuse a forward whose samples depend on each other),
    ``leaf_modules`` (kept whole by capture), ``deferred_batch_norm`` (update running statistics
    once per batch), ``share_cpu_allocator`` (malloc keeps freed memory for CPU stages), ``cpu_threads`` (intra-op
    threads of each CPU stage, which planning also profiles with; ``None``: the cores shared evenly
    among the CPU stages) and
    ``measure_activations`` (count what each stage keeps for backward), ``device_slots`` (which
    device each stage runs on, where stages on one torch device still stand for different ones,
    as CPU devices do: a parameter used on several gets a leaf on each; ``None``: the torch
    devices), ``param_init_fn``
    (fills a module's new tensors when a model built on meta is made real, instead of Hugging
    Face's ``_init_weights`` or the module's ``reset_parameters()``; see
    :mod:`~lightning_antichain.weights.initialization`), and ``compile_stages`` (run each stage's
    graph through ``torch.compile``: ``True`` with its defaults, or a dict of its arguments, such
    as ``{"mode": "max-autotune-no-cudagraphs"}``; not the modes that replay CUDA graphs, see
    :func:`checked_compile_stages`; planning and calibration time the stages uncompiled).

    Planning: ``balance`` (operations per stage instead of planning), ``method`` (the antichain DP
    or a baseline), ``schedule`` (the order the stages run their tasks in, which sets the predicted
    step and each stage's memory: ``"gpipe"``, the in-process runtime's, or ``"1f1b"``, one
    process per stage; see :mod:`~lightning_antichain.plans.schedule`), ``even_chunks``
    (``chunks="auto"`` weighs only counts that split the batch evenly and give each stage one
    at least, as torch's schedules need), ``bandwidth_gbps`` (within a node), ``internode_gbps``
    (across nodes, for stages as processes) and ``memory_gb`` (``None``: from the devices),
    ``optimizer_multiplier`` (optimizer state per parameter byte; ``None``: from the optimizers,
    else 2), ``profile_cache`` and ``use_profile_cache``, ``calibrate`` (time a few in-process
    steps of CPU stages and plan on those times; stages as processes time their own first steps
    instead, :attr:`ProcessOptions.calibrate_steps`), ``rebalance_rounds`` (after calibration,
    cut again on the measured stage times for at most this many rounds, keeping the best split
    measured; 0: keep the profile's split),
    ``accumulate_grad_batches`` (the batches Lightning accumulates gradients over, which the
    predicted step charges their adding for; the strategy takes it from the Trainer),
    ``fallback`` (``"children"`` plans a model no frontend captures, for a look only) and
    ``progress`` (progress on stderr).
    """

    chunks: int | str = "auto"
    recompute: str = "never"
    batch_dim: int | Mapping[str, int] = 0
    check_batch: bool = True
    leaf_modules: tuple[type | str, ...] = ()
    deferred_batch_norm: bool = False
    share_cpu_allocator: bool = True
    cpu_threads: int | None = None
    measure_activations: bool = False
    param_init_fn: Callable[[Any], None] | None = None
    compile_stages: bool | Mapping[str, Any] = False
    device_slots: tuple[int, ...] | None = None
    balance: tuple[int, ...] | None = None
    method: str = "antichain"
    schedule: str = "gpipe"
    even_chunks: bool = False
    bandwidth_gbps: float | None = None
    internode_gbps: float | None = None
    memory_gb: float | tuple[float | None, ...] | None = None
    optimizer_multiplier: float | None = None
    profile_cache: Path | None = None
    use_profile_cache: bool = True
    calibrate: bool = True
    rebalance_rounds: int = 3
    accumulate_grad_batches: int = 1
    fallback: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        check_chunks(self.chunks, auto=True)
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        check_batch_dim(self.batch_dim)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        if self.method not in PLANNING_METHODS:
            raise ValueError(f"method must be one of {PLANNING_METHODS}, got {self.method!r}")
        if isinstance(self.rebalance_rounds, bool) or not isinstance(self.rebalance_rounds, int) or (
                self.rebalance_rounds < 0):
            raise ValueError(f"rebalance_rounds must be a whole number of at least 0, got {self.rebalance_rounds!r}")
        if isinstance(self.accumulate_grad_batches, bool) or not isinstance(self.accumulate_grad_batches, int) or (
                self.accumulate_grad_batches < 1):
            raise ValueError(f"accumulate_grad_batches must be a whole number of at least 1 (as the Trainer's), got "
                             f"{self.accumulate_grad_batches!r}")
        if self.cpu_threads is not None and (
                isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads is the intra-op threads of each CPU stage: a whole number of at least 1, "
                             f"or None to share the cores among the CPU stages; got {self.cpu_threads!r}")
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise ValueError(f"param_init_fn must be a function of one module that fills its parameters and buffers in "
                             f"place, got {self.param_init_fn!r}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be None or 'children', got {self.fallback!r}")
        balance = self.balance
        if balance is not None and (
            isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence) or not balance
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance)
        ):
            raise ValueError(
                f"balance lists how many operations each stage runs: one positive whole number per stage, got "
                f"{balance!r}. Leave it out to let the planner choose."
            )
        object.__setattr__(self, "compile_stages", checked_compile_stages(self.compile_stages))
        # Sequences become tuples, so that options compare, hash and print by value.
        object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules or ()))
        if balance is not None:
            object.__setattr__(self, "balance", tuple(balance))
        if isinstance(self.memory_gb, Sequence):
            object.__setattr__(self, "memory_gb", tuple(self.memory_gb))
        if self.profile_cache is not None:
            object.__setattr__(self, "profile_cache", Path(self.profile_cache))

    def replace(self, **changes: Any) -> PipelineOptions:
        """These options with ``changes``, checked again; an unknown name is a clear error."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise TypeError(f"unknown pipeline option(s) {unknown}; the options are {sorted(fields)}")
        return dataclasses.replace(self, **changes)


#: what ``compile_stages`` may pass to ``torch.compile``
COMPILE_ARGUMENTS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")


def checked_compile_stages(value: Any) -> bool | tuple[tuple[str, Any], ...]:
    """``compile_stages`` as options hold it: a bool, or ``torch.compile``'s arguments as sorted
    pairs (so that options still compare and hash by value)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, Mapping) or any(not isinstance(k, str) for k in value):
        raise ValueError(f"compile_stages is True (torch.compile's defaults), False, or a dict of torch.compile's "
                         f"arguments such as {{'mode': 'max-autotune-no-cudagraphs'}}; got {value!r}")
    unknown = sorted(set(value) - set(COMPILE_ARGUMENTS))
    if unknown:
        raise ValueError(f"compile_stages got {', '.join(map(repr, unknown))}, which torch.compile does not take per "
                         f"stage; it takes {', '.join(COMPILE_ARGUMENTS)}")
    _refuse_cuda_graphs(value)
    return tuple(sorted((k, _frozen(v)) for k, v in value.items()))


#: ``torch.compile`` modes that record CUDA graphs and replay them
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _refuse_cuda_graphs(arguments: Mapping[str, Any]) -> None:
    """Refuse stages that replay CUDA graphs. A replayed graph keeps its outputs and the
    activations its backward reads in one static pool that its next replay overwrites, while a
    pipeline keeps several micro-batches of a stage in flight between their forward and backward
    (torch's CUDA-graph trees then fail the backward: "accessing tensor output of CUDAGraphs that
    has been overwritten by a subsequent run", seen on an H200 with torch 2.11)."""
    options = arguments.get("options") or {}
    if arguments.get("mode") in CUDA_GRAPH_MODES or (isinstance(options, Mapping) and options.get("triton.cudagraphs")):
        raise ValueError(
            f"compile_stages={dict(arguments)!r} replays CUDA graphs, whose outputs and saved activations live in "
            "memory the graph's next replay overwrites, and a pipeline keeps several micro-batches of a stage in "
            "flight: compile the stages without them, e.g. compile_stages={'mode': 'max-autotune-no-cudagraphs'} "
            "or compile_stages=True (torch.compile's default mode)")


def _frozen(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, Mapping) else value


def compile_arguments(compile_stages: bool | tuple[tuple[str, Any], ...]) -> dict[str, Any] | None:
    """The arguments to compile each stage's graph with, ``None``: run it uncompiled."""
    if compile_stages is False:
        return None
    if compile_stages is True:
        return {}
    return {k: dict(v) if k == "options" and isinstance(v, tuple) else v for k, v in compile_stages}


@dataclasses.dataclass(frozen=True)
class ProcessOptions:
    """How stages as processes run (the strategy's ``schedule=`` and what goes with it).

    ``schedule``: torch's schedule by name, or ``"auto"`` (the planner weighs each);
    ``virtual_stages``: stages per process for the interleaved schedules; ``pipeline_ranks``:
    processes per pipeline (``None``: every rank; ``"auto"``: the planner weighs each layout);
    ``replication``: how a stage is kept in step with its replicas (``"ddp"`` or ``"fsdp"``);
    ``layout_trials``: how many of the layouts predicted fastest the ranks time on the first batch;
    ``calibrate_steps``: time the actions of the first training steps and plan again on them.
    """

    schedule: str
    virtual_stages: int | None = None
    pipeline_ranks: int | str | None = None
    replication: str = "ddp"
    layout_trials: int = 1
    calibrate_steps: bool = True

    def __post_init__(self) -> None:
        if self.replication not in REPLICATIONS:
            raise ValueError(f"replication={self.replication!r} is not one of {', '.join(map(repr, REPLICATIONS))}")
        check_count("layout_trials", self.layout_trials, "how many of the layouts predicted fastest to time on the "
                    "first batch")
        searched = self.schedule == AUTO
        for name in SCHEDULE_NAMES if searched else (self.schedule,):  # a clear error for what torch cannot run
            process_schedule(name, self.virtual_stages if not searched or name in ("interleaved-1f1b", "zb-h1")
                             else None)

    @property
    def searched(self) -> bool:
        """Whether the planner chooses the layout or the schedule."""
        return AUTO in (self.schedule, self.pipeline_ranks)

    @property
    def memory_schedule(self) -> str:
        """The schedule the planner charges each stage's memory and step by (:mod:`.schedule`):
        GPipe's, or 1F1B's for torch's others (where the planner weighs them, the first weighed)."""
        return "gpipe" if self.schedule in ("gpipe", AUTO) else "1f1b"


def check_count(name: str, value: Any, what: str) -> None:
    """A clear error naming ``name`` unless ``value`` is a whole number of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} is {what}: a whole number of at least 1, got {value!r}")


#: the strategy's arguments that one runtime ignores, and why: asking for what one would do is an
#: error (``0``, ``False``, ``None``: asking for nothing, which is taken). By runtime: in process
#: (``schedule=None``) and as processes.
FOREIGN_ARGUMENTS: dict[bool, dict[str, str]] = {
    True: {
        "replication": "keeps the stages of processes in step (schedule=); without schedule=, replicas of a "
                       "pipeline are processes kept in step by DDP: leave it out, or give schedule=",
        "virtual_stages": "is for schedule='interleaved-1f1b', 'zb-h1' or 'zbv'",
        "layout_trials": "times the layouts of stages as processes that pipeline_parallel_size='auto' or "
                         "schedule='auto' weighs (schedule=); without schedule= the devices form one pipeline: "
                         "leave it out, or give schedule=",
        "internode_gbps": "is the link between stages as processes on two nodes (schedule=); without schedule= "
                          "every stage of a pipeline is on one node: leave it out, or give schedule=",
    },
    False: {
        "placement": "places stages on a process's devices; with schedule=, each process holds one device: leave "
                     "it out",
        "log_stage_times": "logs the stage times of the in-process runtime; with schedule=, each rank times its "
                           "actions in its first steps (calibrate=): leave it out",
        "rebalance_rounds": "cuts again on the stage times the in-process runtime measures; with schedule=, the "
                            "plan takes its stage times from the ranks' first steps (calibrate=): leave it out",
    },
}


def check_strategy_arguments(arguments: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """Clear errors, when the strategy is made, for its ``arguments`` (every one, by name) that
    contradict each other, have a value of the wrong kind, or ask a runtime for what it would
    ignore (``given``: those that differ from their defaults). The planning settings among them are
    checked by :class:`PipelineOptions` and :class:`ProcessOptions` as they are made."""
    size, placement, schedule = arguments["pipeline_parallel_size"], arguments["placement"], arguments["schedule"]
    in_process = schedule is None
    if arguments["plan"] is not None and arguments["balance"] is not None:
        raise ValueError("give either plan= or balance=, not both")
    if size is not None and size != AUTO and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f'pipeline_parallel_size must be a whole number of at least 1, or "auto", got {size!r}')
    if arguments["layout_trials"] is not None:
        check_count("layout_trials", arguments["layout_trials"], "how many of the layouts predicted fastest to time "
                    "on the first batch (1: the prediction's choice)")
    if in_process and size == AUTO:
        raise ValueError('pipeline_parallel_size="auto" chooses the layout of stages as processes: give schedule= too '
                         '(a name, or "auto" to choose it as well)')
    if placement is not None and (not placement or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in placement)):
        raise ValueError(f"placement must list a device index (0, 1, ...) for each stage, got {placement}")
    if arguments["start_method"] not in START_METHODS:
        methods = ", ".join(map(repr, START_METHODS))
        raise ValueError(f"start_method={arguments['start_method']!r} is not one of {methods} (popen: as Lightning's "
                         "DDP, a new interpreter per process)")
    timeout = arguments["timeout"]
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if timeout is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0):
        raise ValueError(f"timeout is how long a rank waits on another: seconds (> 0) or a timedelta, got {timeout!r}")
    for name, why in FOREIGN_ARGUMENTS[in_process].items():
        if given.get(name) not in (None, False, 0):
            raise ValueError(f"{name}={given[name]!r} {why}")
    if in_process:
        return
    if given.get("recompute") == "except_last":
        raise ValueError("recompute='except_last' is the in-process runtime's; with schedule= use 'always' (every "
                         "stage keeps only its inputs) or 'never'")
    searched = AUTO in (schedule, size)
    if given.get("layout_trials") not in (None, 1) and not searched:
        raise ValueError(f"layout_trials={given['layout_trials']!r} times the layouts the planner weighs: give "
                         'pipeline_parallel_size="auto" or schedule="auto" too, or leave it out')
    if (given.get("plan") is not None or given.get("balance") is not None) and searched:
        raise ValueError('pipeline_parallel_size="auto" and schedule="auto" plan the layout: leave out plan= and '
                         "balance=, or give pipeline_parallel_size= and schedule= as you planned them")
