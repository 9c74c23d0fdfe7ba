"""Old module paths, kept working with a deprecation warning after the modules moved to one folder per idea.

``import lightning_antichain.runtime.pipeline`` (and every other moved name) imports the module
from where it lives now (``lightning_antichain.in_process.pipeline``), the same module object,
and warns once with the new path. The public names (``la.*``) never moved.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

#: each old module path and where the module lives now
MOVED: dict[str, str] = {
    "lightning_antichain.lightning.global_norm": "lightning_antichain.processes.global_norm",
    "lightning_antichain.lightning.in_process_runtime": "lightning_antichain.in_process.in_process_runtime",
    "lightning_antichain.lightning.micro_batch_steps": "lightning_antichain.processes.micro_batch_steps",
    "lightning_antichain.lightning.planned_pipeline": "lightning_antichain.in_process.planned_pipeline",
    "lightning_antichain.lightning.process_runtime": "lightning_antichain.processes.process_runtime",
    "lightning_antichain.lightning.rank_faults": "lightning_antichain.processes.rank_faults",
    "lightning_antichain.lightning.replica_batches": "lightning_antichain.processes.replica_batches",
    "lightning_antichain.lightning.same_batches": "lightning_antichain.processes.same_batches",
    "lightning_antichain.lightning.small_broadcast": "lightning_antichain.processes.small_broadcast",
    "lightning_antichain.lightning.step_logs": "lightning_antichain.processes.step_logs",
    "lightning_antichain.runtime.action_clock": "lightning_antichain.measure.action_clock",
    "lightning_antichain.runtime.autograd_bridge": "lightning_antichain.in_process.autograd_bridge",
    "lightning_antichain.runtime.batch_dims": "lightning_antichain.batches.batch_dims",
    "lightning_antichain.runtime.batchnorm": "lightning_antichain.stages.batchnorm",
    "lightning_antichain.runtime.budget": "lightning_antichain.in_process.budget",
    "lightning_antichain.runtime.captures": "lightning_antichain.in_process.captures",
    "lightning_antichain.runtime.checkpoint_files": "lightning_antichain.weights.checkpoint_files",
    "lightning_antichain.runtime.cpu_threads": "lightning_antichain.measure.cpu_threads",
    "lightning_antichain.runtime.cut_probe": "lightning_antichain.processes.cut_probe",
    "lightning_antichain.runtime.cut_sizes": "lightning_antichain.processes.cut_sizes",
    "lightning_antichain.runtime.cut_values": "lightning_antichain.processes.cut_values",
    "lightning_antichain.runtime.empty_init": "lightning_antichain.weights.empty_init",
    "lightning_antichain.runtime.engine": "lightning_antichain.in_process.engine",
    "lightning_antichain.runtime.initialization": "lightning_antichain.weights.initialization",
    "lightning_antichain.runtime.layout": "lightning_antichain.plans.layout",
    "lightning_antichain.runtime.link_speed": "lightning_antichain.measure.link_speed",
    "lightning_antichain.runtime.materialize": "lightning_antichain.weights.materialize",
    "lightning_antichain.runtime.microbatch": "lightning_antichain.batches.microbatch",
    "lightning_antichain.runtime.model_loss": "lightning_antichain.batches.model_loss",
    "lightning_antichain.runtime.op_clock": "lightning_antichain.measure.op_clock",
    "lightning_antichain.runtime.optimizer_state": "lightning_antichain.weights.optimizer_state",
    "lightning_antichain.runtime.options": "lightning_antichain.plans.options",
    "lightning_antichain.runtime.output_join": "lightning_antichain.batches.output_join",
    "lightning_antichain.runtime.pipeline": "lightning_antichain.in_process.pipeline",
    "lightning_antichain.runtime.plan": "lightning_antichain.plans.plan",
    "lightning_antichain.runtime.process_pipeline": "lightning_antichain.processes.process_pipeline",
    "lightning_antichain.runtime.process_schedules": "lightning_antichain.plans.process_schedules",
    "lightning_antichain.runtime.process_stages": "lightning_antichain.processes.process_stages",
    "lightning_antichain.runtime.projection": "lightning_antichain.in_process.projection",
    "lightning_antichain.runtime.randomness": "lightning_antichain.stages.randomness",
    "lightning_antichain.runtime.replication": "lightning_antichain.processes.replication",
    "lightning_antichain.runtime.saved_tensors": "lightning_antichain.measure.saved_tensors",
    "lightning_antichain.runtime.schedule": "lightning_antichain.plans.schedule",
    "lightning_antichain.runtime.sharded_checkpoint": "lightning_antichain.weights.sharded_checkpoint",
    "lightning_antichain.runtime.split": "lightning_antichain.stages.split",
    "lightning_antichain.runtime.stage_reduction": "lightning_antichain.in_process.stage_reduction",
    "lightning_antichain.runtime.tied_copies": "lightning_antichain.stages.tied_copies",
    "lightning_antichain.runtime.tied_parameters": "lightning_antichain.processes.tied_parameters",
    "lightning_antichain.runtime.worker": "lightning_antichain.in_process.worker",
}
#: packages that held moved modules and no longer exist
GONE_PACKAGES = ("lightning_antichain.runtime",)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str | None) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.new is None:  # a package that is gone: empty, its submodules found again here
            module = types.ModuleType(spec.name)
            module.__path__ = []
            module.__getattr__ = functools.partial(_submodule, spec.name)  # type: ignore[method-assign]
            return module
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there (the old path will go)",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name in MOVED:
            return importlib.machinery.ModuleSpec(name, _Alias(MOVED[name]))
        if name in GONE_PACKAGES:
            return importlib.machinery.ModuleSpec(name, _Alias(None), is_package=True)
        return None


def _submodule(package: str, name: str) -> types.ModuleType:
    """``package.name`` as an attribute of a package that is gone (``la.runtime.pipeline``)."""
    if f"{package}.{name}" not in MOVED:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(f"{package}.{name}")


def gone_package(name: str) -> types.ModuleType:
    """The package ``lightning_antichain.name`` that is gone, as an attribute of the package."""
    full = f"lightning_antichain.{name}"
    if full not in GONE_PACKAGES:
        raise AttributeError(f"module 'lightning_antichain' has no attribute {name!r}")
    return importlib.import_module(full)


def install() -> None:
    """Let the old paths import (called when the package is imported)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # before any finder that still sees an old copy
