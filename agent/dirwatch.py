"""Watching one directory with inotify (pyinotify), without polling and without blocking, and
waiting the same way for a missing one to appear.

Owns: the inotify watch on a directory and turning its events into `DirEvent`s: a name created,
moved in, deleted or moved out, written and closed, or the directory itself gone; a watcher
names the kinds it wants (`kinds`), and the kernel queues no others, so a busy directory wakes
it only for those (/dev sees a close-after-write each time any process writes to /dev/null).
It exposes a file descriptor for select() and `read()` never blocks. `MissingDir` watches the
nearest existing ancestor of a directory that is not there yet, so nobody looks for it on a
timer. pyinotify (and the asyncore it pulls in) is imported on the first watch, not at start:
the agent registers with kubelet before it watches anything. Used by the registrar (kubelet's
device-plugin directory), the isolation watch (the operators' unhealthy-devices file), the
/dev/char links (/dev) and the Kubernetes faults (the kubeconfig not there yet). Must not
decide anything: callers do. Imports nothing of agent.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import NamedTuple

log = logging.getLogger(__name__)

CREATED = "created"
MOVED_IN = "moved-in"
DELETED = "deleted"
WRITTEN = "written"
DIR_GONE = "dir-gone"
ALL_KINDS = frozenset((CREATED, MOVED_IN, DELETED, WRITTEN))  # DIR_GONE always comes


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
    """inotify on `directory` (which must exist; OSError if it cannot be watched) for the
    events of `kinds` (and DIR_GONE). fileno() for select; read() the events that arrived
    (never blocks); close() when done."""

    def __init__(self, directory: str, kinds: frozenset[str] = ALL_KINDS):
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

        masks = {CREATED: pi.IN_CREATE, MOVED_IN: pi.IN_MOVED_TO,
                 DELETED: pi.IN_DELETE | pi.IN_MOVED_FROM, WRITTEN: pi.IN_CLOSE_WRITE}
        mask = pi.IN_DELETE_SELF | pi.IN_MOVE_SELF
        for kind in kinds:
            mask |= masks[kind]
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


class MissingDir:
    """Waits, with inotify and no timer, for directory `path` (missing now) to appear: it
    watches the nearest ancestor that exists for new names, and a deeper one as each level
    appears. fileno() for select; appeared() once select says it is readable (or at any time):
    whether `path` is a directory now. OSError if no ancestor can be watched."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self._watch: DirWatch | None = None
        self._aim()

    def fileno(self) -> int:
        return self._watch.fileno()

    def appeared(self) -> bool:
        self._watch.read()  # what came does not matter: the path is looked at as it is now
        if os.path.isdir(self.path):
            return True
        self._aim()
        return os.path.isdir(self.path)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def _aim(self) -> None:
        """Watch the nearest existing ancestor (again when a deeper one exists now); a level
        made while the watch was being set up is found by looking once more after it."""
        while True:
            ancestor = _nearest_existing(self.path)
            if self._watch is not None and self._watch.directory == ancestor:
                return
            watch = DirWatch(ancestor, frozenset((CREATED, MOVED_IN)))
            self.close()
            self._watch = watch


def _nearest_existing(path: str) -> str:
    """The deepest ancestor of absolute `path` that is a directory now ("/" at worst)."""
    parent = os.path.dirname(path)
    while parent != path and not os.path.isdir(parent):
        path, parent = parent, os.path.dirname(parent)
    return parent
