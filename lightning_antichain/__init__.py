"""lightning-antichain: automatic pipeline parallelism for PyTorch Lightning.

Profile a model (:func:`profile`), cut it into balanced stages over its antichain DAG
(:func:`partition`), and inspect the resulting :class:`Plan`.
"""

from .batches.batch_dependence import BatchDependenceError, check_micro_batchable
from .batches.microbatch import MicroBatchError
from .capture import OpGraph, UntraceableModelError, trace
from .capture.assignments import AssignmentError
from .in_process.budget import StageOverBudgetError
from .in_process.pipeline import Pipeline
from .lightning.strategy import AntichainPipelineStrategy, register
from .planner.antichain import StateSpace, build_state_space, enumerate_down_sets
from .planner.cost_graph import CostGraphError, load_cost_graph, save_cost_graph
from .planner.cost_model import CostModel, DeviceSpec, InfeasiblePlanError
from .planner.partition import partition, plan_from_balance
from .planner.profiler import profile
from .planner.public import plan, plan_layout
from .plans.plan import Plan, Stage
from .stages.split import PlanMismatchError
from .weights.checkpoint_files import load_checkpoint
from .weights.empty_init import init_empty_weights
from .weights.materialize import UninitializedTensorError, load_state_dict

__version__ = "0.1.0"

register()  # strategy="antichain_pipeline" works once the package is imported

__all__ = [
    "AntichainPipelineStrategy",
    "AssignmentError",
    "BatchDependenceError",
    "CostGraphError",
    "CostModel",
    "DeviceSpec",
    "InfeasiblePlanError",
    "MicroBatchError",
    "OpGraph",
    "Pipeline",
    "Plan",
    "PlanMismatchError",
    "Stage",
    "StageOverBudgetError",
    "StateSpace",
    "UninitializedTensorError",
    "UntraceableModelError",
    "build_state_space",
    "check_micro_batchable",
    "enumerate_down_sets",
    "init_empty_weights",
    "load_checkpoint",
    "load_cost_graph",
    "load_state_dict",
    "partition",
    "plan",
    "plan_from_balance",
    "plan_layout",
    "profile",
    "save_cost_graph",
    "trace",
]
