"""A small file replaced atomically and durably: what the agent's heartbeat and metrics textfile are written with.

A reader (a liveness probe, node_exporter) sees the old file or the new one,
never a mix: the body goes to a temp file in the same directory, is synced
to disk, and is renamed over the path. The caller says what may stand at the
path (`check`, run once more just before the rename) and turns an OSError
into its own error.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable


def replace_file(path: str, body: str, *, mode: int = 0o644, check: Callable[[], None] | None = None) -> None:
    """Replace `path` with `body` (UTF-8, `mode`); OSError when it cannot be written, the temp file removed."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())  # on disk before the name points at it: a crash leaves the old file or the new
        os.chmod(tmp, mode)  # mkstemp makes it 0600; the reader often runs as another user
        if check is not None:
            check()  # again, just before the rename: something may have been planted meanwhile
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
