"""Writing outputs so that nothing is ever half-written: a file or a whole folder is built under
a temporary name beside its destination and moved into place in one rename."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder, then rename."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file name beside `path` for writers that want a file name (pyarrow,
    numpy); on success it replaces `path` in one rename, on error it is removed."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def building_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside `out`; on success it replaces `out` (an existing
    `out` is moved aside first and removed after), on error it is removed and `out` is untouched.
    """
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        yield tmp
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
