"""Output files a user names: checked before the work, written atomically.

Every output autopar writes (plans, reports, plots, cluster profiles, launch scripts)
goes through ``write_atomic``: a temporary file from ``tempfile`` in the target's own
directory (so the rename stays on one file system), written, flushed and fsynced, then
renamed over the target, and the directory fsynced. A crash leaves the old file or the
new one, never a torn one. A temporary file is removed on any exception; one left by a
process that was killed outright (SIGKILL runs no cleanup) carries its pid in its name
and is removed by the next write of the same target on the same host.

``check_output`` runs before the work that produces the output, so a bad path fails in
a second instead of after minutes of planning or measuring.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path

from cost_models.errors import ConfigError

_TMP_SUFFIX = ".tmp"
# Temporary names carry host and pid: only this host's dead writers are cleaned up (on a
# shared file system another host's pids mean nothing here).
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


class OutputError(ConfigError):
    """An output path is unusable (missing directory, not writable, a directory, exists)."""


def check_output(path: str | os.PathLike, *, force: bool = False, what: str = "output",
                 flag: str = "--force") -> Path:
    """Raise OutputError unless ``path`` can be written as a file: its directory exists and
    is writable, it is not a directory, and it does not exist unless ``force``."""
    path = Path(path)
    parent = path.parent
    if path.is_dir():
        raise OutputError(f"{what} {path} is a directory; give a file name")
    if not parent.is_dir():
        raise OutputError(f"output directory {parent} does not exist; create it first (for "
                          f"{what} {path})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: directory {parent} is not writable")
    if (path.exists() or path.is_symlink()) and not force:
        raise OutputError(f"{what} {path} exists; pass {flag} to overwrite it")
    return path


def check_output_dir(path: str | os.PathLike, names: Iterable[str], *, force: bool = False,
                     what: str = "output directory", flag: str = "--force") -> Path:
    """Raise OutputError unless ``names`` can be written into directory ``path`` (created
    later if missing, but its parent must exist): none of them exists unless ``force``."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file, not a directory")
    if not path.exists():
        check_output(path, what=what)
        return path
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path} is not writable")
    clash = [n for n in names if (path / n).exists() or (path / n).is_symlink()]
    if clash and not force:
        raise OutputError(
            f"{what} {path} already holds {', '.join(clash)}; pass {flag} to overwrite "
            "(a hand-edited file there would be lost)")
    for n in names:
        if (path / n).is_dir():
            raise OutputError(f"{what} {path}: {n} is a directory; remove it or choose another directory")
    return path


def write_atomic(path: str | os.PathLike, data: str | bytes, *, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one."""
    path = Path(path)
    parent = path.parent
    _remove_stale(parent, path.name)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.{_HOST}.{os.getpid()}.",
                               suffix=_TMP_SUFFIX)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(parent)
    return path


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(parent: Path, name: str) -> None:
    """Remove temporary files of ``name`` whose writer is gone (killed mid-write)."""
    pattern = re.compile(rf"^\.{re.escape(name)}\.{_HOST}\.(\d+)\..+{re.escape(_TMP_SUFFIX)}$")
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for p in entries:
        m = pattern.match(p.name)
        if m and not _alive(int(m.group(1))) and p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another thread of this process may be writing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
