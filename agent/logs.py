"""The agent's logging: one line per record on stderr (journald adds the time), written by a
background thread while the daemon runs.

Owns: `setup(level, background)`. With `background` (the `run` command), a record costs the
thread that logs it only its creation and a queue put: formatting and the write to stderr
happen on a logging.handlers.QueueListener thread, so the INFO line every Allocate writes costs microseconds
on the hot path; `setup` returns the function that drains the queue and stops the writer
(called on every exit path). It also turns off the record fields the one-line format never
shows (caller's file and line, process name), as the logging HOWTO's "Optimization" section
describes. Messages are formatted later, on the writer thread: log immutable values (strings,
numbers), never a list or dict that changes after the call. Must not import anything of `agent`.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
import sys
from typing import Callable

FORMAT = "%(levelname)s %(name)s: %(message)s"


class _Enqueue(logging.handlers.QueueHandler):
    """Hands the record over as it is: the writer thread formats it (QueueHandler's own
    prepare() would format here, on the caller's thread)."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


def setup(level: int, background: bool = False) -> Callable[[], None]:
    """Log at `level` to stderr; returns what stops the writer thread (a no-op without
    `background`)."""
    logging._srcfile = None  # no findCaller(): the format shows no file or line
    logging.logProcesses = False
    logging.logMultiprocessing = False
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.setLevel(level)
    if not background:
        root.addHandler(stream)
        return lambda: None
    q: queue.SimpleQueue = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(q, stream)
    root.addHandler(_Enqueue(q))
    listener.start()
    return listener.stop
