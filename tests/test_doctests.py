"""The examples in docstrings run and give what they show."""

import doctest

import pytest

from lightning_antichain import antichain, graph, plan


@pytest.mark.parametrize("module", [antichain, graph, plan])
def test_docstring_examples(module):
    failures, tried = doctest.testmod(module)
    assert tried > 0 and failures == 0
