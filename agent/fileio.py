"""Writing the files the agent reads back (checkpoint, health state, status), crash-safely.

Owns: `write_atomic`, the one way such a file is written: a temp file beside it, write, fsync,
rename over the file, fsync of the directory, so that a crash at any point leaves the old file
or the new one, never a mix (the fsyncs left out for a file rebuilt at every start); and
`fsync_dir`. Must not import anything of `agent` but `errors`
and `constants`, nor know what the files hold or log: callers report the OSError.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

# The temp file is the target's path plus this; a crash mid-write leaves at most this file.
TEMP_SUFFIX = ".tmp"
WRITE_BUFFER = 1 << 16


def fsync_dir(directory: str) -> None:
    """Make the directory's entries (a rename, a new or removed name) durable."""
    dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_atomic(path: str, data: bytes | Iterable[bytes], mode: int = 0o600,
                 durable: bool = True) -> None:
    """Replace the file at `path` with `data` (bytes, or pieces of bytes written one after
    another), durably: into `path` + TEMP_SUFFIX, created with exactly `mode` (whatever the
    umask), fsynced, renamed over `path`, then the directory fsynced. `durable=False` skips
    both fsyncs, for a file the agent rewrites from memory at every start (the status): a
    crash of the agent still leaves the old file or the new one, a power loss may leave
    either or an empty one.

    On any failure (an OSError, or an exception raised while producing `data`) the temp file is
    removed and the exception propagates; `path` is then as it was. The temp name is fixed, so
    callers write one path from one thread at a time (a temp file left by a crash is replaced
    by the next write)."""
    tmp = path + TEMP_SUFFIX
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        with open(fd, "wb", buffering=WRITE_BUFFER) as f:
            os.fchmod(fd, mode)  # the umask, or a temp file an earlier write left behind
            if isinstance(data, (bytes, bytearray, memoryview)):
                f.write(data)
            else:
                f.writelines(data)
            f.flush()
            if durable:
                os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # never created, or the directory is gone: nothing to clean
        raise
    if durable:
        fsync_dir(os.path.dirname(path))
