"""The interface between the strategy and its runtimes stays thin, and the options stay as made.

Read from the package's source: a member added to ``Runtime``, a runtime that writes the
strategy's options, or the base class naming a runtime of its own fails here, whatever the
suites' other tests do.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import lightning_antichain as la
from lightning_antichain.in_process.in_process_runtime import InProcessRuntime
from lightning_antichain.lightning import runtime
from lightning_antichain.lightning.runtime import Holdings, Ranks, Runtime
from lightning_antichain.processes.process_runtime import ProcessRuntime

PACKAGE = Path(la.__file__).parent
MOST_MEMBERS = 15


def members(cls: type) -> set[str]:
    """What ``cls`` defines itself: methods and properties, and the attributes its ``__init__`` sets."""
    defined = {name for name in vars(cls) if not name.startswith("_") or name == "__init__"}
    init = ast.parse(inspect.getsource(cls.__init__).strip().replace("\n    ", "\n"))
    assigned = {t.attr for node in ast.walk(init) if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return defined | assigned


def test_the_runtime_interface_has_at_most_fifteen_members():
    found = members(Runtime)
    assert len(found) <= MOST_MEMBERS, sorted(found)
    assert {"ranks", "holdings", "step", "setup", "teardown", "plan"} <= found
    assert not any("test" in name for name in found)


def test_the_base_names_no_runtime_of_its_own():
    code = [node for node in ast.walk(ast.parse(inspect.getsource(runtime)))
            if isinstance(node, (ast.Name, ast.Attribute, ast.Constant))]
    words = {getattr(n, "id", None) or getattr(n, "attr", None) for n in code} | {
        n.value for n in code if isinstance(n, ast.Constant) and isinstance(n.value, str) and "\n" not in n.value}
    assert not {"InProcessRuntime", "ProcessRuntime"} & words
    assert not any(isinstance(w, str) and "schedule=" in w for w in words), "a message that knows one runtime"


def test_both_runtimes_answer_each_question_through_the_same_two_objects():
    for cls in (InProcessRuntime, ProcessRuntime):
        source = inspect.getsource(cls.__init__)
        assert "super().__init__(strategy," in source
    strategy = la.AntichainPipelineStrategy()
    assert isinstance(strategy._runtime.ranks, Ranks) and type(strategy._runtime.holdings) is Holdings
    strategy = la.AntichainPipelineStrategy(schedule="1f1b")
    assert isinstance(strategy._runtime.ranks, Ranks) and strategy._runtime.holdings.sharded_by_default


def test_only_the_strategy_sets_its_options_when_made_and_once_per_run():
    writes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "options":
                    owner = target.value.id if isinstance(target.value, ast.Name) else ast.unparse(target.value)
                    writes.append((path.relative_to(PACKAGE).as_posix(), owner))
    strategy_writes = [w for w in writes if w[0] == "lightning/strategy.py"]
    assert len(strategy_writes) == 2, strategy_writes  # when made, and once per run in setup()
    others = [w for w in writes if w[0] != "lightning/strategy.py"]
    assert all(owner == "self" for _, owner in others), others  # an object's own, in its __init__
