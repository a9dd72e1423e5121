"""The `coral` command's layout: one module per command group under `coral/cli/`, the same commands
as before the split, and one way to resolve a model name or config.json path."""
from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from coral.catalog import builtin_model, resolve_model_spec
from coral.cli import main
from coral.errors import UnknownNameError

SRC = Path(__file__).resolve().parents[2] / "src" / "coral"

# module -> the commands it defines (registered on `main` under these names)
GROUP_MODULES = {
    "catalog": ["catalog"], "perf": ["perf"], "scenario": ["scenario"], "calibrate": ["calibrate"],
    "templates": ["templates"], "plan": ["plan"], "simulate": ["simulate", "demo"],
}
# `coral --help` before the split: always there ...
CORE_COMMANDS = ["calibrate", "catalog", "demo", "experiment", "export", "perf", "plan", "scenario", "simulate",
                 "templates"]
# ... and the ones needing the runtime extra (torch, zmq), added when it imports
RUNTIME_COMMANDS = ["bench", "keys", "profile", "serve"]


def _runtime_installed() -> bool:
    try:
        importlib.import_module("coral.runtime.deploy.serve_cli")
        importlib.import_module("coral.experiments.profile_cmd")
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("module", sorted(GROUP_MODULES))
def test_each_command_group_has_its_module_and_is_registered_from_it(module: str) -> None:
    mod = importlib.import_module(f"coral.cli.{module}")
    defined = {c.name: c for c in vars(mod).values() if isinstance(c, click.Command)
               and getattr(c.callback, "__module__", None) == mod.__name__}
    for name in GROUP_MODULES[module]:
        assert name in defined, f"coral.cli.{module} does not define `coral {name}`"
        assert main.commands[name] is defined[name]


def test_coral_help_lists_the_same_commands_as_before_the_split() -> None:
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    listed = re.findall(r"^  (\S+)  ", res.output.split("Commands:\n", 1)[1], flags=re.M)
    expected = sorted(CORE_COMMANDS + (RUNTIME_COMMANDS if _runtime_installed() else []))
    assert expected == listed


def test_python_dash_m_coral_cli_runs_main() -> None:
    assert (SRC / "cli" / "__main__.py").read_text().count("main()") == 1
    assert importlib.import_module("coral.cli").main is main


def test_one_resolve_model_spec_and_nothing_else_tells_names_from_paths() -> None:
    sources = {p: p.read_text() for p in SRC.rglob("*.py")}
    defs = [p for p, text in sources.items() if "def resolve_model_spec(" in text]
    assert [SRC / "catalog" / "models.py"] == defs
    # the test that tells a path from a name, written once
    tells = [p.relative_to(SRC).as_posix() for p, text in sources.items() if 'endswith(".json") or "/" in' in text]
    assert ["catalog/models.py"] == tells
    for user in ("scenario/resolve.py", "cli/perf.py", "cli/templates.py"):
        assert "resolve_model_spec(" in sources[SRC / user], user


def test_command_modules_import_no_private_names_from_the_core() -> None:
    offenders = [f"{p.name}: {node.module}.{alias.name}" for p in sorted((SRC / "cli").glob("*.py"))
                 for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.ImportFrom)
                 and (node.module or "").startswith("coral.") and not (node.module or "").startswith("coral.cli")
                 for alias in node.names if alias.name.startswith("_")]
    assert [] == offenders


def test_resolve_model_spec_reads_built_ins_and_config_json_paths(tmp_path: Path) -> None:
    assert builtin_model("qwen3-32b") == resolve_model_spec("qwen3-32b")
    folder = tmp_path / "mine"
    folder.mkdir()
    cfg = json.loads((SRC / "catalog" / "data" / "models.json").read_text())["qwen3-32b"]["config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    by_path = resolve_model_spec(str(folder / "config.json"))
    assert "mine" == by_path.name
    relative = resolve_model_spec("mine/config.json", base=tmp_path, name="served-name")
    assert ("served-name", by_path.num_layers) == (relative.name, relative.num_layers)
    with pytest.raises(UnknownNameError, match="unknown model 'qwen3'"):
        resolve_model_spec("qwen3")
