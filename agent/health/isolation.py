"""Manual isolation: the operators' unhealthy-devices file, watched with inotify (agent.dirwatch).

Owns: reading `{"index": [...], "uuid": [...]}` (`agent.health.unhealthyDevicesFile`, default
agent.constants.DEFAULT_ISOLATION_FILE), which
devices an isolation set names (a GPU index or UUID names every device that GPU backs; a MIG
index "G:M" or MIG UUID names that instance), and a thread that re-reads the file whenever it
is written, renamed into place or removed in its directory, and hands the new set (or the
problem with it) to a callback. It sleeps between changes, also while the directory is missing
(its appearance is watched: agent.dirwatch.MissingDir). A missing file isolates nothing; a malformed one is reported
and the previous set stays. Must not touch devices or NVML: the monitor applies the set.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import threading
from collections.abc import Iterable
from typing import Callable, NamedTuple

from agent.dirwatch import CREATED, DIR_GONE, DirWatch, MissingDir
from agent.errors import IsolationError

log = logging.getLogger(__name__)

# After an unexpected error, or when not even the directory's appearance can be watched, look
# again this often.
RETRY_S = 2.0
_INDEX = r"^\d+(:\d+)?$"
_UUID = r"^(GPU|MIG)-[0-9A-Za-z/-]+$"


class Isolation(NamedTuple):
    """What the file names: GPU/MIG indexes (as text) and GPU/MIG UUIDs."""

    indexes: frozenset[str] = frozenset()
    uuids: frozenset[str] = frozenset()

    def names(self, device) -> bool:
        """Does this set name `device` (an agent.rm.devices.Device)?"""
        return (device.index in self.indexes or str(device.gpu_index) in self.indexes
                or device.id in self.uuids or device.gpu_uuid in self.uuids)

    def unknown(self, devices: Iterable) -> list[str]:
        """Entries that name none of `devices` (typos, GPUs of another node)."""
        devices = list(devices)
        known = {d.index for d in devices} | {str(d.gpu_index) for d in devices}
        known |= {d.id for d in devices} | {d.gpu_uuid for d in devices}
        return sorted((self.indexes | self.uuids) - known)

    def __bool__(self) -> bool:
        return bool(self.indexes or self.uuids)


def parse(text: str, path: str) -> Isolation:
    """The isolation set in `text` (the file at `path`); IsolationError saying what is wrong.
    Blank text isolates nothing (a file being emptied)."""
    if not text.strip():
        return Isolation()
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise IsolationError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise IsolationError(f"{path}: expected a JSON object like "
                             f"{{\"index\": [0, 3], \"uuid\": [\"GPU-...\"]}}, got "
                             f"{type(doc).__name__}")
    unknown = sorted(set(doc) - {"index", "uuid"})
    if unknown:
        raise IsolationError(f"{path}: unknown key {unknown[0]!r}; the keys are \"index\" and "
                             f"\"uuid\"")
    indexes, uuids = set(), set()
    for i, item in enumerate(_list(doc, "index", path)):
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            indexes.add(str(item))
        elif isinstance(item, str) and re.match(_INDEX, item.strip()):
            indexes.add(item.strip())
        else:
            raise IsolationError(f"{path}: index[{i}]: {item!r} is not a GPU index (3) or a MIG "
                                 f"index (\"3:1\")")
    for i, item in enumerate(_list(doc, "uuid", path)):
        if isinstance(item, str) and re.match(_UUID, item.strip()):
            uuids.add(item.strip())
        else:
            raise IsolationError(f"{path}: uuid[{i}]: {item!r} is not a GPU- or MIG- UUID")
    return Isolation(frozenset(indexes), frozenset(uuids))


def _list(doc: dict, key: str, path: str) -> list:
    value = doc.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise IsolationError(f"{path}: {key}: expected a list, got {type(value).__name__}")
    return value


def read(path: str) -> Isolation:
    """The set the file at `path` holds now (none when it does not exist)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return Isolation()
    except (OSError, UnicodeDecodeError) as exc:
        raise IsolationError(f"cannot read {path}: {exc}") from None
    return parse(text, path)


class IsolationWatch:
    """A thread that calls on_change(isolation, None) after each change of the file at `path`,
    or on_change(None, error) when it is malformed (once per change: a rewrite that changes
    nothing calls nothing). `start()` reads it once, in the caller's thread, so the first set
    is in force before start() returns; `watch()` starts the thread, which watches the
    directory and reads the file again (what changed in between is not missed). Two steps:
    the agent's start reads before its first registration and watches after it, since
    pyinotify's import and its search for libc (`ldconfig -p`, a process) would take the CPU
    from the registration for about 10 ms."""

    def __init__(self, path: str, on_change: Callable[[Isolation | None, str | None], None]):
        self.path = path
        self.directory = os.path.dirname(path) or "."
        self.name = os.path.basename(path)
        self.on_change = on_change
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._watch_: DirWatch | None = None
        self._missing: MissingDir | None = None  # the directory's appearance, while it is not there
        self._thread: threading.Thread | None = None
        self._missing_logged = False
        self._last: tuple[Isolation | None, str | None] | None = None  # as on_change got it

    def start(self) -> None:
        """Read the file now, in this thread."""
        self.reload()

    def watch(self) -> None:
        """Follow the file from now on (its thread); once started, a call does nothing."""
        if self._thread is None and self._stop_r >= 0:
            self._thread = threading.Thread(target=self._run, name="health-isolation",
                                            daemon=True)
            self._thread.start()

    def reload(self) -> None:
        try:
            now: tuple[Isolation | None, str | None] = (read(self.path), None)
        except IsolationError as exc:
            now = (None, str(exc))
        if now != self._last:
            self._last = now
            self.on_change(*now)

    def _watch(self) -> bool:
        """Watch the file's directory; True once it is watched."""
        if self._watch_ is not None:
            return True
        if not self._directory_there():
            return False
        try:
            self._watch_ = DirWatch(self.directory)
        except OSError as exc:
            log.warning("%s; looking again every %g s", exc, RETRY_S)
            return False
        log.info("watching the isolation file %s", self.path)
        self._missing_logged = False
        return True

    def _directory_there(self) -> bool:
        """Whether the file's directory exists; while it does not, its appearance is waited
        for with inotify (MissingDir), or looked for every RETRY_S if even that fails."""
        if not os.path.isdir(self.directory) and self._missing is None:
            try:
                self._missing = MissingDir(self.directory)
            except OSError as exc:
                if not self._missing_logged:
                    log.info("isolation file directory %s does not exist; looking for it every "
                             "%g s (%s)", self.directory, RETRY_S, exc)
                    self._missing_logged = True
                return False
        if self._missing is not None and not self._missing.appeared():
            if not self._missing_logged:
                log.info("isolation file directory %s does not exist; watching for it",
                         self.directory)
                self._missing_logged = True
            return False
        self._stop_waiting()
        return True

    def _stop_waiting(self) -> None:
        if self._missing is not None:
            self._missing.close()
        self._missing = None

    def _unwatch(self) -> None:
        if self._watch_ is not None:
            self._watch_.close()
        self._watch_ = None
        self._stop_waiting()

    def _run(self) -> None:
        first = True
        while True:
            try:
                if first:  # the watch, made here (see the class), then the file read again
                    first = False
                    if self._watch():
                        self.reload()
                if self._step():
                    return
            except Exception:  # the loop boundary: a dead watch would ignore every edit
                log.exception("isolation watch: unexpected error; going on in %g s", RETRY_S)
                if select.select([self._stop_r], [], [], RETRY_S)[0]:
                    return

    def _step(self) -> bool:
        """Wait for a change and act on it; True when asked to stop. It sleeps until inotify
        (the directory, or its appearance) or stop() wakes it: no timer but RETRY_S when
        neither can be watched."""
        waiting_on = self._watch_ or self._missing
        fds = [self._stop_r] + ([waiting_on.fileno()] if waiting_on is not None else [])
        ready, _, _ = select.select(fds, [], [], None if waiting_on is not None else RETRY_S)
        if self._stop_r in ready:
            return True
        if self._watch_ is None:
            if self._watch():
                self.reload()  # the directory appeared: the file may be there already
            return False
        if not ready:
            return False
        events = self._watch_.read()
        gone = any(e.kind == DIR_GONE for e in events)
        if gone:
            self._unwatch()
            self._watch()  # the directory again, or its appearance
        # a file being created is read once it is closed (WRITTEN), not half-written
        if gone or any(e.name == self.name and e.kind != CREATED for e in events):
            self.reload()
        return False

    def stop(self) -> None:
        if self._stop_r < 0:
            return
        if self._thread is not None:
            os.write(self._stop_w, b"x")
            self._thread.join(10)
            alive, self._thread = self._thread.is_alive(), None
            if alive:  # (held by its sink): it stops once free; closing its pipe under its
                # select() would end it by an exception, which stops the agent (agent.daemon)
                log.error("the isolation watch thread did not stop within 10 s")
                return
        self._unwatch()
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
        self._stop_r = self._stop_w = -1
