"""Frontend 4, the last resort: fx tracing with the blocks it cannot trace kept whole.

When symbolic tracing fails inside a submodule, that submodule becomes a leaf (one ``call_module``
operation that runs the user's code as written) and tracing starts again. The graph is coarser
around those blocks but exact, and everything else keeps its fine cut points. Tracing that fails
in the model's own ``forward`` cannot be helped this way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx
from torch import nn

from .errors import FrontendRefused
from .symbolic import capture_symbolic

MAX_LEAVES = 64


def capture_with_leaves(module: nn.Module, leaf_modules: Sequence[type | str] = ()) -> tuple[fx.GraphModule, list[str]]:
    """The fx trace of ``module`` and the submodules that had to be kept whole to get it."""
    leaves = list(leaf_modules)
    made: list[str] = []
    for _ in range(MAX_LEAVES):
        try:
            return capture_symbolic(module, leaves), made
        except FrontendRefused as exc:
            if not exc.module_path or exc.module_path in made:
                raise FrontendRefused(f"fails in {type(module).__name__}.forward itself: {exc.reason}",
                                      location=exc.location) from exc
            leaves.append(exc.module_path)
            made.append(exc.module_path)
    raise FrontendRefused(f"still failing after keeping {MAX_LEAVES} blocks whole: {made[:5]}...")
