"""The allocation journal: the records in memory and their append-only file, kept in step.

Owns: the records, loaded at start from what agent.state.loading finds (a torn tail cut, a bad
file set aside, the old checkpoint migrated); appending what Allocate and reconciliation
change; the background fdatasync; compaction; what it does while the disk fails.

An Allocate is recorded by `record_allocation` → `_submit` (group commit: the first caller to
find no write under way leads, writes every frame waiting with one `write` and wakes the
followers it carried) → `_write`. A record is in the kernel's hands when its Allocate answers,
so it survives any crash of the agent; the worker fdatasyncs `sync_interval` seconds after the
first unsynced append (0: the leader syncs before anyone returns); docs/state.md says why.

A failed write is cut back off the file (ftruncate), its callers get a StateError, and nothing
in memory changes; until a write and a sync succeed again every write is synced at once.
Compaction (more than twice as many entries as live records, and at start) rewrites the live
records to a temp file while appends go on, adds what came meanwhile, and renames it over.

Must not import grpc or NVML code, nor decide which records stand (agent.state.reconcile).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Callable

from agent.constants import DEFAULT_DEVICE_ID_STRATEGY, DEFAULT_JOURNAL_SYNC_INTERVAL_S
from agent.errors import StateError
from agent.fileio import TEMP_SUFFIX, WRITE_BUFFER, fsync_dir, write_atomic
from agent.state import frames, loading
from agent.state.checkpoint import GpuRef, Record, by_age, from_fields, response_of
from agent.state.loading import (  # the journal's files, named where they are read at start
    JOURNAL_FILE,
    LEGACY_FILE,
    SetAside,
    read_journal,
    set_aside_files,
)
from agent.state.reconcile import Outcome

__all__ = ["JOURNAL_FILE", "LEGACY_FILE", "Journal", "SetAside", "read_journal",
           "set_aside_files"]

log = logging.getLogger(__name__)

# Compact past twice as many entries as live records, and this many: a small one is not worth it
COMPACT_MIN_ENTRIES = 256
# New records share with the last of their devices (_shared): this many kept, cleared when full
SHARED_KEPT = 1024


class _Batch:
    """Frames waiting for one write, what they change in memory, and their callers' answer."""

    __slots__ = ("frames", "held", "changes", "entries", "done", "error")

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.held: list[tuple[str, Record]] = []  # (ID, record) to hold
        self.changes: list[Callable[[dict], None]] = []
        self.entries = 0  # of the frames, those counted as entries (meta frames are not)
        self.done = False
        self.error: BaseException | None = None


class Journal:
    """The records of what Allocate handed out, durable in one append-only file."""

    def __init__(self, path: str, *, boot: str, keyed_by: str = DEFAULT_DEVICE_ID_STRATEGY,
                 clock: Callable[[], float] = time.time,
                 sync_interval: float = DEFAULT_JOURNAL_SYNC_INTERVAL_S):
        self.path = os.path.abspath(path)
        self.directory = os.path.dirname(self.path)
        self.boot = boot
        self.keyed_by = keyed_by
        self.clock = clock
        self.sync_interval = sync_interval
        self._records: dict[str, Record] = {}  # by ID, in the order first written
        # the state below; entered as the lock itself (in C), waited on through _wait/_notify
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # threads in _wait(): notify only when there is one (the usual none)
        self._batch: _Batch | None = None
        self._writing = False  # the writer role: one write (or compaction step) at a time
        self._fd = -1
        self._fd_lock = threading.Lock()  # the worker's fdatasync against a compaction's swap
        self._size = 0  # bytes of whole entries in the file
        self._synced = 0  # of which known durable
        self._cut_pending = False  # a failed write may have left bytes after _size
        self._entries = 0  # entries in the file (meta entries not counted)
        self._fresh: set[str] | None = None  # IDs appended since mark()
        self._since: list[tuple[bytes, int]] | None = None  # appended during a compaction
        self._compact_wanted = False
        self._stop = False
        # the worker: woken for a compaction, the stop, and the first unsynced append (which
        # sets _sync_due, an interval later): asleep while all is synced
        self._wake_worker = threading.Event()
        self._sync_due: float | None = None
        self._worker: threading.Thread | None = None
        # after each Allocate's records are written (the reconciler's "a pass soon"); when the
        # journal starts or stops failing (the daemon's status says so at once)
        self.on_allocate: Callable[[], None] | None = None
        self.on_problem: Callable[[], None] = lambda: None
        # the last new record of each (resource, devices): the next one shares its parts
        self._last: dict[tuple[str, tuple[str, ...]], Record] = {}
        # IDs: 40 random bits and a hex count (atomic): 15 characters (64 bytes) up to 0xffff
        self._id_prefix = os.urandom(5).hex() + "-"
        self._ids = itertools.count(1)
        self.blocked = ""  # why writes are refused: a bad file could not be moved aside
        self.failing = ""  # why writes or syncs fail now ("" while they work)
        self.version = 0  # bumped on every change in memory
        self.writes = 0
        self.syncs = 0
        self.failures = 0  # writes and syncs that failed (agent.metrics)
        self.compactions = 0
        self.last_write: float | None = None
        self.last_error = ""
        self.torn: dict | None = None  # the torn tail cut at load
        self.migrated_from = ""
        self.set_aside: list[SetAside] = []
        self.earlier_aside: list[str] = []
        self.loaded = 0
        self.loaded_boot = ""

    def __repr__(self) -> str:
        return f"Journal({self.path!r}, {len(self._records)} records)"

    # -- loading -------------------------------------------------------------------------------

    def load(self) -> None:
        """Read the journal (or migrate the old checkpoint) into memory, compact it when it
        holds more than its live records, open it for appends and start the worker. A bad
        file is moved aside and reported; the journal then starts empty. Never raises for a
        bad file or a failing disk (appends then fail with the reason until it works)."""
        self.earlier_aside = set_aside_files(self.path)
        found = loading.find(self.path, boot=self.boot, keyed_by=self.keyed_by, clock=self.clock)
        with self._lock:
            self._records = found.records  # not shared (_shared): the read took that memory
            self._entries, self._size = found.entries, found.size
            self.loaded, self.loaded_boot = len(found.records), found.boot
            self.torn, self.migrated_from = found.torn, found.migrated_from
            self.set_aside, self.blocked = found.set_aside, found.blocked
            self.last_error = found.blocked or self.last_error
            self.version += 1
        if not self.blocked:
            with self._lock:
                self._writing = True
            try:
                error = self._open(found.rewrite)
            finally:
                with self._lock:
                    self._writing = False
            if error is None and self.migrated_from:
                loading.retire_legacy(found)
        self._worker = threading.Thread(target=self._work, name="journal", daemon=True)
        self._worker.start()

    # -- reading -------------------------------------------------------------------------------

    def records(self) -> tuple[Record, ...]:
        """Every record, oldest first."""
        with self._lock:
            held = list(self._records.values())
        # in the order written, mostly: the sort is close to linear
        return tuple(sorted(held, key=by_age))

    def mark(self) -> None:
        """Start noting the IDs appended from now on (`fresh()`): a reconciliation marks
        before it asks kubelet, so it never judges a record by a listing older than it."""
        with self._lock:
            self._fresh = set()

    def fresh(self) -> set[str]:
        """IDs appended since the last `mark()`; noting them stops here (until the next
        mark), so no set of IDs is held between reconciliations. The journal no longer
        changes the set it returns."""
        with self._lock:
            fresh, self._fresh = self._fresh, None
        return fresh if fresh is not None else set()

    def status(self) -> dict:
        with self._lock:
            held = list(self._records.values())
            version, entries, size, synced = self.version, self._entries, self._size, \
                self._synced
        attributed = sum(1 for r in held if r.pod is not None)
        return {
            "journal": self.path,
            "keyedBy": self.keyed_by,
            "boot": self.boot,
            "allocations": len(held),
            "attributed": attributed,
            "pending": len(held) - attributed,
            "version": version,
            "entries": entries,
            "bytes": size,
            "unsyncedBytes": size - synced,
            "syncInterval": self.sync_interval,
            "writes": self.writes,
            "syncs": self.syncs,
            "compactions": self.compactions,
            "lastWrite": self.last_write,
            "failing": self.failing,
            "lastError": self.last_error,
            "tornTail": self.torn,
            "migratedFrom": self.migrated_from,
            "loaded": self.loaded,
            "loadedBoot": self.loaded_boot,
            "setAside": [a.to_dict() for a in self.set_aside],
            "setAsideEarlier": list(self.earlier_aside),
        }

    # -- recording -----------------------------------------------------------------------------

    def record_allocation(self, resource: str, containers: Sequence[tuple[Sequence[Any], Any]]
                          ) -> list[str]:
        """Record one Allocate: for each container, its devices (agent.rm.devices.Device) and
        the response given (agent.rm.allocate.ContainerResponse). Returns the records' IDs
        once they are written (synced too with a sync interval of 0, or while the disk
        fails); StateError if they could not be. This is the `journal` hook of
        agent.rm.manager.ResourceManager."""
        now = self.clock()
        records = [self._shared(Record(
            id=f"{self._id_prefix}{next(self._ids):x}", resource=resource,
            devices=tuple(d.id for d in devices),
            gpus=tuple(GpuRef(d.gpu_uuid, int(d.gpu_index)) for d in devices),
            response=response_of(response), time=now, boot=self.boot))
            for devices, response in containers]
        self._submit(self._frames(records), [(r.id, r) for r in records])
        if self.on_allocate is not None:
            self.on_allocate()
        return [r.id for r in records]

    def _shared(self, r: Record) -> Record:
        """`r` holding the GPUs, response and boot of the last record of its devices where they
        are equal: the records of one answer hold one copy of them (10,000 Allocates of one
        answer hold 2.3 MB instead of 8). Not for records read at start: the read took their
        memory, and sharing them then gave none back (docs/state.md)."""
        key = (r.resource, r.devices)
        last = self._last.get(key)
        if last is not None:
            r = from_fields(Record, (
                r.id, last.resource, last.devices, last.gpus if last.gpus == r.gpus else r.gpus,
                last.response if last.response == r.response else r.response, r.time,
                last.boot if last.boot == r.boot else r.boot, r.pod, r.confirmed))
        elif len(self._last) >= SHARED_KEPT:
            self._last.clear()
        self._last[key] = r
        return r

    def append(self, records: Iterable[Record]) -> None:
        """Add `records` (new or replacing ones of the same ID); return once written."""
        records = list(records)
        self._submit(self._frames(records), [(r.id, r) for r in records])

    def _frames(self, records: Sequence[Record]) -> list[bytes]:
        """The put entries of `records`; StateError for one msgpack cannot pack (a bug
        upstream: it fails its own Allocate, alone)."""
        try:
            return [frames.put_frame(r) for r in records]
        except Exception as exc:
            log.exception("cannot pack an allocation record")
            raise StateError(f"cannot write the journal {self.path}: cannot pack the record "
                             f"({exc})") from exc

    def apply(self, outcome: Outcome) -> bool:
        """Apply a reconciliation of (a snapshot of) the records: drop what it dropped,
        update what it kept, add what it adopted. Records appended since the snapshot are
        untouched. Appends an entry for each drop, claim, re-keying and adoption (a newer
        confirmation time alone changes memory only); True when it wrote. StateError if the
        write failed (nothing changed then: the next reconciliation finds it all again)."""
        adopted = {r.id for r in outcome.adopted}
        rekeyed = {r.id for r, _ in outcome.rekeyed}
        out: list[bytes] = []
        with self._lock:  # Allocates wait meanwhile: the loop skips what cannot have changed
            drop = [r.id for r, _ in outcome.dropped if r.id in self._records]
            update = []
            for r in outcome.kept:
                if r.pod is None and r.id not in rekeyed:
                    continue  # pending, handed back as it was (agent.state.reconcile rules 1-3)
                held = self._records.get(r.id)
                if held is None:
                    if r.id in adopted:
                        update.append(r)
                        out.append(frames.put_frame(r))
                    continue
                if held != r:
                    update.append(r)
                    if held.gpus != r.gpus or held.devices != r.devices:
                        out.append(frames.put_frame(r))
                    elif held.pod != r.pod:
                        out.append(frames.claim_frame(r))
            out += [frames.drop_frame(rid) for rid in drop]

        def change(records: dict) -> None:
            for rid in drop:
                records.pop(rid, None)
            for r in update:
                if r.id in records or r.id in adopted:
                    records[r.id] = r

        if not out:
            if update:
                with self._lock:
                    change(self._records)
                    self.version += 1
            return False
        self._submit(out, change=change)
        return True

    def set_keyed_by(self, keyed_by: str) -> None:
        """A new checkpointDeviceIDStrategy: noted in memory and in the journal."""
        self.keyed_by = keyed_by
        try:
            self._submit([frames.meta_frame(self.boot, keyed_by, self.clock())], count=False)
        except StateError as exc:
            log.warning("the journal does not note the new key yet: %s", exc)

    def flush(self) -> None:
        """Make everything written so far durable now (fdatasync)."""
        with self._fd_lock:
            self._sync()

    def close(self) -> None:
        """Stop the worker, sync, close the file."""
        with self._lock:
            self._stop = True
            self._notify()
        self._wake_worker.set()
        if self._worker is not None:
            self._worker.join(30)
        with self._lock:
            while self._writing:
                self._wait()
            self._writing = True
        try:
            with self._fd_lock:
                if self._fd >= 0:
                    self._sync()
                    os.close(self._fd)
                    self._fd = -1
        finally:
            with self._lock:
                self._writing = False
                self._notify()

    def _submit(self, out: list[bytes], held: Sequence[tuple[str, Record]] = (),
                change: Callable[[dict], None] | None = None, count: bool = True) -> None:
        """Write the frames `out`, in one `write` with those of every caller queued meanwhile
        (group commit); once written, hold each (ID, record) of `held` and apply `change` to
        the records held. StateError if they were not written (nothing changes then)."""
        with self._lock:
            if self.blocked:
                raise StateError(self.blocked)
            batch = self._batch
            if batch is None:
                batch = self._batch = _Batch()
            batch.frames.extend(out)
            batch.held.extend(held)
            if change is not None:
                batch.changes.append(change)
            if count:
                batch.entries += len(out)
            while not batch.done:
                if self._writing:
                    self._wait()
                    continue
                # the leader: write everything waiting, our batch included
                self._writing, self._batch = True, None
                try:
                    batch.error = self._write(batch)
                finally:
                    batch.done, self._writing = True, False
                    self._notify()
            if batch.error is not None:
                raise StateError(f"cannot write the journal {self.path}: "
                                 f"{batch.error}") from batch.error

    def _write(self, batch: _Batch) -> BaseException | None:
        """Append the batch's frames with one `write` (the writer role held; the lock is let
        go meanwhile), synced too with a sync interval of 0 or while the disk fails; then
        hold its records and apply its changes (new IDs and the records a reconciliation
        changes never overlap: their order does not matter). The error if it was not
        written: what it wrote is cut back off the file, and nothing changes in memory."""
        data = b"".join(batch.frames)
        self._lock.release()
        try:
            if self._fd < 0:
                error = self._open(rewrite=True)
                if error is not None:
                    return error
            if self._cut_pending:
                os.ftruncate(self._fd, self._size)
                self._cut_pending = False
            written = os.write(self._fd, data)
            if written < len(data):  # a short write (a signal, a full disk): write the rest
                view = memoryview(data)[written:]
                while view:
                    view = view[os.write(self._fd, view):]
            if self.sync_interval == 0 or self.failing:
                with self._fd_lock:
                    os.fdatasync(self._fd)
                    self._synced = self._size + len(data)
                    self.syncs += 1
            self._works()
        except OSError as exc:
            if self._fd >= 0:
                try:
                    os.ftruncate(self._fd, self._size)
                except OSError:
                    self._cut_pending = True  # tried again before the next write
            self._failed("write", exc)
            return exc
        except Exception as exc:  # a bug: fail this batch, never strand followers
            log.exception("journal write failed")
            return exc
        finally:
            self._lock.acquire()
        try:
            records = self._records
            records.update(batch.held)
            if self._fresh is not None:
                self._fresh.update(rid for rid, _ in batch.held)
            for fn in batch.changes:
                fn(records)
        finally:
            if self._sync_due is None and self.sync_interval > 0:
                self._sync_due = time.monotonic() + self.sync_interval
                self._wake_worker.set()
            self._size += len(data)
            self._entries += batch.entries
            if self._since is not None:
                self._since.append((data, batch.entries))
            self.version += 1
            self.writes += 1
            self.last_write = self.clock()
            if self._entries >= COMPACT_MIN_ENTRIES and self._entries > 2 * len(self._records):
                self._compact_wanted = True
                self._wake_worker.set()
        return None

    def _wait(self) -> None:
        """Wait on the condition (its lock held), counted so that `_notify` knows of us."""
        self._waiting += 1
        try:
            self._cond.wait()
        finally:
            self._waiting -= 1

    def _notify(self) -> None:
        """Wake the threads in `_wait` (the lock held); a call with none waiting costs nothing."""
        if self._waiting:
            self._cond.notify_all()

    # -- the file (the writer role held) -------------------------------------------------------

    def _open(self, rewrite: bool) -> OSError | None:
        """Open the journal for appends; with `rewrite`, first write the records held as a
        fresh file (atomically: at start, after a bad file, or when it could not be opened)."""
        try:
            if rewrite:
                write_atomic(self.path, frames.encode_all(self._records.values(),
                                                          self.boot, self.keyed_by,
                                                          self.clock()), 0o600)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            size = os.fstat(fd).st_size
        except OSError as exc:
            self._failed("open", exc)
            return exc
        with self._fd_lock:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = fd
        if rewrite:
            self._entries = len(self._records)
        self._size = self._synced = size
        self._cut_pending = False
        return None

    def _failed(self, what: str, exc: OSError) -> None:
        reason = f"cannot {what} the journal {self.path}: {exc.strerror or exc}"
        self.failures += 1
        if reason != self.failing:
            log.error("%s; Allocate answers UNAVAILABLE until it works again", reason)
        self.failing = self.last_error = reason
        self.on_problem()

    def _works(self) -> None:
        if self.failing:
            log.info("journal %s is written again", self.path)
            self.failing = ""
            self.on_problem()

    def _sync(self) -> None:
        """fdatasync the journal (the _fd_lock held)."""
        if self._fd < 0:
            return
        target = self._size
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            self._failed("sync", exc)
            return
        self._synced = max(self._synced, target)
        self.syncs += 1

    # -- the worker: background sync and compaction ---------------------------------------------

    def _work(self) -> None:
        while True:
            due_at = self._sync_due  # (read unlocked: a change sets the event)
            self._wake_worker.wait(None if due_at is None else max(0.0, due_at - time.monotonic()))
            self._wake_worker.clear()
            with self._lock:
                if self._stop:
                    return
                compact, self._compact_wanted = self._compact_wanted, False
                due = self._sync_due is not None and time.monotonic() >= self._sync_due
                if due:  # appends from here on start the next interval
                    self._sync_due = None
            if due:
                with self._fd_lock:
                    self._sync()
            if compact:
                try:
                    self._compact()
                except Exception:  # the loop boundary: a bug; the old file stays in use
                    log.exception("journal compaction failed unexpectedly")

    def _compact(self) -> None:
        """Rewrite the live records to a temp file while appends go on, then add what was
        appended meanwhile and rename it over the journal."""
        with self._lock:
            while self._writing:
                self._wait()
            if self._fd < 0 or self.blocked:
                return
            snapshot = dict(self._records)
            self._since = []
            entries_before = self._entries
        tmp = self.path + TEMP_SUFFIX
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                         0o600)
            os.fchmod(fd, 0o600)
            size = _write_all(fd, frames.encode_all(snapshot.values(), self.boot,
                                                    self.keyed_by, self.clock()))
            os.fdatasync(fd)
            with self._lock:  # the writer role for the switch: appends wait this long
                while self._writing:
                    self._wait()
                self._writing = True
                since, self._since = self._since or [], None
            try:
                size += _write_all(fd, [data for data, _ in since])
                os.fdatasync(fd)
                os.rename(tmp, self.path)
                with self._fd_lock:  # at once: the old inode is no longer the journal
                    old, self._fd, fd = self._fd, fd, -1
                    os.close(old)
            finally:
                with self._lock:
                    if fd < 0:  # switched
                        self._size = self._synced = size
                        self._entries = len(snapshot) + sum(n for _, n in since)
                        self.compactions += 1
                    self._writing = False
                    self._notify()
        except OSError as exc:
            with self._lock:
                self._since = None
            log.error("cannot compact the journal %s (%s); appending to it as it is",
                      self.path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        finally:
            if fd >= 0:
                os.close(fd)
        try:
            fsync_dir(self.directory)
        except OSError as exc:  # the rename may not survive a power loss: the old file then
            log.warning("journal %s compacted, but syncing its directory failed: %s",
                        self.path, exc)
        log.info("journal %s compacted: %d entries → %d live records", self.path,
                 entries_before, len(snapshot))


def _write_all(fd: int, parts: list[bytes]) -> int:
    """Write `parts` one after another at `fd` (in writes of 64 KiB); the bytes written."""
    with open(fd, "wb", buffering=WRITE_BUFFER, closefd=False) as f:
        f.writelines(parts)
    return sum(len(p) for p in parts)
