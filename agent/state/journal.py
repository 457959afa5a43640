"""The allocation journal: the records in memory and their append-only file, kept in step.

Owns: loading the file at start (a torn tail is truncated and reported once; a file that is
otherwise unreadable is moved aside with a timestamp, reported, never overwritten; the old
single-file checkpoint is read and migrated), appending what Allocate and reconciliation
change, the background fdatasync, compaction, and what the journal does while the disk fails.

Group commit: concurrent appends share one `write`. The first caller to find no write under
way becomes the leader: it takes every frame waiting (its own and those queued behind the
previous write), writes them with one call and wakes the followers it carried. A record is in
the kernel's hands when its Allocate answers, so it survives any crash of the agent; the
worker thread fdatasyncs every `sync_interval` seconds (0: the leader syncs before anyone
returns). See docs/state.md for the contract and the reasoning.

A failed write is cut back off the file (ftruncate), its callers get a StateError, and nothing
in memory changes; until a write and a sync succeed again every write is synced at once, so an
Allocate is answered only when its record is on disk. Compaction (more than twice as many
entries as live records, and at start) rewrites the live records to a temp file while appends
go on, adds what was appended meanwhile, and renames it over the journal.

Must not import grpc or NVML code, nor decide which records stand (agent.state.reconcile).
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from agent import _fast
from agent.constants import DEFAULT_DEVICE_ID_STRATEGY, DEFAULT_JOURNAL_SYNC_INTERVAL_S
from agent.errors import CheckpointError, StateError
from agent.fileio import TEMP_SUFFIX, fsync_dir, write_atomic
from agent.gcpause import paused
from agent.state import frames
from agent.state.checkpoint import (
    Checkpoint,
    DeviceSpecRec,
    GpuRef,
    MountRec,
    Record,
    Response,
    by_age,
    decode,
    from_fields,
)
from agent.state.reconcile import Outcome

log = logging.getLogger(__name__)

JOURNAL_FILE = "allocations.journal"
LEGACY_FILE = "checkpoint.msgpack"  # schema 1, read once and migrated
MIGRATED_MARK = ".migrated"
ASIDE_MARK = ".bad-"
# Compact when the file holds more than twice as many entries as live records, and at least
# this many: a small journal is not worth a rewrite.
COMPACT_MIN_ENTRIES = 256
ANSWERS_KEPT = 1024


@dataclass(frozen=True)
class SetAside:
    """A bad journal or checkpoint moved out of the way: where it went, why, and when."""

    path: str
    kind: str  # truncated, corrupt, version, unreadable
    reason: str
    at: float

    def to_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "reason": self.reason, "at": self.at}


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError("unreadable", f"cannot read it: {exc.strerror or exc}") from exc


def read_journal(path: str) -> Checkpoint | None:
    """The records of the journal at `path` as a Checkpoint (None if there is none; the old
    checkpoint beside it when only that exists); CheckpointError if it is bad. Reads only:
    for `gpu-agent state show`, the doctor and tests. A torn tail is left out."""
    data = _read(path)
    if data is None:
        legacy = _read(os.path.join(os.path.dirname(path), LEGACY_FILE))
        return None if legacy is None else decode(legacy)
    scan = frames.scan(data)
    meta = scan.meta
    return Checkpoint(tuple(scan.records.values()), written=meta.written if meta else 0.0,
                      boot=meta.boot if meta else "",
                      keyed_by=meta.keyed_by if meta else DEFAULT_DEVICE_ID_STRATEGY)


def set_aside_files(path: str) -> list[str]:
    """Bad files set aside beside `path` (and beside the old checkpoint) earlier, oldest
    first."""
    legacy = os.path.join(os.path.dirname(path), LEGACY_FILE)
    return sorted(glob.glob(glob.escape(path) + ASIDE_MARK + "*")
                  + glob.glob(glob.escape(legacy) + ASIDE_MARK + "*"))


def response_record(r: Any) -> Response:
    """A Response from an agent.rm.allocate.ContainerResponse (read by attribute)."""
    return Response(
        envs=dict(r.envs),
        mounts=tuple(MountRec(m.container_path, m.host_path, bool(m.read_only))
                     for m in r.mounts),
        devices=tuple(DeviceSpecRec(s.container_path, s.host_path, s.permissions)
                      for s in r.devices),
        annotations=dict(r.annotations),
        cdi_devices=tuple(r.cdi_devices),
    )


class _Batch:
    """Frames waiting for one write, what they change in memory, and their callers' answer."""

    __slots__ = ("frames", "held", "changes", "entries", "done", "error")

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.held: list[tuple[str, Any]] = []  # (ID, record or compact form) to hold
        self.changes: list[Callable[[dict], None]] = []
        self.entries = 0  # of the frames, those counted as entries (meta frames are not)
        self.done = False
        self.error: BaseException | None = None


class Journal:
    """The records of what Allocate handed out, durable in one append-only file."""

    def __init__(self, path: str, *, boot: str, keyed_by: str = DEFAULT_DEVICE_ID_STRATEGY,
                 clock: Callable[[], float] = time.time,
                 sync_interval: float = DEFAULT_JOURNAL_SYNC_INTERVAL_S,
                 entries_module: Any = None):
        self.path = os.path.abspath(path)
        self.directory = os.path.dirname(self.path)
        self.legacy_path = os.path.join(self.directory, LEGACY_FILE)
        self.boot = boot
        self.keyed_by = keyed_by
        self.clock = clock
        self.sync_interval = sync_interval
        # by ID: a Record, or a new Allocate's (time, record of its answer) until something
        # changes it (`_full`): 56 bytes instead of a Record's 112, per unclaimed Allocate
        self._records: dict[str, Record | tuple[float, Record]] = {}
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
        # wakes the worker for a compaction or the stop only: appends never wake it (it
        # syncs on its own clock, once per interval, whatever the rate of Allocates)
        self._wake_worker = threading.Event()
        self._worker: threading.Thread | None = None
        # called once at the next append of Allocate records, then disarmed (`arm`)
        self._armed: Callable[[], None] | None = None
        self._answers: dict[int, tuple[Any, tuple]] = {}  # by the manager's response object
        # packs each Allocate's entry (agent._fast: the live one unless `entries_module` is
        # given) of pieces made once: the boot's here, each answer's in `_shared`
        entries = entries_module or _fast.entries_impl
        self._pack_put, self._piece = entries.new_put_frame, entries.Piece
        # record IDs: random per process, then counted (unique without a syscall per record;
        # a call is atomic: concurrent Allocates never share one)
        self._new_id = entries.Ids(os.urandom(6).hex() + "-")
        self._tail = self._piece(frames.tail_piece(boot))
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
        for tmp in (self.path + TEMP_SUFFIX, self.legacy_path + TEMP_SUFFIX):
            try:
                os.unlink(tmp)  # a write cut short: the real file is intact
                log.info("removed %s, left by a write that did not finish", tmp)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s: %s", tmp, exc)
        rewrite = self._load_file()
        with self._lock:
            self.version += 1
        if not self.blocked:
            with self._lock:
                self._writing = True
            try:
                error = self._open(rewrite)
            finally:
                with self._lock:
                    self._writing = False
            if error is None and self.migrated_from:
                self._retire_legacy()
        self._worker = threading.Thread(target=self._work, name="journal", daemon=True)
        self._worker.start()

    def _load_file(self) -> bool:
        """Fill the records from the file; whether the file must be rewritten first."""
        try:
            data = _read(self.path)
        except CheckpointError as exc:
            self._put_aside(self.path, exc)
            return True
        if data is None:
            return self._load_legacy()
        try:
            scan = frames.scan(data)
        except CheckpointError as exc:
            self._put_aside(self.path, exc)
            return True
        if scan.torn:
            self.torn = {"at": scan.good_end, "bytes": len(data) - scan.good_end,
                         "reason": scan.torn, "time": self.clock()}
            log.warning("journal %s: %s: cut off (%d bytes; a write the agent or the host did "
                        "not finish)", self.path, scan.torn, len(data) - scan.good_end)
        meta = scan.meta
        self._loaded(list(scan.records.values()), meta.boot if meta else self.boot,
                     meta.keyed_by if meta else self.keyed_by)
        self._records = scan.records
        self._entries, self._size = scan.entries, scan.good_end
        return bool(scan.torn) or meta is None or (
            scan.entries > len(scan.records) and scan.entries >= COMPACT_MIN_ENTRIES // 4)

    def _load_legacy(self) -> bool:
        try:
            data = _read(self.legacy_path)
            cp = None if data is None else decode(data)
        except CheckpointError as exc:
            self._put_aside(self.legacy_path, exc)
            return True
        if cp is None:
            log.info("no journal at %s: starting with no recorded allocations", self.path)
            return True
        self._records = {r.id: r for r in cp.records}
        self.migrated_from = self.legacy_path
        self._loaded(list(cp.records), cp.boot, cp.keyed_by)
        log.info("migrating the checkpoint %s (schema 1) to the journal %s", self.legacy_path,
                 self.path)
        return True

    def _loaded(self, records: list[Record], boot: str, keyed_by: str) -> None:
        self.loaded, self.loaded_boot = len(records), boot
        attributed = sum(1 for r in records if r.pod is not None)
        log.info("loaded %d allocation records (%d attributed to pods) from %s", len(records),
                 attributed, self.path if not self.migrated_from else self.legacy_path)
        if boot != self.boot and records:
            log.info("the journal was written in boot %s, this is boot %s: its records are "
                     "kept only where podresources confirms them", boot or "unknown",
                     self.boot or "unknown")
        if keyed_by != self.keyed_by:
            log.info("the journal matched GPUs by %s; they are now matched by %s "
                     "(checkpointDeviceIDStrategy)", keyed_by, self.keyed_by)

    def _retire_legacy(self) -> None:
        target = self.legacy_path + MIGRATED_MARK
        try:
            os.replace(self.legacy_path, target)
            fsync_dir(self.directory)
        except OSError as exc:
            log.warning("migrated %s, but cannot rename it to %s: %s (it is read again, and "
                        "ignored, while the journal exists)", self.legacy_path, target, exc)
            return
        log.info("migrated %d records; the old checkpoint is kept as %s", self.loaded, target)

    def _put_aside(self, path: str, exc: CheckpointError) -> None:
        now = self.clock()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        try:
            target = self._move_aside(path, stamp)
        except OSError as move_exc:
            self.blocked = (f"the bad file {path} ({exc.problem}) could not be moved aside "
                            f"({move_exc}); refusing to overwrite it: move it away and "
                            f"restart gpu-agent")
            self.last_error = self.blocked
            log.error("%s", self.blocked)
            self.set_aside.append(SetAside("", exc.kind, exc.problem, now))
            return
        self.set_aside.append(SetAside(target, exc.kind, exc.problem, now))
        log.error("%s is %s (%s): moved aside to %s; starting from what podresources reports",
                  path, _KIND_WORDS.get(exc.kind, exc.kind), exc.problem, target)

    def _move_aside(self, path: str, stamp: str) -> str:
        for n in range(1000):
            target = f"{path}{ASIDE_MARK}{stamp}" + (f"-{n}" if n else "")
            if os.path.lexists(target):
                continue
            try:
                os.link(path, target)  # fails rather than replace an existing file
            except FileExistsError:
                continue
            except OSError:  # a directory, or a filesystem without hard links
                if os.path.lexists(target):
                    continue
                os.rename(path, target)
            else:
                os.unlink(path)
            fsync_dir(self.directory)
            return target
        raise OSError(f"no free name for {path}{ASIDE_MARK}{stamp}")

    # -- reading -------------------------------------------------------------------------------

    def records(self) -> tuple[Record, ...]:
        """Every record, oldest first."""
        with self._lock:
            held = list(self._records.items())
        with paused():  # Records made by the ten thousand, and let go after (agent.gcpause)
            # in the order written, mostly: the sort is close to linear
            return tuple(sorted(_all(held), key=by_age))

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

    def arm(self, fn: Callable[[], None]) -> None:
        """Call fn() once, from the appending thread after the write, at the next append of
        Allocate records. The reconciler arms it at each pass: the Allocates after the first
        would move nothing (its due time is set), and each then costs one attribute read
        instead of a call."""
        self._armed = fn

    def _fire(self) -> None:
        fn = self._armed
        if fn is not None:  # two appenders may both call it: it is idempotent
            self._armed = None
            fn()

    def status(self) -> dict:
        with self._lock:
            held = list(self._records.values())
            version, entries, size, synced = self.version, self._entries, self._size, \
                self._synced
        attributed = sum(1 for r in held if type(r) is not tuple and r.pod is not None)
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
        the response given. Returns the records' IDs once they are written (synced too with
        a sync interval of 0, or while the disk fails); StateError if they could not be. This
        is the `journal` hook of agent.rm.manager.ResourceManager."""
        if len(containers) == 1:
            devices, response = containers[0]
            return self._record_one(resource, containers,
                                    *self._shared(resource, devices, response))
        return self._record_many(resource, containers, self.clock())

    def recorder(self, resource: str, containers: Sequence[tuple[Sequence[Any], Any]]
                 ) -> Callable[[], object]:
        """What records one Allocate of `containers` each time it is called, returning what
        `record_allocation` returns: made once per answer the manager keeps, so a repeat
        goes straight to the write, its record's shared part found here once. The `prepare`
        hook of agent.rm.manager.ResourceManager."""
        if len(containers) == 1:
            devices, response = containers[0]
            return functools.partial(self._record_one, resource, containers,
                                     *self._shared(resource, devices, response))
        return functools.partial(self.record_allocation, resource, containers)

    def _record_many(self, resource: str, containers: Sequence[tuple[Sequence[Any], Any]],
                     now: float) -> list[str]:
        held, out = [], []
        for devices, response in containers:
            first, piece = self._shared(resource, devices, response)
            rid = self._new_id()
            held.append((rid, (now, first)))
            out.append(self._pack_put(rid, now, piece, self._tail))
        self._add(held, out)
        return [rid for rid, _ in held]

    def _record_one(self, resource: str, containers: Sequence[tuple[Sequence[Any], Any]],
                    first: Record, piece: Any) -> list[str]:
        """One container's Allocate, `first` and `piece` its answer's shared record and bytes
        (`_shared`); returns [the record's ID]. The usual case in one function: no other write
        under way or queued, the file open and working, syncs left to the worker. Writes
        its entry, holds its record; any other case (or a failed write, which it cuts back)
        goes to the general path, which handles them all. Inlined on purpose: on this path
        each Python call costs the Allocate measurably (docs/state.md, "What an Allocate
        costs")."""
        now = self.clock()
        rid = None
        lock = self._lock
        lock.acquire()
        try:
            if not (self._writing or self._batch is not None or self._fd < 0 or self.blocked or
                    self.failing or self._cut_pending or not self.sync_interval):
                rid = self._new_id()
                data = self._pack_put(rid, now, piece, self._tail)
                fd = self._fd  # stays: compaction and close take the writer role to change it
                self._writing = True
                lock.release()
                try:
                    written = os.write(fd, data)
                except OSError:
                    written = -1
                finally:
                    lock.acquire()
                    self._writing = False
                    if self._waiting:
                        self._cond.notify_all()
                if written != len(data):  # nothing or a part written: the general path says why
                    rid = None
                    if written > 0:
                        try:
                            os.ftruncate(fd, self._size)
                        except OSError:
                            self._cut_pending = True
                else:
                    self._records[rid] = (now, first)
                    if self._fresh is not None:
                        self._fresh.add(rid)
                    self._size += written
                    self._entries += 1
                    if self._since is not None:
                        self._since.append((data, 1))
                    self.version += 1
                    self.writes += 1
                    self.last_write = now
                    if self._entries >= COMPACT_MIN_ENTRIES and \
                            self._entries > 2 * len(self._records):
                        self._compact_wanted = True
                        self._wake_worker.set()
        finally:
            lock.release()
        if rid is None:
            return self._record_many(resource, containers, now)
        fn = self._armed  # `_fire`, inline
        if fn is not None:
            self._armed = None
            fn()
        return [rid]

    def _shared(self, resource: str, devices: Sequence[Any], response: Any
                ) -> tuple[Record, Any]:
        """A record of an answer (its devices, GPUs and Response; ID and time to fill in) and
        those packed (an entries module's Piece), built once per answer the manager keeps (it
        hands the same objects for the same request): the records of one answer share them,
        which keeps a journal of 10,000 records small and an Allocate's own packing to its ID
        and time."""
        hit = self._answers.get(id(response))
        if hit is not None and hit[0] is response:
            return hit[1]
        first = Record(id="", resource=resource, devices=tuple(d.id for d in devices),
                       gpus=tuple(GpuRef(d.gpu_uuid, int(d.gpu_index)) for d in devices),
                       response=response_record(response), time=0.0, boot=self.boot)
        shared = (first, self._piece(frames.answer_piece(first)))
        if len(self._answers) >= ANSWERS_KEPT:
            self._answers.clear()
        self._answers[id(response)] = (response, shared)
        return shared

    def append(self, records: Iterable[Record]) -> None:
        """Add `records` (new or replacing ones of the same ID); return once written."""
        records = list(records)
        try:
            out = [frames.put_frame(r) for r in records]
        except Exception as exc:  # a record msgpack cannot pack: a bug upstream; fail alone
            log.exception("cannot pack an allocation record")
            raise StateError(f"cannot write the journal {self.path}: cannot pack the record "
                             f"({exc})") from exc
        self._add([(r.id, r) for r in records], out)

    def _add(self, held: list[tuple[str, Any]], out: list[bytes]) -> None:
        """Write `out`, then hold each (ID, record or compact form) of `held`."""
        self._submit(out, held)
        self._fire()

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
                    # pending: reconcile hands such a record back as it got it, unless it
                    # re-keyed it (agent.state.reconcile, rules 1-3); thousands of them while
                    # Allocates come faster than pods start
                    continue
                held = self._records.get(r.id)
                if held is None:
                    if r.id in adopted:
                        update.append(r)
                        out.append(frames.put_frame(r))
                    continue
                old = _full(r.id, held)
                if old != r:
                    update.append(r)
                    if old.gpus != r.gpus or old.devices != r.devices:
                        out.append(frames.put_frame(r))
                    elif old.pod != r.pod:
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

    def _submit(self, out: list[bytes], held: Sequence[tuple[str, Any]] = (),
                change: Callable[[dict], None] | None = None, count: bool = True) -> None:
        """Write the frames `out`; once written, hold each (ID, record or compact form) of
        `held` and apply `change` to the records held. StateError if they were not written
        (nothing changes then)."""
        with self._lock:
            if self.blocked:
                raise StateError(self.blocked)
            if not self._writing and self._batch is None:
                # alone, the usual case: write at once, no batch to queue in
                self._writing = True
                error = self._lead(out[0] if len(out) == 1 else b"".join(out), held,
                                   () if change is None else (change,),
                                   len(out) if count else 0)
            else:
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
                    # leader: write everything waiting, our batch included
                    self._writing, self._batch = True, None
                    batch.error = self._lead(b"".join(batch.frames), batch.held,
                                             batch.changes, batch.entries)
                    batch.done = True
                error = batch.error
            if error is not None:
                raise StateError(f"cannot write the journal {self.path}: {error}") from error

    def _lead(self, data: bytes, held: Sequence[tuple[str, Any]],
              changes: Sequence[Callable[[dict], None]], entries: int) -> BaseException | None:
        """Write `data` (the writer role taken, the lock held, let go meanwhile), hold `held`
        and apply `changes` if it was written (new IDs and the records a reconciliation
        changes never overlap: the order between them does not matter), give the role
        back; the error if it was not."""
        self._lock.release()
        try:
            error = self._append(data)
        except Exception as exc:  # a bug: fail this batch, never strand followers
            log.exception("journal write failed")
            error = exc
        finally:
            self._lock.acquire()
        if error is None:
            try:
                records = self._records
                if held:
                    records.update(held)
                    if self._fresh is not None:
                        self._fresh.update(rid for rid, _ in held)
                for fn in changes:
                    fn(records)
            finally:
                self._size += len(data)
                self._entries += entries
                if self._since is not None:
                    self._since.append((data, entries))
                self.version += 1
                self.writes += 1
                self.last_write = self.clock()
                if self._entries >= COMPACT_MIN_ENTRIES and \
                        self._entries > 2 * len(self._records):
                    self._compact_wanted = True
                    self._wake_worker.set()
        self._writing = False
        self._notify()
        return error

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

    def _append(self, data: bytes) -> BaseException | None:
        """Write `data` at the end of the journal; the OSError if it failed (cut back off)."""
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
        except OSError as exc:
            if self._fd >= 0:
                try:
                    os.ftruncate(self._fd, self._size)
                except OSError:
                    self._cut_pending = True  # tried again before the next write
            self._failed("write", exc)
            return exc
        if self.failing:
            self._works()
        return None

    def _open(self, rewrite: bool) -> OSError | None:
        """Open the journal for appends; with `rewrite`, first write the records held as a
        fresh file (atomically: at start, after a bad file, or when it could not be opened)."""
        try:
            if rewrite:
                write_atomic(self.path, frames.encode_all(_all(self._records.items()),
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

    def _works(self) -> None:
        if self.failing:
            log.info("journal %s is written again", self.path)
            self.failing = ""

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
            self._wake_worker.wait(self.sync_interval or None)
            self._wake_worker.clear()
            with self._lock:
                if self._stop:
                    return
                compact, self._compact_wanted = self._compact_wanted, False
                due = self.sync_interval > 0 and self._size > self._synced
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
            size = 0
            for chunk in _chunks(frames.encode_all(_all(snapshot.items()), self.boot,
                                                   self.keyed_by, self.clock())):
                size += _write_all(fd, chunk)
            os.fdatasync(fd)
            with self._lock:  # the writer role for the switch: appends wait this long
                while self._writing:
                    self._wait()
                self._writing = True
                since, self._since = self._since or [], None
            try:
                for data, _ in since:
                    size += _write_all(fd, data)
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


def _full(rid: str, held: Record | tuple[float, Record]) -> Record:
    """The Record of what `Journal._records` holds under `rid`."""
    if type(held) is not tuple:
        return held
    t, first = held
    return from_fields(Record, (rid, first[1], first[2], first[3], first[4], t, first[6],
                                None, None))


def _all(held: Iterable[tuple[str, Record | tuple[float, Record]]]) -> list[Record]:
    """The Records of (ID, what `Journal._records` holds) pairs: `_full` of each, inlined (a
    reconciliation reads 10,000 of them)."""
    new = from_fields
    return [h if type(h) is not tuple else
            new(Record, (rid, h[1][1], h[1][2], h[1][3], h[1][4], h[0], h[1][6], None, None))
            for rid, h in held]


def _chunks(parts: list[bytes], size: int = 1 << 16) -> Iterable[bytes]:
    """`parts` joined into pieces of about `size` bytes (fewer write calls)."""
    buf: list[bytes] = []
    n = 0
    for p in parts:
        buf.append(p)
        n += len(p)
        if n >= size:
            yield b"".join(buf)
            buf, n = [], 0
    if buf:
        yield b"".join(buf)


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return len(data)


_KIND_WORDS = {"truncated": "truncated", "corrupt": "corrupt", "version": "of an unknown "
               "schema version", "unreadable": "unreadable"}
