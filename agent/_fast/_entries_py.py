"""Pure-Python twin of agent._fast.entries: the allocation journal's common entries, replayed,
and a new Allocate's entry packed.

Owns: `record` (a record map as agent.state.checkpoint writes it, turned into a record, or
None when it is anything but well formed) and `replay` (from a position in the journal, apply
every frame that is whole, passes its checksum, is msgpack and is a well-formed put, claim or
drop of a known record; stop before the first that is not, leaving it unapplied). A restart
replays every entry of the journal, so this is the part that runs 10,000 times; the caller
(agent.state.frames.scan) replays the frame where it stopped with its own checks, and that
decides what is wrong or cut short. So these functions never accept more than the checked path
and never say why they stopped. `new_put_frame` packs the entry every Allocate writes, of
`Piece`s made once per answer, under an ID from `Ids`. The
record types are handed in (`kinds`: record, GPU, pod, response, mount and device-spec
classes, agent.state.checkpoint.KINDS): must not import anything of `agent`, nor touch files.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from typing import Any

import msgpack

__all__ = ["Ids", "Piece", "new_put_frame", "record", "replay"]

_HEAD = struct.Struct("<II")
HEAD_SIZE = _HEAD.size
MAX_FRAME = 16 << 20
_NUMBER = (float, int)


def _strs(value: Any) -> tuple[str, ...] | None:
    if type(value) is not list:
        return None
    for v in value:
        if type(v) is not str:
            return None
    return tuple(value)


def _str_map(value: Any) -> dict | None:
    if type(value) is not dict:
        return None
    for k, v in value.items():
        if type(k) is not str or type(v) is not str:
            return None
    return value


def _pod(value: Any, kind: type) -> Any:
    """The pod of a record or claim: None for none, False when it is not [ns, name, container]."""
    if value is None:
        return None
    parts = _strs(value)
    return False if parts is None or len(parts) != 3 else kind(*parts)


def _response(resp: Any, kinds: tuple) -> Any:
    if type(resp) is not dict or len(resp) != 5:
        return None
    envs, mounts, specs = resp.get("envs"), resp.get("mounts"), resp.get("devices")
    annotations, cdi = resp.get("annotations"), resp.get("cdiDevices")
    if type(mounts) is not list or type(specs) is not list:
        return None
    for m in mounts:
        if type(m) is not list or len(m) != 3 or type(m[0]) is not str or \
                type(m[1]) is not str or type(m[2]) is not bool:
            return None
    for s in specs:
        if type(s) is not list or len(s) != 3 or type(s[0]) is not str or \
                type(s[1]) is not str or type(s[2]) is not str:
            return None
    envs, annotations, cdi = _str_map(envs), _str_map(annotations), _strs(cdi)
    if envs is None or annotations is None or cdi is None:
        return None
    _, _, _, response, mount, spec = kinds
    return response(envs, tuple(mount(*m) for m in mounts), tuple(spec(*s) for s in specs),
                    annotations, cdi)


def record(d: Any, kinds: tuple) -> Any:
    """The record in map `d` (the nine keys of agent.state.checkpoint.record_data), or None."""
    if type(d) is not dict or len(d) != 9:
        return None
    rid, resource, devices, gpus = d.get("id"), d.get("resource"), d.get("devices"), d.get("gpus")
    t, boot, confirmed = d.get("time"), d.get("boot"), d.get("confirmed")
    if "response" not in d or "pod" not in d or "confirmed" not in d:
        return None
    resp, pod = d["response"], _pod(d["pod"], kinds[2])
    if pod is False:
        return None
    if type(rid) is not str or type(resource) is not str or type(boot) is not str or \
            type(t) not in _NUMBER or (confirmed is not None and type(confirmed) not in _NUMBER):
        return None
    record_kind, gpu = kinds[0], kinds[1]
    if type(gpus) is not list:
        return None
    refs = []
    for g in gpus:
        if type(g) is not list or len(g) != 2 or type(g[0]) is not str or type(g[1]) is not int:
            return None
        refs.append(gpu(g[0], g[1]))
    devices = _strs(devices)
    if devices is None:
        return None
    if resp is not None:
        resp = _response(resp, kinds)
        if resp is None:
            return None
    return record_kind(rid, resource, devices, tuple(refs), resp, float(t), boot, pod,
                       None if confirmed is None else float(confirmed))


def _apply(records: dict, items: list, kinds: tuple) -> bool:
    n = len(items)
    op = items[0] if n else None
    if op == "put" and n == 2:
        r = record(items[1], kinds)
        if r is None:
            return False
        records[r[0]] = r
        return True
    if op == "claim" and n == 4:
        rid, pod, confirmed = items[1], _pod(items[2], kinds[2]), items[3]
        r = records.get(rid) if type(rid) is str else None
        if r is None or pod is False:
            return False
        if confirmed is not None:
            if type(confirmed) not in _NUMBER:
                return False
            confirmed = float(confirmed)
        records[rid] = r.with_pod(pod, confirmed)
        return True
    if op == "drop" and n == 2:
        rid = items[1]
        return type(rid) is str and records.pop(rid, None) is not None
    return False


def replay(view: memoryview, pos: int, records: dict, kinds: tuple) -> tuple[int, int]:
    """Apply the frames of `view` from byte `pos` to `records` while each is a common entry:
    (where the first frame not applied starts, how many were applied)."""
    n = len(view)
    entries = 0
    unpackb = msgpack.unpackb
    while n - pos >= HEAD_SIZE:
        length, crc = _HEAD.unpack_from(view, pos)
        end = pos + HEAD_SIZE + length
        if length == 0 or length > MAX_FRAME or end > n:
            break
        payload = view[pos + HEAD_SIZE:end]
        if zlib.crc32(payload) != crc:
            break
        try:
            items = unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, TypeError, UnicodeDecodeError):
            break  # the checked replay says what is wrong with it
        if type(items) is not list or not _apply(records, items, kinds):
            break
        entries += 1
        pos = end
    return pos, entries


# -- packing: a new Allocate's "put" entry -------------------------------------------------------

# The head of a "put" entry of a record map (agent.state.frames: ["put", {9 keys}], the "id" key
# first), msgpack's str head of each length below 32 (a record ID is about 17 ASCII characters),
# the "time" key and msgpack's float 64.
_PUT_HEAD = b"\x92" + msgpack.packb("put") + b"\x89" + msgpack.packb("id")
_FIXSTR = [bytes((0xA0 | n,)) for n in range(32)]
_K_TIME = msgpack.packb("time")
_TIME = struct.Struct(">Bd")


class Ids:
    """New record IDs, one per call: `prefix` (ASCII, up to 64 characters), then a count from
    1 in lowercase hex. A call is atomic (next() on a count is)."""

    def __init__(self, prefix: str):
        if len(prefix.encode("ascii")) > 64:
            raise ValueError(f"an ID prefix of at most 64 characters, not {len(prefix)}")
        self._prefix = prefix
        self._count = itertools.count(1)

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):x}"


class Piece:
    """Packed bytes that go whole into new entries (an answer: agent.state.frames.answer_piece;
    the tail: frames.tail_piece). The compiled module prepares their checksum here; this one
    checksums each frame whole."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        if type(data) is not bytes:
            raise TypeError(f"a Piece is made of bytes, not {type(data).__name__}")
        self.data = data


def new_put_frame(record_id: str, time: float, answer: Piece, tail: Piece) -> bytes:
    """The frame of a "put" entry of a new record: its ID, then `answer` (the packed resource,
    devices, GPUs and response), its time, then `tail` (the packed boot, pod and confirmed). The
    bytes agent.state.frames.put_frame writes for the same record, without a msgpack Packer
    (each allocates its own buffer)."""
    rid = record_id.encode()
    head = _FIXSTR[len(rid)] if len(rid) < 32 else msgpack.packb(record_id)[:-len(rid)]
    payload = b"".join((_PUT_HEAD, head, rid, answer.data, _K_TIME, _TIME.pack(0xCB, time),
                        tail.data))
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload
