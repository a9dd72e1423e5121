"""Writing outputs so that nothing is ever half-written: a file or a whole folder is built under
a temporary name beside its destination and moved into place in one rename.

The temporary file and folder come from `tempfile`, which creates them private (0600 / 0700) on
purpose; what we publish is an ordinary output, so its mode is set from the process umask, as
`open()` and `mkdir` would have made it (0644 / 0755 under the usual umask 022)."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

_umask_lock = threading.Lock()


def current_umask() -> int:
    """The process umask (read without changing it where /proc says it; else set and restored)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def write_text(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` via a temporary file in the same folder, then rename.

    The file gets the mode `open()` would give it under the current umask."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all (as `write_text`)."""
    with replacing(path) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file name beside `path` for writers that want a file name (pyarrow,
    numpy); on success it replaces `path` in one rename, with the mode `open()` would give it
    under the current umask; on error it is removed."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def building_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside `out`; on success it replaces `out` (an existing
    `out` is moved aside first and removed after), on error it is removed and `out` is untouched.

    The published folder gets the mode `mkdir` would give it under the current umask; what is
    written inside it keeps its own mode (`open()`, `mkdir` and `write_text` follow the umask)."""
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        yield tmp
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp made it 0700
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

