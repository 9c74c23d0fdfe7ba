"""torch's private names are imported in one module of the package, lightning_antichain/torch_private.py."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import torch

import lightning_antichain

PACKAGE = Path(lightning_antichain.__file__).resolve().parent
ADAPTER = PACKAGE / "torch_private.py"


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def torch_private_names(source: str) -> list[str]:
    """The dotted names from ``torch`` in ``source``'s code (not its strings or comments) with a
    private part (``torch._ops.OpOverload``, ``torch.utils._pytree``), and the private names it
    imports from torch (``from torch.nn.modules.batchnorm import _BatchNorm``)."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type in (tokenize.NAME, tokenize.OP, tokenize.NEWLINE)]
    found, i = [], 0
    while i < len(tokens):
        if tokens[i].type == tokenize.NAME and tokens[i].string == "torch" and (
                i == 0 or tokens[i - 1].string != "."):
            parts, j = ["torch"], i + 1
            while j + 1 < len(tokens) and tokens[j].string == "." and tokens[j + 1].type == tokenize.NAME:
                parts.append(tokens[j + 1].string)
                j += 2
            if any(_private(p) for p in parts):
                found.append(".".join(parts))
            if i > 0 and tokens[i - 1].string == "from" and j < len(tokens) and tokens[j].string == "import":
                k = j + 1
                while k < len(tokens) and tokens[k].type != tokenize.NEWLINE:
                    if tokens[k].type == tokenize.NAME and _private(tokens[k].string) and tokens[k - 1].string != "as":
                        found.append(f"{'.'.join(parts)}.{tokens[k].string}")
                    k += 1
            i = j
        else:
            i += 1
    return found


def test_the_detector_finds_private_names_in_code_and_not_in_strings():
    source = ("import torch.utils._pytree as pytree\nfrom torch._ops import OpOverload\n"
              "from torch.nn.modules.batchnorm import _BatchNorm as Base\nx = torch._assert\n"
              "y = torch.ops.aten._grouped_mm\nz = torch.nn.functional.linear\n'torch._dynamo'  # torch._x\n"
              "v = torch.__version__\n")
    assert torch_private_names(source) == ["torch.utils._pytree", "torch._ops", "torch.nn.modules.batchnorm._BatchNorm",
                                           "torch._assert", "torch.ops.aten._grouped_mm"]


def test_no_module_but_the_adapter_names_torch_s_private_api():
    found = {str(path.relative_to(PACKAGE)): names for path in sorted(PACKAGE.rglob("*.py")) if path != ADAPTER
             if (names := torch_private_names(path.read_text()))}
    assert found == {}, f"torch's private names outside torch_private.py: {found}"
    assert torch_private_names(ADAPTER.read_text())  # the adapter is where they are


def pipelining_private_members() -> set[str]:
    """The private members torch's pipelining objects have (its schedules' ``_has_backward``,
    ``_step_microbatches``, its stages' ``_forward_metadata_inference``): what its source assigns
    to ``self._name`` or defines as ``def _name``."""
    names: set[str] = set()
    for path in (Path(torch.__file__).parent / "distributed" / "pipelining").rglob("*.py"):
        source = path.read_text()
        names |= set(re.findall(r"self\.(_[a-z]\w*)\s*[:=]", source))
        names |= set(re.findall(r"^\s+def (_[a-z]\w*)\(", source, re.M))
    return names


def private_members_read(source: str, members: set[str]) -> list[str]:
    """``owner.member`` in ``source``'s code for each ``member`` of ``members`` read on an owner
    other than ``self`` or ``cls`` (a torch object's, where the package's own classes name theirs
    through ``self``)."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type in (tokenize.NAME, tokenize.OP)]
    return [f"{tokens[i - 2].string}.{tokens[i].string}" for i in range(2, len(tokens))
            if tokens[i].type == tokenize.NAME and tokens[i].string in members and tokens[i - 1].string == "."
            and tokens[i - 2].string not in ("self", "cls")]


def test_the_member_detector_finds_torch_s_private_members_on_other_objects():
    members = pipelining_private_members()
    assert {"_has_backward", "_step_microbatches", "_forward_metadata_inference"} <= members
    source = "runner._has_backward = False\nself._has_backward = True\nx = '._step_microbatches'\nrunner.step()\n"
    assert private_members_read(source, members) == ["runner._has_backward"]


def test_no_module_but_the_adapter_reads_private_members_of_torch_s_pipelining_objects():
    members = pipelining_private_members()
    found = {str(path.relative_to(PACKAGE)): names for path in sorted(PACKAGE.rglob("*.py")) if path != ADAPTER
             if (names := private_members_read(path.read_text(), members))}
    assert found == {}, f"private members of torch's schedules and stages read outside torch_private.py: {found}"
