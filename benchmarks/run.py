"""Run a benchmark by its name: the one door to all of them (see :mod:`harness`).

    python benchmarks/run.py --list                   # every benchmark, what it compares, what it needs
    python benchmarks/run.py stage-split --models gpt # one, with its own arguments
    python benchmarks/run.py stage-split --quick      # its small run, where it has one
    python benchmarks/run.py stage-split --help       # its arguments
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import CASES, case  # noqa: E402


def listing() -> str:
    lines = ["| name | needs | compares | script | the package's internals it reads |", "|---|---|---|---|---|"]
    internals = {c.name: c.internals() for c in CASES}
    for c in CASES:
        inside = ", ".join(n.removeprefix("lightning_antichain.") for n in internals[c.name]) or "none: the API only"
        lines.append(f"| {c.name} | {c.needs} | {c.compares} | benchmarks/{c.script} | {inside} |")
    public = sum(not found for found in internals.values())
    return "\n".join([*lines, "", f"{public} of {len(CASES)} go through the public API only"])


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--list":
        print(listing())
        return 0
    chosen, rest = case(argv[0]), argv[1:]
    if rest == ["--quick"]:
        if chosen.quick is None:
            raise SystemExit(f"benchmark {chosen.name!r} has no quick run: give its arguments "
                             f"(python benchmarks/run.py {chosen.name} --help)")
        rest = list(chosen.quick)
    # run from the repository's root, so that the command each prints is the one to type there
    root = chosen.path.parent.parent
    return subprocess.call([sys.executable, str(chosen.path.relative_to(root)), *rest], cwd=root)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
