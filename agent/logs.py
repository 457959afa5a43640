"""The agent's logging: one line per record on stderr. Each line starts with the local time
unless stderr is the journal (`journal_stderr()`: systemd's JOURNAL_STREAM names stderr's
device and inode), which adds its own.

Owns: `setup(level, timestamps)`. It also turns off the record fields the one-line format
never shows (caller's file and line, thread and process names), as the logging HOWTO's
"Optimization" section describes. Must not import anything of `agent`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

FORMAT = "%(levelname)s %(name)s: %(message)s"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"  # then .mmm, as logging's asctime with msecs


def journal_stderr(environ: Any = None) -> bool:
    """Is stderr connected to the journal (systemd sets JOURNAL_STREAM to its device:inode)?"""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(part) for part in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def setup(level: int, timestamps: bool = False) -> None:
    """Log at `level` to stderr, each line with the time when `timestamps`."""
    logging._srcfile = None  # no findCaller(): the format shows no file or line
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # Python 3.12+ asks asyncio for the current task's name on every record when asyncio is
    # in sys.modules: agent.deferred's stand-in is, and the question would load the real
    # asyncio (with ssl and OpenSSL) that the agent never uses. It runs no tasks.
    logging.logAsyncioTasks = False
    stream = logging.StreamHandler(sys.stderr)
    if timestamps:
        stream.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d " + FORMAT, TIME_FORMAT))
    else:
        stream.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.setLevel(level)
    root.addHandler(stream)
