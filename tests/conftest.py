import os
import random
import tempfile

import networkx as nx
import pytest
import torch

# Profiles cached by tests (and by the processes they start) go to a scratch directory, not ~/.cache.
os.environ.setdefault("LIGHTNING_ANTICHAIN_CACHE", tempfile.mkdtemp(prefix="lightning-antichain-cache-"))


def pytest_addoption(parser):
    parser.addoption("--gpu-device", default="cuda:0",
                     help="device the gpu-marked tests run on (cpu runs them as a dry run)")


@pytest.fixture
def gpu_device(request) -> torch.device:
    """The device of the ``gpu`` tests; they are skipped when it is a GPU torch cannot see."""
    device = torch.device(request.config.getoption("--gpu-device"))
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        pytest.skip(f"{device} is not available here (torch sees {torch.cuda.device_count()} CUDA devices)")
    return device


@pytest.fixture(autouse=True)
def _one_thread_and_seed():
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()  # Trainer(deterministic=True) sets it for good
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def random_cost_graph(
    seed: int, max_nodes: int = 12, density: float | None = None, with_input: bool = False
) -> nx.DiGraph:
    """A random DAG with random costs; several sources and sinks are common.

    ``with_input`` adds a pinned model input ``x`` feeding a few nodes.
    """
    rng = random.Random(seed)
    n = rng.randint(3, max_nodes)
    p = density if density is not None else rng.uniform(0.15, 0.5)
    graph = nx.DiGraph()
    for v in range(n):
        graph.add_node(
            f"n{v}",
            forward_s=rng.uniform(0.1, 3.0),
            backward_s=rng.uniform(0.1, 3.0),
            output_bytes=rng.randint(1, 50) * 1000,
            param_bytes=rng.randint(0, 20) * 1000,
            buffer_bytes=rng.randint(0, 3) * 100,
            order=v,
        )
    for u in range(n):
        for v in range(u + 1, n):
            if rng.random() < p:
                graph.add_edge(f"n{u}", f"n{v}")
    if with_input:
        graph.add_node("x", pinned=True, output_bytes=rng.randint(1, 50) * 1000, order=-1)
        for v in rng.sample(range(n), k=min(n, rng.randint(1, 3))):
            graph.add_edge("x", f"n{v}")
    return graph


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The zoo's score on each user path, 'N of N', with the frontend that captured each model."""
    import sys

    paths = (("test_zoo", "la.Pipeline (profile, partition, Pipeline), float64 outputs and gradients"),
             ("test_zoo_trainer", "Trainer with the strategy on 2 CPU devices, float64 losses per step"))
    for module, path in paths:
        results = getattr(sys.modules.get(module), "RESULTS", None)
        if not results:
            continue
        passed = sum(1 for v in results.values() if v != "failed")
        detail = ", ".join(f"{k} ({v})" for k, v in sorted(results.items()))
        terminalreporter.write_line(f"model zoo: {passed} of {len(results)} through {path}")
        terminalreporter.write_line(f"  {detail}")
    ran = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])
           if r.when == "call" and "processes" in r.keywords]
    if ran:
        failed = sum(1 for r in ran if r.failed)
        terminalreporter.write_line(f"multi-process tests (-m processes): {len(ran) - failed} of {len(ran)} passed")
