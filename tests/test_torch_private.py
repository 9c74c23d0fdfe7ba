"""torch's private names are imported in one module of the package, lightning_antichain/torch_private.py."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

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
