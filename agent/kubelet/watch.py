"""Watching kubelet's device-plugin directory with inotify (pyinotify), without polling.

Owns: one inotify watch on the directory that holds kubelet.sock and the plugin sockets, and
turning its events into `DirEvent`s the daemon's loop acts on: kubelet.sock created (kubelet
(re)started: register again), a socket deleted (kubelet restarted and cleaned the directory,
or someone removed ours), the directory itself gone. It exposes a file descriptor for the
daemon's select loop and never blocks. Must not decide anything: the daemon does.
"""

from __future__ import annotations

import logging
import warnings
from typing import NamedTuple

with warnings.catch_warnings():
    # pyinotify imports asyncore, deprecated in 3.11 (pyasyncore provides it from 3.12); it
    # uses none of it here. Keep that warning out of every test run and log.
    warnings.simplefilter("ignore", DeprecationWarning)
    import pyinotify

log = logging.getLogger(__name__)

CREATED = "created"
DELETED = "deleted"
DIR_GONE = "dir-gone"

_MASK = (pyinotify.IN_CREATE | pyinotify.IN_DELETE | pyinotify.IN_MOVED_FROM
         | pyinotify.IN_MOVED_TO | pyinotify.IN_DELETE_SELF | pyinotify.IN_MOVE_SELF)


class DirEvent(NamedTuple):
    kind: str  # CREATED, DELETED or DIR_GONE
    name: str  # file name in the directory ("" for DIR_GONE)


class _Collect(pyinotify.ProcessEvent):
    def my_init(self, sink: list) -> None:
        self.sink = sink

    def process_default(self, event) -> None:
        if event.mask & (pyinotify.IN_DELETE_SELF | pyinotify.IN_MOVE_SELF | pyinotify.IN_IGNORED):
            self.sink.append(DirEvent(DIR_GONE, ""))
        elif event.mask & (pyinotify.IN_CREATE | pyinotify.IN_MOVED_TO):
            self.sink.append(DirEvent(CREATED, event.name))
        elif event.mask & (pyinotify.IN_DELETE | pyinotify.IN_MOVED_FROM):
            self.sink.append(DirEvent(DELETED, event.name))


class SocketDirWatch:
    """inotify on `directory` (which must exist). fileno() for select; read() the events
    that arrived (never blocks); close() when done."""

    def __init__(self, directory: str):
        self.directory = directory
        self._events: list[DirEvent] = []
        self._wm = pyinotify.WatchManager()
        self._notifier = pyinotify.Notifier(self._wm, _Collect(sink=self._events), timeout=0)
        try:
            self._wm.add_watch(directory, _MASK, quiet=False)
        except pyinotify.WatchManagerError as exc:
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
        except OSError:
            pass
