"""Modules moved to one folder per idea: their old paths still import the same module, with a warning naming the new."""

import importlib
import subprocess
import sys

import pytest

from lightning_antichain.moved_modules import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_each_old_path_names_a_module_that_exists(old):
    assert importlib.import_module(MOVED[old]).__name__ == MOVED[old]


def test_an_old_path_imports_the_module_where_it_lives_now_with_a_deprecation_warning():
    # a fresh interpreter: an old path imports once per process
    code = """
import warnings
warnings.simplefilter("error", DeprecationWarning)
import lightning_antichain as la
try:
    import lightning_antichain.runtime.pipeline
except DeprecationWarning as warning:
    assert "moved to lightning_antichain.in_process.pipeline" in str(warning), warning
else:
    raise AssertionError("no warning")
warnings.simplefilter("ignore", DeprecationWarning)
from lightning_antichain.runtime.pipeline import Pipeline
from lightning_antichain.runtime import microbatch
from lightning_antichain.lightning.process_runtime import ProcessRuntime
import lightning_antichain.batches.microbatch as now
assert Pipeline is la.Pipeline and microbatch is now
assert ProcessRuntime.__module__ == "lightning_antichain.processes.process_runtime"
assert la.runtime.autograd_bridge is la.in_process.autograd_bridge  # as attributes too
try:
    la.no_such_name
except AttributeError as error:
    assert "no attribute 'no_such_name'" in str(error)
else:
    raise AssertionError("no AttributeError")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
