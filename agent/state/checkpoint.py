"""The checkpoint file format: what one allocation record holds and how the file is framed.

Owns: `Record` (one container's allocation: resource, device IDs, the physical GPUs behind
them, the Allocate response given (None for an allocation adopted from podresources, whose
response the agent never saw), when, in which boot, and the pod it was attributed to),
`Checkpoint` (the records and when/where they were written), `encode` / `decode`, and
and `by_age` (the order of records).

The file is one msgpack map, the frame, which every version of gpu-agent keeps as it is:

    {"format": "gpu-agent checkpoint", "version": 1, "sha256": <32 bytes>, "body": <bytes>}

`sha256` is the SHA-256 of b"<version>:" + body, so a flipped bit anywhere (version included)
is a checksum mismatch, and a file a newer gpu-agent wrote (a higher version, its checksum
right) is told apart from a damaged one. `body` is itself msgpack; its schema for version 1 is
in docs/state.md. `decode` checks every field and raises CheckpointError with a `kind`
("truncated", "corrupt", "version") and the path of the bad field. Must not touch files, import
grpc or NVML, or know what the agent does with records (agent.state.journal stores them,
agent.state.reconcile matches them to pods).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Callable, NamedTuple

import msgpack

from agent import _fast
from agent.constants import DEFAULT_DEVICE_ID_STRATEGY, DEVICE_ID_STRATEGIES
from agent.errors import CheckpointError

FORMAT = "gpu-agent checkpoint"
VERSION = 1
NOT_A_CHECKPOINT = f"not a gpu-agent checkpoint (no '{FORMAT}' frame)"


class GpuRef(NamedTuple):
    """A physical GPU behind an allocated device: its UUID and its NVML index."""

    uuid: str
    index: int


class PodRef(NamedTuple):
    """The container an allocation was attributed to through podresources."""

    namespace: str
    name: str
    container: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} container {self.container}"


class MountRec(NamedTuple):
    container_path: str
    host_path: str
    read_only: bool


class DeviceSpecRec(NamedTuple):
    container_path: str
    host_path: str
    permissions: str


_NONE: Mapping[str, str] = MappingProxyType({})


class Response(NamedTuple):
    """The ContainerAllocateResponse given, as plain data (never changed once made)."""

    envs: Mapping[str, str] = _NONE
    mounts: tuple[MountRec, ...] = ()
    devices: tuple[DeviceSpecRec, ...] = ()
    annotations: Mapping[str, str] = _NONE
    cdi_devices: tuple[str, ...] = ()


class Record(NamedTuple):
    """One container's allocation of one resource, as Allocate answered it. A tuple: the
    journal holds one per running GPU container (and every unclaimed Allocate), so it is as
    small as a record can be; records of the same answer share their Response."""

    id: str  # unique per record (a random UUID)
    resource: str
    devices: tuple[str, ...]  # the device IDs kubelet asked for, in request order
    gpus: tuple[GpuRef, ...]  # the physical GPUs behind them
    response: Response | None  # None: adopted from podresources, the response is not known
    time: float  # unix time of the Allocate (or of the adoption)
    boot: str  # the host's boot ID at that time
    pod: PodRef | None = None  # None until podresources attributes it
    confirmed: float | None = None  # unix time podresources last listed it

    def with_pod(self, pod: PodRef | None, confirmed: float | None) -> Record:
        return self._replace(pod=pod, confirmed=confirmed)

    def describe(self) -> str:
        gpus = ", ".join(f"GPU {g.index} {g.uuid}" for g in self.gpus)
        who = str(self.pod) if self.pod else "no pod yet"
        return f"{self.resource} [{gpus}] ({who})"


@dataclass(frozen=True)
class Checkpoint:
    """The whole file: its records, when and in which boot it was written, and the key
    (`keyed_by`: "uuid" or "index") records were matched to GPUs by when it was written."""

    records: tuple[Record, ...] = ()
    written: float = 0.0
    boot: str = ""
    keyed_by: str = DEFAULT_DEVICE_ID_STRATEGY


# ---------------------------------------------------------------------------------------------
# Encoding.


def record_data(r: Record) -> dict:
    """A record as the msgpack map of the schema (the checkpoint's and the journal's)."""
    resp = r.response
    response = None if resp is None else {
        "envs": dict(resp.envs),
        "mounts": [list(m) for m in resp.mounts],
        "devices": [list(d) for d in resp.devices],
        "annotations": dict(resp.annotations),
        "cdiDevices": list(resp.cdi_devices),
    }
    return {
        "id": r.id,
        "resource": r.resource,
        "devices": list(r.devices),
        "gpus": [[g.uuid, g.index] for g in r.gpus],
        "response": response,
        "time": float(r.time),
        "boot": r.boot,
        "pod": list(r.pod) if r.pod is not None else None,
        "confirmed": float(r.confirmed) if r.confirmed is not None else None,
    }


def _sha256(data: bytes):
    """hashlib.sha256(data), hashlib imported here: it loads OpenSSL's libcrypto (3.8 MB
    resident), and only a version-1 file needs it (read once, to migrate it to the journal,
    whose frames use CRC-32)."""
    import hashlib

    return hashlib.sha256(data)


def _digest(version: int, body: bytes) -> bytes:
    return _sha256(b"%d:" % version + body).digest()


def pack_record(r: Record) -> bytes:
    """One record as msgpack (what `encode` puts in the body's list)."""
    return msgpack.packb(record_data(r), use_bin_type=True)


def encode(cp: Checkpoint, packed: Callable[[Record], bytes] = pack_record) -> bytes:
    """The file's bytes for `cp` (current version). `packed` gives a record's msgpack bytes:
    the journal passes a cache, records being immutable, so a write packs only new ones."""
    return b"".join(encode_chunks(cp, packed))


def encode_chunks(cp: Checkpoint, packed: Callable[[Record], bytes] = pack_record
                  ) -> list[bytes]:
    """`encode`'s bytes as pieces to write one after another, without ever joining them: a
    large checkpoint then never needs one large buffer (glibc keeps freed large buffers in
    per-thread arenas, and the agent's gRPC threads would each grow one)."""
    p = msgpack.Packer(use_bin_type=True)
    body = [
        p.pack_map_header(4),
        p.pack("written"), p.pack(float(cp.written)),
        p.pack("boot"), p.pack(cp.boot),
        p.pack("keyedBy"), p.pack(cp.keyed_by),
        p.pack("records"), p.pack_array_header(len(cp.records)),
        *[packed(r) for r in cp.records],
    ]
    digest = _sha256(b"%d:" % VERSION)
    for chunk in body:
        digest.update(chunk)
    # the frame as msgpack.packb({"format", "version", "sha256", "body"}) writes it, with the
    # body's bin header written by hand so that the body stays in pieces
    head = [p.pack_map_header(4), p.pack("format"), p.pack(FORMAT), p.pack("version"),
            p.pack(VERSION), p.pack("sha256"), p.pack(digest.digest()), p.pack("body"),
            _bin_header(sum(len(c) for c in body))]
    return head + body


def _bin_header(n: int) -> bytes:
    """msgpack's header of a bin of `n` bytes (the Packer has none for bin)."""
    if n < 1 << 8:
        return struct.pack(">BB", 0xC4, n)
    if n < 1 << 16:
        return struct.pack(">BH", 0xC5, n)
    return struct.pack(">BI", 0xC6, n)


# ---------------------------------------------------------------------------------------------
# Decoding: every field checked, the first problem named by its path.


def _bad(where: str, problem: str) -> CheckpointError:
    return CheckpointError("corrupt", f"{where}: {problem}")


def _typed(value: Any, types: Any, what: str, where: str) -> Any:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _bad(where, f"expected {what}, got {value!r}")
    if not isinstance(value, types):
        raise _bad(where, f"expected {what}, got {type(value).__name__}")
    return value


def _map(value: Any, keys: tuple[str, ...], where: str) -> dict:
    _typed(value, dict, "a map", where)
    missing = [k for k in keys if k not in value]
    if missing:
        raise _bad(where, f"missing {', '.join(missing)}")
    extra = sorted(str(k) for k in value if k not in keys)
    if extra:
        raise _bad(where, f"unexpected {', '.join(extra)}")
    return value


def _strs(value: Any, where: str) -> tuple[str, ...]:
    _typed(value, list, "a list", where)
    return tuple(_typed(v, str, "a string", f"{where}[{i}]") for i, v in enumerate(value))


def _str_map(value: Any, where: str) -> dict[str, str]:
    _typed(value, dict, "a map", where)
    for k, v in value.items():
        _typed(k, str, "a string key", where)
        _typed(v, str, "a string", f"{where}.{k}")
    return dict(value)


def _time(value: Any, where: str) -> float:
    return float(_typed(value, (float, int), "a number", where))


def _triples(value: Any, types: tuple, where: str) -> list[tuple]:
    _typed(value, list, "a list", where)
    out = []
    for i, item in enumerate(value):
        _typed(item, list, "a list of 3", f"{where}[{i}]")
        if len(item) != 3:
            raise _bad(f"{where}[{i}]", f"expected 3 items, got {len(item)}")
        for j, (v, t) in enumerate(zip(item, types)):
            _typed(v, t, t.__name__, f"{where}[{i}][{j}]")
        out.append(tuple(item))
    return out


_RECORD_KEYS = ("id", "resource", "devices", "gpus", "response", "time", "boot", "pod",
                "confirmed")
_RESPONSE_KEYS = ("envs", "mounts", "devices", "annotations", "cdiDevices")


def _response(value: Any, where: str) -> Response:
    r = _map(value, _RESPONSE_KEYS, f"{where}.response")
    return Response(
        envs=_str_map(r["envs"], f"{where}.response.envs"),
        mounts=tuple(MountRec(*m) for m in
                     _triples(r["mounts"], (str, str, bool), f"{where}.response.mounts")),
        devices=tuple(DeviceSpecRec(*s) for s in
                      _triples(r["devices"], (str, str, str), f"{where}.response.devices")),
        annotations=_str_map(r["annotations"], f"{where}.response.annotations"),
        cdi_devices=_strs(r["cdiDevices"], f"{where}.response.cdiDevices"),
    )


# A sort key: records in the order of their Allocates (the ID breaks ties).
by_age = attrgetter("time", "id")

# A Record (PodRef, GpuRef) from the tuple of all its fields, without the Python-level __new__
# that NamedTuple generates: for the paths that make one per Allocate or by the thousand.
from_fields = tuple.__new__


# The record types, in the order agent._fast's replay builds them from the journal (it may not
# import this module).
KINDS = (Record, GpuRef, PodRef, Response, MountRec, DeviceSpecRec)


def record_from_data(value: Any, where: str) -> Record:
    """`record_data`'s map back as a Record; CheckpointError naming `where` if it is bad. The
    common case goes through the live replay hot path (agent._fast), which takes only
    well-formed maps; anything else is checked here field by field."""
    fast = _fast.entries_impl.record(value, KINDS)
    return _checked_record(value, where) if fast is None else fast


def _checked_record(value: Any, where: str) -> Record:
    d = _map(value, _RECORD_KEYS, where)
    gpus = []
    _typed(d["gpus"], list, "a list", f"{where}.gpus")
    for i, g in enumerate(d["gpus"]):
        at = f"{where}.gpus[{i}]"
        _typed(g, list, "[uuid, index]", at)
        if len(g) != 2:
            raise _bad(at, f"expected [uuid, index], got {len(g)} items")
        gpus.append(GpuRef(_typed(g[0], str, "a string", f"{at}[0]"),
                           _typed(g[1], int, "an integer", f"{at}[1]")))
    response = None if d["response"] is None else _response(d["response"], where)
    pod = None
    if d["pod"] is not None:
        parts = _strs(d["pod"], f"{where}.pod")
        if len(parts) != 3:
            raise _bad(f"{where}.pod", f"expected [namespace, name, container], got "
                                       f"{len(parts)} items")
        pod = PodRef(*parts)
    return Record(
        id=_typed(d["id"], str, "a string", f"{where}.id"),
        resource=_typed(d["resource"], str, "a string", f"{where}.resource"),
        devices=_strs(d["devices"], f"{where}.devices"),
        gpus=tuple(gpus),
        response=response,
        time=_time(d["time"], f"{where}.time"),
        boot=_typed(d["boot"], str, "a string", f"{where}.boot"),
        pod=pod,
        confirmed=None if d["confirmed"] is None else _time(d["confirmed"], f"{where}.confirmed"),
    )


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except msgpack.ExtraData as exc:
        if what == "frame" and not isinstance(exc.unpacked, dict):
            raise CheckpointError("corrupt", NOT_A_CHECKPOINT) from None
        raise CheckpointError("corrupt", f"{what}: bytes after the end of the data") from None
    except ValueError as exc:  # msgpack's errors are ValueErrors. Cut short: "incomplete
        # input", or a length prefix beyond the bytes left ("4 exceeds max_map_len(1)")
        if "incomplete" in str(exc) or "exceeds max_" in str(exc):
            raise CheckpointError("truncated", f"{what}: the data ends early ({len(data)} "
                                               f"bytes)") from None
        raise CheckpointError("corrupt", f"{what}: not valid msgpack ({exc})") from None
    except (TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError("corrupt", f"{what}: not valid msgpack ({exc})") from None


def decode(data: bytes) -> Checkpoint:
    """The checkpoint in `data`; CheckpointError saying what is wrong."""
    if not data:
        raise CheckpointError("truncated", "the file is empty")
    frame = _unpack(data, "frame")
    if not isinstance(frame, dict) or frame.get("format") != FORMAT:
        raise CheckpointError("corrupt", NOT_A_CHECKPOINT)
    _map(frame, ("format", "version", "sha256", "body"), "frame")
    version = _typed(frame["version"], int, "an integer", "frame.version")
    digest = _typed(frame["sha256"], bytes, "bytes", "frame.sha256")
    body = _typed(frame["body"], bytes, "bytes", "frame.body")
    if digest != _digest(version, body):
        raise CheckpointError("corrupt", "checksum mismatch: the file was damaged after it "
                                         "was written")
    if version > VERSION:
        raise CheckpointError("version", f"schema version {version} is newer than this "
                                         f"gpu-agent reads ({VERSION}): written by a newer "
                                         f"gpu-agent")
    if version < 1:
        raise CheckpointError("corrupt", f"frame.version: {version} is not a schema version")
    doc = _map(_unpack(body, "body"), ("written", "boot", "keyedBy", "records"), "body")
    keyed_by = _typed(doc["keyedBy"], str, "a string", "body.keyedBy")
    if keyed_by not in DEVICE_ID_STRATEGIES:
        raise _bad("body.keyedBy",
                   f"{keyed_by!r} is not one of {', '.join(DEVICE_ID_STRATEGIES)}")
    _typed(doc["records"], list, "a list", "body.records")
    records = tuple(record_from_data(r, f"records[{i}]") for i, r in enumerate(doc["records"]))
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        raise _bad("body.records", "a record ID appears twice")
    return Checkpoint(records=records, written=_time(doc["written"], "body.written"),
                      boot=_typed(doc["boot"], str, "a string", "body.boot"), keyed_by=keyed_by)
