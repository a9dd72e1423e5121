"""docs/scenarios.md stays true to the schema: its field table is regenerated here and compared."""
from __future__ import annotations

from pathlib import Path

import pytest

from coral.experiments.report import table_problems
from coral.scenario import parse_scenario, resolve
from coral.scenario.fielddoc import BEGIN, END, REGENERATE, field_table, rows, splice
from coral.scenario.schema import ScenarioFile
from coral.scenario.starter import STARTER_YAML

DOC = Path(__file__).resolve().parents[3] / "docs" / "scenarios.md"


def _walk(model, prefix=""):
    """Every field path the schema has, walked independently of the generator."""
    import typing

    from pydantic import BaseModel

    def models(a):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return [a]
        return [m for x in typing.get_args(a) for m in models(x)]

    for name, f in model.model_fields.items():
        yield prefix + name
        subs = models(f.annotation)
        for sub in subs:
            yield from _walk(sub, prefix + name + ".")


def test_field_table_in_the_doc_matches_the_schema():
    doc = DOC.read_text()
    assert BEGIN in doc and END in doc
    current = doc.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert field_table() == current, f"docs/scenarios.md is out of date with the schema; run `{REGENERATE}`"


def test_field_table_lists_every_field_including_the_workload():
    paths = {p for p, *_ in rows()}
    # the generator's paths, with list / kind markers dropped, are exactly the schema's fields
    plain = {p.replace("[]", "").replace("(none)", "").replace("(step)", "").replace("(diurnal)", "") for p in paths}
    assert set(_walk(ScenarioFile)) == plain
    for field in ("models[].ttft_ms", "models[].workload.rate_per_s", "models[].workload.dataset",
                  "models[].workload.shift(step).at_s", "planner.kv_ttft_share", "slo_attainment", "perf.backend"):
        assert field in paths
    assert [] == table_problems(field_table())


def test_field_table_types_and_defaults():
    by_path = {p: (t, d) for p, t, d, _ in rows()}
    assert ("float (> 0)", "**required**") == by_path["models[].ttft_ms"]
    assert ("int (≥ 1, ≤ 8)", "`6`") == by_path["planner.n_max"]
    assert ("bool", "`false`") == by_path["derive_missing_prices"]
    assert "`roofline` \\| `profile` \\| `helix`" == by_path["perf.backend"][0]


def test_splice_replaces_only_the_generated_block():
    doc = f"head\n{BEGIN}\nold\n{END}\ntail\n"
    assert f"head\n{BEGIN}\nnew\n{END}\ntail\n" == splice(doc, "new")
    with pytest.raises(ValueError, match="lacks the markers"):
        splice("no markers", "new")


def test_the_doc_shows_the_starter_and_the_starter_is_valid():
    doc = DOC.read_text()
    block = doc.split("<!-- starter:begin", 1)[1].split("<!-- starter:end -->", 1)[0]
    assert block.split("```yaml\n", 1)[1].split("```", 1)[0] == STARTER_YAML
    import yaml

    s = resolve(parse_scenario(yaml.safe_load(STARTER_YAML), "starter"))
    assert "my-scenario" == s.name and 4 == s.planner.n_max
    assert "src/coral/scenario/builtin/" in doc  # the built-ins as starting points
