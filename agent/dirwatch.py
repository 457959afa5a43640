"""Watching one directory with inotify (pyinotify), without polling and without blocking.

Owns: the inotify watch on a directory and turning its events into `DirEvent`s: a name created,
moved in, deleted or moved out, written and closed, or the directory itself gone. It
exposes a file descriptor for select() and `read()` never blocks. pyinotify (and the asyncore
it pulls in) is imported on the first watch, not at start: the agent registers with kubelet
before it watches anything. Used by the registrar (kubelet's device-plugin directory) and the
isolation watch (the operators' unhealthy-devices file). Must not decide anything: callers do.
Imports nothing of agent.
"""

from __future__ import annotations

import logging
import warnings
from typing import NamedTuple

log = logging.getLogger(__name__)

CREATED = "created"
MOVED_IN = "moved-in"
DELETED = "deleted"
WRITTEN = "written"
DIR_GONE = "dir-gone"


class DirEvent(NamedTuple):
    kind: str  # CREATED, MOVED_IN, DELETED, WRITTEN or DIR_GONE
    name: str  # file name in the directory ("" for DIR_GONE)


def _pyinotify():
    with warnings.catch_warnings():
        # pyinotify imports asyncore, deprecated in 3.11 (pyasyncore provides it from 3.12);
        # it uses none of it here. Keep that warning out of every test run and log.
        warnings.simplefilter("ignore", DeprecationWarning)
        import pyinotify
    return pyinotify


class DirWatch:
    """inotify on `directory` (which must exist; OSError if it cannot be watched). fileno()
    for select; read() the events that arrived (never blocks); close() when done."""

    def __init__(self, directory: str):
        pi = _pyinotify()
        self.directory = directory
        self._events: list[DirEvent] = []
        sink = self._events

        class Collect(pi.ProcessEvent):
            def process_default(self, event) -> None:
                mask = event.mask
                if mask & (pi.IN_DELETE_SELF | pi.IN_MOVE_SELF | pi.IN_IGNORED):
                    sink.append(DirEvent(DIR_GONE, ""))
                elif mask & pi.IN_CREATE:
                    sink.append(DirEvent(CREATED, event.name))
                elif mask & pi.IN_MOVED_TO:
                    sink.append(DirEvent(MOVED_IN, event.name))
                elif mask & (pi.IN_DELETE | pi.IN_MOVED_FROM):
                    sink.append(DirEvent(DELETED, event.name))
                elif mask & pi.IN_CLOSE_WRITE:
                    sink.append(DirEvent(WRITTEN, event.name))

        mask = (pi.IN_CREATE | pi.IN_DELETE | pi.IN_MOVED_FROM | pi.IN_MOVED_TO
                | pi.IN_CLOSE_WRITE | pi.IN_DELETE_SELF | pi.IN_MOVE_SELF)
        self._wm = pi.WatchManager()
        self._notifier = pi.Notifier(self._wm, Collect(), timeout=0)
        try:
            self._wm.add_watch(directory, mask, quiet=False)
        except pi.WatchManagerError as exc:
            self._notifier.stop()
            raise OSError(f"cannot watch {directory} with inotify: {exc}") from None
        log.debug("watching %s with inotify", directory)

    def fileno(self) -> int:
        return self._wm.get_fd()

    def read(self) -> list[DirEvent]:
        """The events queued since the last read, oldest first."""
        while self._notifier.check_events(timeout=0):
            self._notifier.read_events()
            self._notifier.process_events()
        out = list(self._events)
        self._events.clear()
        return out

    def close(self) -> None:
        try:
            self._notifier.stop()
        except OSError as exc:
            log.debug("closing the watch of %s: %s", self.directory, exc)
