"""The docs say what the code does: the options table of docs/strategy.md is the strategy's signature."""

import inspect
import re
from pathlib import Path

from lightning_antichain import AntichainPipelineStrategy
from lightning_antichain.lightning.strategy_options import RENAMED

ROOT = Path(__file__).resolve().parent.parent
RUNTIMES = {"both", "in process", "`schedule=`"}


def options_table() -> dict[str, tuple[str, str]]:
    """The rows of docs/strategy.md's options table: argument -> (default, runtime)."""
    section = (ROOT / "docs/strategy.md").read_text().split("\n## Options", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def test_every_argument_of_the_strategy_has_one_row_with_its_default_and_runtime_and_every_row_an_argument():
    parameters = {name: p for name, p in inspect.signature(AntichainPipelineStrategy.__init__).parameters.items()
                  if name != "self" and name not in RENAMED}
    rows = options_table()
    assert sorted(set(parameters) - set(rows)) == [], "arguments without a row in docs/strategy.md's options table"
    assert sorted(set(rows) - set(parameters)) == [], "rows of docs/strategy.md's options table naming no argument"
    for name, (default, runtime) in rows.items():
        assert default == f"`{parameters[name].default!r}`".replace("'", '"'), (name, default)
        assert runtime in RUNTIMES, (name, runtime)


def test_every_old_name_is_told_in_the_changelog():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for old, (new, _, _) in RENAMED.items():
        assert re.search(rf"`{old}=.*`{new}=", changelog), old
