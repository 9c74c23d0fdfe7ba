"""The examples in docstrings run and give what they show."""

import doctest

import pytest

from lightning_antichain.planner import antichain
from lightning_antichain.planner import cost_graph as graph
from lightning_antichain.plans import schedule


@pytest.mark.parametrize("module", [antichain, graph, schedule])
def test_docstring_examples(module):
    failures, tried = doctest.testmod(module)
    assert tried > 0 and failures == 0
