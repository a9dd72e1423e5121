"""Outputs are never half-written: a failure leaves the old file or folder as it was."""
import pytest

from coral.atomic import building_dir, write_text


def test_write_text_replaces_whole(tmp_path):
    p = tmp_path / "a" / "plan.json"
    write_text(p, "one")
    write_text(p, "two")
    assert p.read_text() == "two"
    assert [x.name for x in p.parent.iterdir()] == ["plan.json"]


def test_building_dir_publishes_or_leaves_old(tmp_path):
    out = tmp_path / "run"
    with building_dir(out) as tmp:
        (tmp / "report.md").write_text("first")
    assert (out / "report.md").read_text() == "first"
    with pytest.raises(RuntimeError), building_dir(out) as tmp:
        (tmp / "report.md").write_text("half")
        raise RuntimeError("interrupted")
    assert (out / "report.md").read_text() == "first"  # untouched
    assert [x.name for x in tmp_path.iterdir()] == ["run"]  # no temporary left behind
    with building_dir(out) as tmp:
        (tmp / "summary.json").write_text("{}")
    assert sorted(x.name for x in out.iterdir()) == ["summary.json"]  # replaced whole
