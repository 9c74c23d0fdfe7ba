"""The package's layers, checked from its source: imports point down only, and nothing imports in a circle.

Every ``import`` counts, also those inside functions, since a lazy import is how a circle hides.
The layers, bottom to top, are written in docs/design.md.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_antichain"
LAYERS = ("device", "capture", "blocks", "execution", "planner", "runtimes", "strategy", "application")
#: each folder's layer; the modules below are named alone: a runtime's folder holds the runtime whole,
#: its execution (which the planner measures) below the planner, what runs a LightningModule's steps
#: through it (which plans) above
FOLDER_LAYERS = {"device": "device", "cpu_allocator": "device", "torch_private": "device", "capture": "capture",
                 "plans": "blocks",
                 "batches": "blocks", "weights": "blocks", "measure": "blocks", "stages": "blocks",
                 "in_process": "execution", "processes": "execution", "planner": "planner", "lightning": "runtimes"}
MODULE_LAYERS = {"in_process.in_process_runtime": "runtimes", "in_process.planned_pipeline": "runtimes",
                 "processes.process_runtime": "runtimes", "processes.rank_holdings": "runtimes",
                 "processes.layout_trials": "runtimes", "processes.layout_choice": "runtimes",
                 "processes.rank_run": "runtimes", "processes.rank_layout": "runtimes",
                 "lightning.strategy": "strategy"}
DEVICE_LAYER = "device"
# Device-type tests allowed outside the device layer: the CLI checks what a user typed.
DEVICE_BRANCH_ALLOWED = {"device.py", "cli.py"}
DEVICE_BRANCH = re.compile(
    r"""\.type\s*(==|!=|\bin\b|\bnot\s+in\b)"""  # device.type == "cuda", device.type in (...)
    r"""|\.startswith\(\s*["'](cpu|cuda|mps|xpu)"""  # "cuda:0".startswith("cuda")
    r"""|\btorch\.(cuda|mps|xpu)\."""  # torch.cuda.synchronize(...), torch.cuda.Stream(...)
    r"""|\.is_(cuda|cpu|mps)\b"""
    r"""|\bdevice_type\s*=\s*["']"""
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    layer = MODULE_LAYERS.get(module) or FOLDER_LAYERS.get(module.split(".")[0], "application")
    return LAYERS.index(layer)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports, by their names relative to the package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "lightning_antichain":
                target = node.module.partition(".")[2]
            else:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}".lstrip(".")
                found.add(submodule if submodule in known else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lightning_antichain":
                    found.add(alias.name.partition(".")[2])
    found.discard(module)
    return found


def import_graph() -> nx.DiGraph:
    found = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(found)
    for module, path in found.items():
        for target in imports_of(module, path, set(found)):
            assert target in found, f"{module} imports {target!r}, which is not a module of the package"
            graph.add_edge(module, target)
    return graph


def test_the_walk_sees_the_imports_it_must_judge():
    graph = import_graph()
    assert graph.number_of_nodes() > 40
    # Known edges of each kind: relative, relative to a sibling package, function-level, module import.
    assert graph.has_edge("in_process.pipeline", "in_process.engine")
    assert graph.has_edge("in_process.planned_pipeline", "planner.planning")
    assert graph.has_edge("", "lightning.strategy")
    assert all(layer_of(m) == LAYERS.index("capture") for m in graph if m.startswith("capture"))


def test_no_module_imports_in_a_circle():
    circles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert not circles, f"import circles: {circles}"


def test_imports_point_down_the_layers_only():
    graph = import_graph()
    upward = [f"{a} ({LAYERS[layer_of(a)]}) imports {b} ({LAYERS[layer_of(b)]})"
              for a, b in graph.edges if layer_of(b) > layer_of(a)]
    assert not upward, "\n".join(upward)


def test_the_device_layer_imports_nothing_of_the_package():
    """Nothing but the door to torch's private names, which imports nothing of the package either."""
    graph = import_graph()
    assert set(graph.successors(DEVICE_LAYER)) <= {"torch_private"}
    assert not list(graph.successors("torch_private"))


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_device_layer_branches_on_the_device_type(path: Path):
    if str(path.relative_to(PACKAGE)) in DEVICE_BRANCH_ALLOWED:
        return
    branches = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                if DEVICE_BRANCH.search(line.split("#")[0])]
    assert not branches, "ask lightning_antichain.device instead:\n" + "\n".join(branches)


def test_the_device_branch_pattern_catches_the_usual_forms():
    for line in ('if device.type == "cuda":', 'x.device.type != "cpu"', "if d.type in ('cpu', 'cuda'):",
                 'name.startswith("cuda")', "torch.cuda.synchronize(device)", "if t.is_cuda:"):
        assert DEVICE_BRANCH.search(line), line
    for line in ("capture.type_as(x)", "torch.device(name)", 'node.op == "call_module"'):
        assert not DEVICE_BRANCH.search(line), line


def test_every_lightning_hook_the_strategy_overrides_is_marked_override():
    from lightning.pytorch.strategies import ParallelStrategy

    source = (PACKAGE / "lightning" / "strategy.py").read_text()
    strategy = next(n for n in ast.parse(source).body
                    if isinstance(n, ast.ClassDef) and n.name == "AntichainPipelineStrategy")
    overridden = {f.name: [ast.unparse(d) for d in f.decorator_list] for f in strategy.body
                  if isinstance(f, ast.FunctionDef) and f.name != "__init__" and hasattr(ParallelStrategy, f.name)}
    assert {"setup", "teardown", "training_step", "optimizer_step"} <= set(overridden)
    unmarked = [name for name, decorators in overridden.items()
                if "override" not in decorators and not any(d.endswith(".setter") for d in decorators)]
    assert not unmarked, f"mark these with @override: {unmarked}"
