"""The ``lightning-antichain`` command's entry point: the arguments are read and checked
(:mod:`.arguments`) before torch, Lightning and the package are imported, so that a mistake in
them is said at once; then :mod:`lightning_antichain.cli` runs the command."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from .arguments import parse

    args = parse(sys.argv[1:] if argv is None else list(argv))
    from lightning_antichain.cli import run

    return run(args)
