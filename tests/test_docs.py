"""The docs say what the code does: the options table of docs/strategy.md is the strategy's signature."""

import inspect
import re
from pathlib import Path

from lightning_antichain import AntichainPipelineStrategy

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
                  if name != "self"}
    rows = options_table()
    assert sorted(set(parameters) - set(rows)) == [], "arguments without a row in docs/strategy.md's options table"
    assert sorted(set(rows) - set(parameters)) == [], "rows of docs/strategy.md's options table naming no argument"
    for name, (default, runtime) in rows.items():
        assert default == f"`{parameters[name].default!r}`".replace("'", '"'), (name, default)
        assert runtime in RUNTIMES, (name, runtime)


def test_every_name_taken_out_is_told_in_the_changelog():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for old, new in {"stages": "pipeline_parallel_size", "use_profile_cache": "profile_cache",
                     "checkpoint": "recompute"}.items():
        assert re.search(rf"`{old}=.*`{new}=", changelog), old


def test_every_option_of_the_plan_command_is_in_planner_md_and_every_option_named_there_exists():
    from lightning_antichain.cli import _parser

    commands = next(a for a in _parser()._actions if a.dest == "command")
    options = {flag for action in commands.choices["plan"]._actions for flag in action.option_strings
               if flag.startswith("--") and flag != "--help"}
    section = (ROOT / "docs/planner.md").read_text().split("\n## The command", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"--[a-z][a-z-]*", section))
    assert sorted(options - named) == [], "options of `lightning-antichain plan` docs/planner.md does not name"
    assert sorted(named - options) == [], "options docs/planner.md names that the command does not have"


def test_the_api_reference_is_what_the_code_says():
    import importlib.util

    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "docs/api_reference.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert (ROOT / "docs/api.md").read_text() == generator.reference(), "run python docs/api_reference.py"
