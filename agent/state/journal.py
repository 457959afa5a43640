"""The allocation journal: the records in memory and their checkpoint file, kept in step.

Owns: loading the checkpoint at start (a bad file is moved aside with a timestamp, reported,
never overwritten; the agent then starts empty), recording Allocate answers durably before
they are returned, applying reconciliation outcomes, and writing the file atomically
(agent.fileio.write_atomic: temp file, fsync, rename, fsync of the directory; mode 0600).

Group commit: concurrent `append` calls share one write. The first caller to find no write
under way becomes the leader: it takes every record waiting (its own and those queued behind
the previous write), writes and fsyncs once, and wakes the followers it carried. Nobody returns
before the write that holds its records is durable; if that write fails, every caller it
carried gets a StateError and their records are forgotten (Allocate then fails with the
reason, so kubelet never starts a container the journal does not know).

Must not import grpc or NVML code, nor decide which records stand (agent.state.reconcile).
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from agent.constants import DEFAULT_DEVICE_ID_STRATEGY
from agent.errors import CheckpointError, StateError
from agent.fileio import TEMP_SUFFIX, fsync_dir, write_atomic
from agent.state.checkpoint import (
    Checkpoint,
    DeviceSpecRec,
    GpuRef,
    MountRec,
    Record,
    Response,
    decode,
    encode_chunks,
    pack_record,
)
from agent.state.reconcile import Outcome

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.msgpack"
ASIDE_MARK = ".bad-"


@dataclass(frozen=True)
class SetAside:
    """A bad checkpoint moved out of the way: where it went, why, and when."""

    path: str
    kind: str  # truncated, corrupt, version, unreadable
    reason: str
    at: float

    def to_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "reason": self.reason, "at": self.at}


def read_checkpoint(path: str) -> Checkpoint | None:
    """The checkpoint at `path` (None if there is none); CheckpointError if it is bad. Reads
    only: for `gpu-agent state show` and tests (the journal's `load` also sets bad ones
    aside)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError("unreadable", f"cannot read it: {exc.strerror or exc}") from exc
    return decode(data)


def set_aside_files(path: str) -> list[str]:
    """Bad checkpoints set aside beside `path` earlier, oldest first."""
    return sorted(glob.glob(glob.escape(path) + ASIDE_MARK + "*"))


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
    """Changes waiting for one write, and the answer its callers wait for."""

    __slots__ = ("added", "changes", "done", "error")

    def __init__(self) -> None:
        self.added: list[Record] = []
        self.changes: list[Callable[[dict], None]] = []
        self.done = False
        self.error: BaseException | None = None


class Journal:
    """The records of what Allocate handed out, durable in one checkpoint file."""

    def __init__(self, path: str, *, boot: str, keyed_by: str = DEFAULT_DEVICE_ID_STRATEGY,
                 clock: Callable[[], float] = time.time):
        self.path = os.path.abspath(path)
        self.directory = os.path.dirname(self.path)
        self.boot = boot
        self.keyed_by = keyed_by
        self.clock = clock
        self._records: dict[str, Record] = {}
        self._cond = threading.Condition()
        self._pending: _Batch | None = None
        self._writing = False
        self._listeners: list[Callable[[], None]] = []
        self._packed: dict[str, tuple[Record, bytes]] = {}  # record ID -> (record, msgpack)
        self.blocked = ""  # why writes are refused: a bad file could not be moved aside
        self.version = 0  # bumped on every change in memory
        self.writes = 0
        self.last_write: float | None = None
        self.last_error = ""
        self.set_aside: list[SetAside] = []
        self.earlier_aside: list[str] = []
        self.loaded = 0
        self.loaded_boot = ""

    def __repr__(self) -> str:
        return f"Journal({self.path!r}, {len(self._records)} records)"

    # -- loading -------------------------------------------------------------------------------

    def load(self) -> None:
        """Read the checkpoint into memory. A bad one is moved aside and reported (log,
        `set_aside`); the journal then starts empty. Never raises for a bad file."""
        self.earlier_aside = set_aside_files(self.path)
        tmp = self.path + TEMP_SUFFIX
        try:
            os.unlink(tmp)  # a write cut short: the real file is intact
            log.info("removed %s, left by a write that did not finish", tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove %s: %s", tmp, exc)
        try:
            cp = read_checkpoint(self.path)
        except CheckpointError as exc:
            self._put_aside(exc)
            return
        if cp is None:
            log.info("no checkpoint at %s: starting with no recorded allocations", self.path)
            return
        with self._cond:
            self._records = {r.id: r for r in cp.records}
            self.version += 1
        self.loaded, self.loaded_boot = len(cp.records), cp.boot
        attributed = sum(1 for r in cp.records if r.pod is not None)
        log.info("loaded %d allocation records (%d attributed to pods) from %s", len(cp.records),
                 attributed, self.path)
        if cp.boot != self.boot and cp.records:
            log.info("the checkpoint was written in boot %s, this is boot %s: its records are "
                     "kept only where podresources confirms them", cp.boot or "unknown",
                     self.boot or "unknown")
        if cp.keyed_by != self.keyed_by:
            log.info("the checkpoint matched GPUs by %s; they are now matched by %s "
                     "(checkpointDeviceIDStrategy)", cp.keyed_by, self.keyed_by)

    def _put_aside(self, exc: CheckpointError) -> None:
        now = self.clock()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        target = ""
        try:
            target = self._move_aside(stamp)
        except OSError as move_exc:
            self.blocked = (f"the bad checkpoint {self.path} ({exc.problem}) could not be "
                             f"moved aside ({move_exc}); refusing to overwrite it: move it "
                             f"away and restart gpu-agent")
            self.last_error = self.blocked
            log.error("%s", self.blocked)
            self.set_aside.append(SetAside("", exc.kind, exc.problem, now))
            return
        self.set_aside.append(SetAside(target, exc.kind, exc.problem, now))
        log.error("checkpoint %s is %s (%s): moved aside to %s; starting from what "
                  "podresources reports", self.path, _KIND_WORDS.get(exc.kind, exc.kind),
                  exc.problem, target)

    def _move_aside(self, stamp: str) -> str:
        for n in range(1000):
            target = f"{self.path}{ASIDE_MARK}{stamp}" + (f"-{n}" if n else "")
            if os.path.lexists(target):
                continue
            try:
                os.link(self.path, target)  # fails rather than replace an existing file
            except FileExistsError:
                continue
            except OSError:  # a directory, or a filesystem without hard links
                if os.path.lexists(target):
                    continue
                os.rename(self.path, target)
            else:
                os.unlink(self.path)
            fsync_dir(self.directory)
            return target
        raise OSError(f"no free name for {self.path}{ASIDE_MARK}{stamp}")

    # -- reading -------------------------------------------------------------------------------

    def records(self) -> tuple[Record, ...]:
        """Every record, oldest first."""
        with self._cond:
            return tuple(sorted(self._records.values(), key=lambda r: (r.time, r.id)))

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call fn() (from the appending thread, after the write) whenever Allocate records
        are appended."""
        self._listeners.append(fn)

    def status(self) -> dict:
        with self._cond:
            records = list(self._records.values())
            version = self.version
        return {
            "checkpoint": self.path,
            "keyedBy": self.keyed_by,
            "boot": self.boot,
            "allocations": len(records),
            "attributed": sum(1 for r in records if r.pod is not None),
            "pending": sum(1 for r in records if r.pod is None),
            "version": version,
            "writes": self.writes,
            "lastWrite": self.last_write,
            "lastError": self.last_error,
            "loaded": self.loaded,
            "loadedBoot": self.loaded_boot,
            "setAside": [a.to_dict() for a in self.set_aside],
            "setAsideEarlier": list(self.earlier_aside),
        }

    # -- recording -----------------------------------------------------------------------------

    def record_allocation(self, resource: str, containers: Sequence[tuple[Sequence[Any], Any]]
                          ) -> list[Record]:
        """Record one Allocate: for each container, its devices (agent.rm.devices.Device) and
        the response given. Returns once durable; StateError if it could not be written.
        This is the `journal` hook of agent.rm.manager.ResourceManager."""
        now = self.clock()
        records = [
            Record(id=uuid.uuid4().hex, resource=resource,
                   devices=tuple(d.id for d in devices),
                   gpus=tuple(GpuRef(d.gpu_uuid, int(d.gpu_index)) for d in devices),
                   response=response_record(response), time=now, boot=self.boot)
            for devices, response in containers
        ]
        self.append(records)
        return records

    def append(self, records: Iterable[Record]) -> None:
        """Add `records`; return once a write holding them is durable."""
        self._submit(added=list(records))
        for fn in self._listeners:
            fn()

    def apply(self, outcome: Outcome) -> bool:
        """Apply a reconciliation of (a snapshot of) the records: drop what it dropped,
        update what it kept, add what it adopted. Records appended since the snapshot are
        untouched. Writes when anything changed; True then. StateError if the write failed
        (kept in memory: the next write carries it)."""
        adopted = {r.id for r in outcome.adopted}
        with self._cond:
            drop = [r.id for r, _ in outcome.dropped if r.id in self._records]
            update = [r for r in outcome.kept if self._records.get(r.id, r) != r]
            add = [r for r in outcome.kept if r.id in adopted and r.id not in self._records]
        if not drop and not update and not add:
            return False

        def change(records: dict) -> None:
            for rid in drop:
                records.pop(rid, None)
            for r in update:
                if r.id in records:
                    records[r.id] = r
            for r in add:
                records.setdefault(r.id, r)

        self._submit(change=change)
        return True

    def flush(self) -> None:
        """Write the current records now (durable on return)."""
        self._submit(change=lambda records: None)

    def _submit(self, added: Sequence[Record] = (), change: Callable[[dict], None] | None = None
                ) -> None:
        with self._cond:
            if self.blocked:
                raise StateError(self.blocked)
            batch = self._pending
            if batch is None:
                batch = self._pending = _Batch()
            batch.added.extend(added)
            if change is not None:
                batch.changes.append(change)
            while not batch.done:
                if self._writing:
                    self._cond.wait()
                    continue
                # leader: write everything waiting, our batch included
                self._writing, self._pending = True, None
                error: BaseException | None = None
                try:
                    for fn in batch.changes:
                        fn(self._records)
                    for r in batch.added:
                        self._records[r.id] = r
                    self.version += 1
                    snapshot = Checkpoint(tuple(sorted(self._records.values(),
                                                       key=lambda r: (r.time, r.id))),
                                          written=self.clock(), boot=self.boot,
                                          keyed_by=self.keyed_by)
                    self._cond.release()
                    try:
                        error = self._write(encode_chunks(snapshot, self._pack))
                        if len(self._packed) > len(snapshot.records) + 64:
                            live = {r.id for r in snapshot.records}
                            self._packed = {k: v for k, v in self._packed.items() if k in live}
                    finally:
                        self._cond.acquire()
                except Exception as exc:
                    # not an OSError (a bug, a record msgpack cannot pack): fail this batch
                    # like a failed write, never leave the followers behind it waiting
                    log.exception("checkpoint write failed")
                    error = exc
                self._writing = False
                batch.done, batch.error = True, error
                if error is not None:
                    for r in batch.added:
                        if self._records.get(r.id) is r:
                            del self._records[r.id]
                    self.version += 1
                self._cond.notify_all()
            if batch.error is not None:
                raise StateError(f"cannot write the checkpoint {self.path}: "
                                 f"{batch.error}") from batch.error

    # -- the file ------------------------------------------------------------------------------

    def _pack(self, r: Record) -> bytes:
        """A record's msgpack, packed once (records are immutable; only the leader of a
        write calls this, one write at a time)."""
        hit = self._packed.get(r.id)
        if hit is not None and hit[0] is r:
            return hit[1]
        data = pack_record(r)
        self._packed[r.id] = (r, data)
        return data

    def _write(self, chunks: Sequence[bytes]) -> OSError | None:
        """Write `chunks`, one after another, as the checkpoint, atomically and durably; the
        OSError if it failed (the previous file is then intact)."""
        try:
            write_atomic(self.path, chunks, 0o600)
        except OSError as exc:
            if str(exc) != self.last_error:
                log.error("cannot write the checkpoint %s: %s", self.path, exc)
            self.last_error = str(exc)
            return exc
        if self.last_error and not self.blocked:
            log.info("checkpoint %s written again", self.path)
            self.last_error = ""
        self.writes += 1
        self.last_write = self.clock()
        return None


_KIND_WORDS = {"truncated": "truncated", "corrupt": "corrupt", "version": "of an unknown "
               "schema version", "unreadable": "unreadable"}
