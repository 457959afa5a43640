"""What the allocation journal finds in the state directory at start, and reading it back.

Owns: the state directory's file names (the journal, the old single-file checkpoint, the
marks of a migrated or a set-aside file); `find`, which the journal runs once at start: a
write a crash cut short left as a temp file is removed, the journal is read and replayed (a
torn tail cut and reported once), a file otherwise unreadable is moved aside with a timestamp
(a hard link then an unlink: never overwritten) and reported, and with no journal the old
checkpoint is read to be migrated (`retire_legacy` renames it once the journal holds its
records); `read_journal` and `set_aside_files` for `gpu-agent state show`, the doctor and
tests. Must not write the journal (agent.state.journal appends and rewrites it) nor decide
which records stand (agent.state.reconcile).
"""

from __future__ import annotations

import glob
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from agent.constants import DEFAULT_DEVICE_ID_STRATEGY
from agent.errors import CheckpointError
from agent.fileio import TEMP_SUFFIX, fsync_dir
from agent.state import frames
from agent.state.checkpoint import Checkpoint, Record, decode

log = logging.getLogger(__name__)

JOURNAL_FILE = "allocations.journal"
LEGACY_FILE = "checkpoint.msgpack"  # schema 1, read once and migrated
MIGRATED_MARK = ".migrated"
ASIDE_MARK = ".bad-"
# A journal holding more entries than live records is rewritten at start from this many on.
REWRITE_MIN_ENTRIES = 64
_KIND_WORDS = {"truncated": "truncated", "corrupt": "corrupt", "version": "of an unknown "
               "schema version", "unreadable": "unreadable"}


@dataclass(frozen=True)
class SetAside:
    """A bad journal or checkpoint moved out of the way: where it went, why, and when."""

    path: str
    kind: str  # truncated, corrupt, version, unreadable
    reason: str
    at: float

    def to_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "reason": self.reason, "at": self.at}


@dataclass
class Found:
    """What `find` found: the records, by ID in the order first written, and what the
    journal reports about its file."""

    records: dict[str, Record] = field(default_factory=dict)
    boot: str = ""  # the boot the file was written in
    entries: int = 0  # entries in the file (meta entries not counted)
    size: int = 0  # bytes of whole entries
    rewrite: bool = True  # write the records as a fresh journal before appending
    torn: dict | None = None  # the torn tail cut off
    migrated_from: str = ""  # the old checkpoint the records came from
    set_aside: list[SetAside] = field(default_factory=list)
    blocked: str = ""  # a bad file could not be moved aside: why writes are refused


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


def find(path: str, *, boot: str, keyed_by: str, clock: Callable[[], float]) -> Found:
    """What the journal at `path` (or the old checkpoint beside it) holds, for a journal of
    boot `boot` keyed by `keyed_by`; a bad file is moved aside and reported (the records are
    then none). Never raises for a bad file."""
    legacy = os.path.join(os.path.dirname(path), LEGACY_FILE)
    for tmp in (path + TEMP_SUFFIX, legacy + TEMP_SUFFIX):
        try:
            os.unlink(tmp)  # a write cut short: the real file is intact
            log.info("removed %s, left by a write that did not finish", tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove %s: %s", tmp, exc)
    found, source = Found(), path
    try:
        data = _read(path)
        if data is None:
            source = legacy
            data = _read(legacy)
            if data is None:
                log.info("no journal at %s: starting with no recorded allocations", path)
                return found
            cp = decode(data)
            found.records, found.boot = {r.id: r for r in cp.records}, cp.boot
            found.migrated_from, written_by = legacy, cp.keyed_by
            log.info("migrating the checkpoint %s (schema 1) to the journal %s", legacy, path)
        else:
            scan = frames.scan(data)
            found.records, found.entries, found.size = scan.records, scan.entries, scan.good_end
            meta = scan.meta
            found.boot, written_by = (meta.boot, meta.keyed_by) if meta else (boot, keyed_by)
            if scan.torn:
                found.torn = {"at": scan.good_end, "bytes": len(data) - scan.good_end,
                              "reason": scan.torn, "time": clock()}
                log.warning("journal %s: %s: cut off (%d bytes; a write the agent or the host "
                            "did not finish)", path, scan.torn, len(data) - scan.good_end)
            found.rewrite = bool(scan.torn) or meta is None or (
                scan.entries > len(scan.records) and scan.entries >= REWRITE_MIN_ENTRIES)
    except CheckpointError as exc:
        _put_aside(found, source, exc, clock())
        return found
    records = found.records.values()
    log.info("loaded %d allocation records (%d attributed to pods) from %s", len(records),
             sum(1 for r in records if r.pod is not None), source)
    if found.boot != boot and records:
        log.info("the journal was written in boot %s, this is boot %s: its records are kept "
                 "only where podresources confirms them", found.boot or "unknown",
                 boot or "unknown")
    if written_by != keyed_by:
        log.info("the journal matched GPUs by %s; they are now matched by %s "
                 "(checkpointDeviceIDStrategy)", written_by, keyed_by)
    return found


def retire_legacy(found: Found) -> None:
    """The old checkpoint's records are in the journal now: rename it (kept for a downgrade;
    nothing reads it while the journal exists)."""
    legacy = found.migrated_from
    target = legacy + MIGRATED_MARK
    try:
        os.replace(legacy, target)
        fsync_dir(os.path.dirname(legacy))
    except OSError as exc:
        log.warning("migrated %s, but cannot rename it to %s: %s (it is read again, and "
                    "ignored, while the journal exists)", legacy, target, exc)
        return
    log.info("migrated %d records; the old checkpoint is kept as %s", len(found.records),
             target)


def _put_aside(found: Found, path: str, exc: CheckpointError, now: float) -> None:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    found.records, found.entries, found.size, found.rewrite = {}, 0, 0, True
    found.torn, found.migrated_from = None, ""
    try:
        target = _move_aside(path, stamp)
    except OSError as move_exc:
        found.blocked = (f"the bad file {path} ({exc.problem}) could not be moved aside "
                         f"({move_exc}); refusing to overwrite it: move it away and restart "
                         f"gpu-agent")
        log.error("%s", found.blocked)
        found.set_aside.append(SetAside("", exc.kind, exc.problem, now))
        return
    found.set_aside.append(SetAside(target, exc.kind, exc.problem, now))
    log.error("%s is %s (%s): moved aside to %s; starting from what podresources reports",
              path, _KIND_WORDS.get(exc.kind, exc.kind), exc.problem, target)


def _move_aside(path: str, stamp: str) -> str:
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
        fsync_dir(os.path.dirname(path))
        return target
    raise OSError(f"no free name for {path}{ASIDE_MARK}{stamp}")
