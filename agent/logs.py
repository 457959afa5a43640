"""The agent's logging: one line per record on stderr, and a writer thread that takes the hot
path's lines off it. Each line starts with the local time unless stderr is the journal
(`journal_stderr()`: systemd's JOURNAL_STREAM names stderr's device and inode), which adds
its own.

Owns: `setup(level, background, timestamps)` and `later(logger, level, msg, *args)`. Records are written
by the thread that logs them, as usual, except those of `later`: with `background` (the `run`
command) the caller only appends the message and its arguments to a queue, and the
`log-writer` thread formats the lines and writes each burst to stderr with one write (at most
every BATCH_S while lines come, never while none do; in the format of every other line, not
through logging's handlers). That is for the INFO line every Allocate writes: it
costs the Allocate a deque append instead of a record, a format and a write (speed-only
code that pays by the rule of docs/benchmarks.md, which measures it each run). Such a line may
appear up to BATCH_S after the lines logged after it. `setup` returns the function that drains
the queue and stops the writer (called on every exit path). It also turns off the record
fields the one-line format never shows (caller's file and line, thread and process names), as
the logging HOWTO's "Optimization" section describes. Arguments given to `later` are
formatted on the writer thread: pass immutable values (strings, numbers). Must not import
anything of `agent`.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

FORMAT = "%(levelname)s %(name)s: %(message)s"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"  # then .mmm, as logging's asctime with msecs
BATCH_S = 0.02  # a woken writer lets a burst gather this long, then writes all of it


class _Writer:
    """The queue of `later` lines and the thread that logs them."""

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="log-writer", daemon=True)

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(5)
        self._drain()

    def _run(self) -> None:
        while not self.stopping:
            self.wake.wait()
            if not self.stopping:
                time.sleep(BATCH_S)
            self.wake.clear()
            self._drain()

    def _drain(self) -> None:
        lines = []
        while self.items:
            logger, level, msg, args, when = self.items.popleft()
            try:
                text = msg % args
            except (TypeError, ValueError) as exc:  # a bad format: say so, keep going
                text = f"unloggable message {msg!r} {args!r}: {exc}"
            line = FORMAT % {"levelname": logging.getLevelName(level), "name": logger.name,
                             "message": text}
            lines.append(line if when is None else f"{_stamp(when)} {line}")
        if lines:  # one write for the burst, in the format of every other line
            try:
                sys.stderr.write("\n".join(lines) + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass  # stderr gone (the journal restarting): nothing to tell it with


_writer: _Writer | None = None
_timestamps = False


def _stamp(when: float) -> str:
    return f"{time.strftime(TIME_FORMAT, time.localtime(when))}.{int(when * 1000) % 1000:03d}"


def journal_stderr(environ: Any = None) -> bool:
    """Is stderr connected to the journal (systemd sets JOURNAL_STREAM to its device:inode)?"""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(part) for part in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def later(logger: logging.Logger, level: int, msg: str, *args: Any) -> None:
    """`logger.log(level, msg, *args)`, with the record made on the writer thread when there
    is one (the arguments must not change afterwards)."""
    if not logger.isEnabledFor(level):
        return
    writer = _writer
    if writer is None:
        logger.log(level, msg, *args)
        return
    writer.items.append((logger, level, msg, args, time.time() if _timestamps else None))
    if not writer.wake.is_set():  # inline, not a method: every Allocate comes through here
        writer.wake.set()


def setup(level: int, background: bool = False,
          timestamps: bool = False) -> Callable[[], None]:
    """Log at `level` to stderr, each line with the time when `timestamps`; returns what stops
    the writer thread (a no-op without `background`)."""
    global _writer, _timestamps
    _timestamps = timestamps
    logging._srcfile = None  # no findCaller(): the format shows no file or line
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # Python 3.12+ asks asyncio for the current task's name on every record when asyncio is
    # in sys.modules: agent.deferred's stand-in is, and the question would load the real
    # asyncio (with ssl and OpenSSL) that the agent never uses. It runs no tasks.
    logging.logAsyncioTasks = False
    stream = logging.StreamHandler(sys.stderr)
    if _timestamps:
        stream.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d " + FORMAT, TIME_FORMAT))
    else:
        stream.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.setLevel(level)
    root.addHandler(stream)
    if not background:
        return lambda: None
    writer = _Writer()
    writer.thread.start()
    _writer = writer

    def stop() -> None:
        global _writer
        _writer = None
        writer.stop()

    return stop
