"""The journal file's format: a header, then length-prefixed, checksummed msgpack entries.

Owns: encoding one entry as a frame, and `scan`, which replays a whole file into records.

    file  = MAGIC frame*
    frame = <u32 length, little-endian> <u32 CRC-32 of the payload> <payload: msgpack>

Payloads are msgpack lists, the first item naming the entry:

    ["meta", version, boot, keyedBy, written]   first frame of every file (and on a change)
    ["put", <record map>]                        an allocation (Allocate, adoption, re-keying)
    ["claim", id, [namespace, pod, container], confirmed]   podresources attributed it
    ["drop", id]                                 the record no longer stands

A record map is the same map schema version 1 (the single-file checkpoint,
agent.state.checkpoint) used, written and read by agent.state.checkpoint's `record_data` and
`record_from_data`; the payloads are msgpack's own (msgpack.packb, msgpack.unpackb) and the
checksum zlib's CRC-32. A frame cut short by a crash can only be the last one: `scan` reports
it as a torn tail (the caller truncates it); a bad frame followed by more data is corruption.
Must not touch files, import grpc or NVML, or decide which records stand.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from typing import Any, NamedTuple

import msgpack

from agent.constants import DEVICE_ID_STRATEGIES
from agent.errors import CheckpointError
from agent.gcpause import paused
from agent.state.checkpoint import PodRef, Record, record_data, record_from_data

MAGIC = b"gpu-agent journal\n"
VERSION = 2  # 1 was the single-file checkpoint (agent.state.checkpoint)
_HEAD = struct.Struct("<II")
HEAD_SIZE = _HEAD.size
MAX_FRAME = 16 << 20  # a record is well under 1 KiB; a longer length is damage


class Meta(NamedTuple):
    version: int
    boot: str
    keyed_by: str
    written: float


class Scan(NamedTuple):
    """A file replayed: the live records (in the order first written), the last meta entry,
    how many entries (not counting meta) the file holds, where its good data ends, and why
    the bytes after that are not used ("" when there are none)."""

    records: dict[str, Record]
    meta: Meta | None
    entries: int
    good_end: int
    torn: str


def frame(payload: bytes) -> bytes:
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def _pack(items: list) -> bytes:
    return frame(msgpack.packb(items, use_bin_type=True))


def meta_frame(boot: str, keyed_by: str, written: float) -> bytes:
    return _pack(["meta", VERSION, boot, keyed_by, float(written)])


def put_frame(r: Record) -> bytes:
    return _pack(["put", record_data(r)])


def claim_frame(r: Record) -> bytes:
    return _pack(["claim", r.id, list(r.pod) if r.pod else None,
                  None if r.confirmed is None else float(r.confirmed)])


def drop_frame(record_id: str) -> bytes:
    return _pack(["drop", record_id])


def _corrupt(at: int, problem: str) -> CheckpointError:
    return CheckpointError("corrupt", f"entry at byte {at}: {problem}")


def _meta(items: list, at: int) -> Meta:
    if len(items) != 5 or not isinstance(items[1], int):
        raise _corrupt(at, "a meta entry is [\"meta\", version, boot, keyedBy, written]")
    version, boot, keyed_by, written = items[1:]
    if version > VERSION:
        raise CheckpointError("version", f"schema version {version} is newer than this "
                                         f"gpu-agent reads ({VERSION}): written by a newer "
                                         f"gpu-agent")
    if version != VERSION:
        raise _corrupt(at, f"{version} is not a journal schema version")
    if not isinstance(boot, str) or keyed_by not in DEVICE_ID_STRATEGIES or \
            not isinstance(written, (int, float)):
        raise _corrupt(at, "meta entry: bad boot, keyedBy or written")
    return Meta(version, boot, keyed_by, float(written))


def _apply(records: dict[str, Record], items: Any, at: int) -> None:
    op = items[0]
    if op == "put" and len(items) == 2:
        r = record_from_data(items[1], f"entry at byte {at}")
        records[r.id] = r
    elif op == "claim" and len(items) == 4:
        rid, pod, confirmed = items[1:]
        r = records.get(rid) if isinstance(rid, str) else None
        if r is None:
            raise _corrupt(at, f"claim of record {rid!r}, which the journal does not hold")
        if pod is not None and (not isinstance(pod, list) or len(pod) != 3
                                or not all(isinstance(p, str) for p in pod)):
            raise _corrupt(at, "claim: the pod is not [namespace, name, container]")
        if confirmed is not None and not isinstance(confirmed, (int, float)):
            raise _corrupt(at, "claim: confirmed is not a number")
        records[rid] = r.with_pod(PodRef(*pod) if pod else None,
                                  None if confirmed is None else float(confirmed))
    elif op == "drop" and len(items) == 2:
        if not isinstance(items[1], str) or records.pop(items[1], None) is None:
            raise _corrupt(at, f"drop of record {items[1]!r}, which the journal does not hold")
    else:
        raise _corrupt(at, f"unknown entry {str(op)[:20]!r} of {len(items)} items")


def scan(data: bytes | memoryview) -> Scan:
    """Replay the journal in `data`. CheckpointError ("corrupt", "version") when it cannot
    be used; a torn tail is not an error (Scan.torn says what was cut)."""
    with paused():  # records made by the thousand (agent.gcpause)
        return _scan(memoryview(data))


def _scan(view: memoryview) -> Scan:
    n = len(view)
    if n < len(MAGIC):
        if bytes(view) == MAGIC[:n]:
            return Scan({}, None, 0, 0, f"the file ends inside its header ({n} bytes)")
        raise CheckpointError("corrupt", "not a gpu-agent journal (no header)")
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise CheckpointError("corrupt", "not a gpu-agent journal (no header)")
    records: dict[str, Record] = {}
    meta: Meta | None = None
    entries = 0
    pos = len(MAGIC)
    unpackb = msgpack.unpackb
    while pos < n:
        length, crc = _HEAD.unpack_from(view, pos) if n - pos >= HEAD_SIZE else (0, 0)
        end = pos + HEAD_SIZE + length
        if not 0 < length <= MAX_FRAME or end > n:  # cut short, zeros or damage: say which
            torn = _torn(view, pos, n)
            if torn:
                return Scan(records, meta, entries, pos, torn)
        payload = view[pos + HEAD_SIZE:end]
        if zlib.crc32(payload) != crc:
            if end == n:  # the last frame: written in part when the agent or host stopped
                return Scan(records, meta, entries, pos,
                            f"the last entry (at byte {pos}) fails its checksum")
            raise _corrupt(pos, "checksum mismatch: the file was damaged after it was written")
        try:
            items = unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise _corrupt(pos, f"not valid msgpack ({exc})") from None
        if not isinstance(items, list) or not items:
            raise _corrupt(pos, "an entry is a list")
        if items[0] == "meta":
            meta = _meta(items, pos)
        elif meta is None:
            raise _corrupt(pos, "the first entry is not a meta entry")
        else:
            _apply(records, items, pos)
            entries += 1
        pos = end
    return Scan(records, meta, entries, pos, "")


def _torn(view: memoryview, pos: int, n: int) -> str:
    """Why the frame at `pos` is cut short ("" if it is whole)."""
    if n - pos < HEAD_SIZE:
        return f"the last entry (at byte {pos}) is cut short ({n - pos} bytes)"
    length = _HEAD.unpack_from(view, pos)[0]
    if length == 0 and not any(view[pos:]):
        return f"the file ends in {n - pos} zero bytes (at byte {pos})"
    if length > MAX_FRAME:
        if not any(view[pos:]):
            return f"the file ends in {n - pos} zero bytes (at byte {pos})"
        raise _corrupt(pos, f"a length of {length} bytes")
    if pos + HEAD_SIZE + length > n:
        return (f"the last entry (at byte {pos}) is cut short: {n - pos - HEAD_SIZE} of "
                f"{length} bytes")
    return ""


def encode_all(records: Iterable[Record], boot: str, keyed_by: str, written: float
               ) -> list[bytes]:
    """A whole file holding `records` (compaction, migration)."""
    return [MAGIC, meta_frame(boot, keyed_by, written), *[put_frame(r) for r in records]]
