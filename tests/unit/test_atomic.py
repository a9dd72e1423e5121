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


@pytest.fixture
def umask():
    """Run a test under a chosen umask, restoring the process's afterwards."""
    import os

    saved = os.umask(0o022)
    os.umask(saved)

    def set_(mask):
        os.umask(mask)

    yield set_
    os.umask(saved)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_outputs_follow_the_umask(tmp_path, umask, mask):
    # tempfile makes its files 0600 and folders 0700 whatever the umask; published outputs must
    # get what open() / mkdir give under the umask, as any other tool's outputs would
    umask(mask)
    p = tmp_path / "plan.json"
    write_text(p, "{}")
    assert oct(p.stat().st_mode & 0o777) == oct(0o666 & ~mask)
    out = tmp_path / "run"
    with building_dir(out) as tmp:
        (tmp / "report.md").write_text("r")
        write_text(tmp / "figures" / "a.json", "{}")
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~mask)
    assert oct((out / "report.md").stat().st_mode & 0o777) == oct(0o666 & ~mask)
    assert oct((out / "figures" / "a.json").stat().st_mode & 0o777) == oct(0o666 & ~mask)
    assert oct((out / "figures").stat().st_mode & 0o777) == oct(0o777 & ~mask)


def test_current_umask_matches_os(umask):
    from coral.atomic import current_umask

    umask(0o037)
    assert current_umask() == 0o037
