"""README's layout block and docs list match the tree: every package and top-level module under
src/coral is in the layout block (and nothing there is gone), every page under docs/ is in the
README's docs list and in the docs index, and every `docs/....md` path the repository names exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "coral"
DOCS = ROOT / "docs"

# Pages another change is editing, which name moved pages by their old paths until it lands:
# (page, path it names) pairs allowed to be stale for now. Remove a pair once its page is fixed.
PENDING: set[tuple[str, str]] = set()


def _layout_block() -> str:
    readme = (ROOT / "README.md").read_text()
    after = readme.split("## Layout\n", 1)[1]
    return after.split("```\n", 2)[1]


def layout_entries(block: str) -> set[str]:
    """The paths the layout block lists, relative to src/coral: an entry is a line's first word ending
    in `/` or `.py`, at depth 1 (two spaces in) or 2 (four spaces in, under the last depth-1 entry)."""
    out: set[str] = set()
    parent = ""
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m or not (m[2].endswith("/") or m[2].endswith(".py")):
            continue
        if len(m[1]) == 2:
            parent = m[2]
            out.add(parent)
        elif len(m[1]) == 4:
            out.add(parent + m[2])
    return out


def tree_entries() -> set[str]:
    """Every package (a folder with `__init__.py`, at any depth) and every module directly under
    src/coral, as the layout block names them; and `data/`, the shipped data."""
    packages = {str(p.parent.relative_to(SRC)) + "/" for p in SRC.rglob("__init__.py") if p.parent != SRC}
    modules = {p.name for p in SRC.glob("*.py")}
    return packages | modules | {"data/"}


def test_layout_entries_parse_nesting() -> None:
    block = "src/coral/\n  a.py     one\n  pkg/     two\n    sub/   three\n               more/ words\n"
    assert {"a.py", "pkg/", "pkg/sub/"} == layout_entries(block)


def test_readme_layout_lists_every_package_and_module() -> None:
    listed, tree = layout_entries(_layout_block()), tree_entries()
    assert set() == tree - listed, "add these to README.md's layout block"
    assert set() == listed - tree, "README.md's layout block lists these, which src/coral no longer has"


def doc_pages() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md")}


def test_readme_and_the_index_list_every_doc() -> None:
    readme = (ROOT / "README.md").read_text().split("## Layout\n", 1)[1]
    named = set(re.findall(r"docs/[\w/.-]+\.md", readme))
    assert set() == doc_pages() - named, "add these to README.md's docs list"
    index = (DOCS / "README.md").read_text()
    linked = {str((DOCS / link).resolve().relative_to(ROOT)) for link in re.findall(r"\]\(([^)#]+\.md)\)", index)}
    assert set() == doc_pages() - linked - {"docs/README.md"}, "link these from docs/README.md"
    assert set() == linked - doc_pages(), "docs/README.md links pages that do not exist"


def _text_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", *DOCS.rglob("*.md")]
    for folder, pattern in (("src", "*.py"), ("tests", "*.py"), ("tests", "*.txt"), ("tools", "*.py"),
                            ("bench", "*.py"), ("examples", "*.yaml"), ("src", "*.csv"), ("src", "*.md")):
        files += (ROOT / folder).rglob(pattern)
    return [f for f in files if f.is_file() and f != Path(__file__)]  # this file names PENDING's old paths


def test_every_named_doc_exists() -> None:
    stale = set()
    for path in _text_files():
        for named in set(re.findall(r"(?<![\w/.-])docs/[\w/.-]*\w\.md", path.read_text(errors="replace"))):
            page = str(path.relative_to(ROOT))
            if not (ROOT / named).is_file() and (page, named) not in PENDING:
                stale.add((page, named))
    assert set() == stale
