"""What one allocation record holds, its one encoder and one decoder, and the old checkpoint.

Owns: `Record` (one container's allocation: resource, device IDs, the physical GPUs behind
them, the Allocate response given (None for an allocation adopted from podresources, whose
response the agent never saw), when, in which boot, and the pod it was attributed to),
`record_data` / `record_from_data` (a record as the msgpack map of the schema, and back: the
only encoder and decoder of a record, for the journal's entries and the old file alike),
`by_age` (the order of records), and the single-file checkpoint of schema 1 (`Checkpoint`,
`decode`, and `encode` for the files the migration is tested on), which the journal reads
once to migrate it.

The old file is one msgpack map, the frame:

    {"format": "gpu-agent checkpoint", "version": 1, "sha256": <32 bytes>, "body": <bytes>}

`sha256` is the SHA-256 of b"<version>:" + body, so a flipped bit anywhere (version included)
is a checksum mismatch, and a file a newer gpu-agent wrote (a higher version, its checksum
right) is told apart from a damaged one. `body` is itself msgpack; its schema for version 1 is
in docs/state.md. `decode` and `record_from_data` check every field and raise CheckpointError
with a `kind` ("truncated", "corrupt", "version") and the path of the bad field. Must not touch
files, import grpc or NVML, or know what the agent does with records (agent.state.journal
stores them, agent.state.reconcile matches them to pods).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from types import MappingProxyType
from typing import Any, NamedTuple

import msgpack

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


# A sort key: records in the order of their Allocates, ties in the order they came (the key is
# the record's own time: a sort of 10,000 records makes no 10,000 key tuples, which left their
# holes among the records kept meanwhile: 0.7 MB more memory after 10,000 Allocates).
by_age = attrgetter("time")

# A Record (PodRef, GpuRef, Response...) from the tuple of all its fields, without the
# Python-level __new__ that NamedTuple generates: for the paths that make them by the thousand.
from_fields = tuple.__new__


def response_of(r: Any) -> Response:
    """The Response of an agent.rm.allocate.ContainerResponse (read by attribute)."""
    return Response(
        envs=dict(r.envs),
        mounts=tuple(MountRec(m.container_path, m.host_path, bool(m.read_only))
                     for m in r.mounts),
        devices=tuple(DeviceSpecRec(s.container_path, s.host_path, s.permissions)
                      for s in r.devices),
        annotations=dict(r.annotations),
        cdi_devices=tuple(r.cdi_devices),
    )


# ---------------------------------------------------------------------------------------------
# Encoding: the one encoder of a record (the journal's put entries, the old checkpoint's body).


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


def _digest(version: int, body: bytes) -> bytes:
    """SHA-256 of b"<version>:" + body. hashlib is imported here: it loads OpenSSL's libcrypto
    (3.8 MB resident), and only a version-1 file needs it (read once, to migrate it to the
    journal, whose frames use CRC-32)."""
    import hashlib

    return hashlib.sha256(b"%d:" % version + body).digest()


def encode(cp: Checkpoint) -> bytes:
    """The old single file's bytes for `cp` (version 1; the agent only reads it, to migrate it:
    this writes the files the migration is tested on)."""
    body = msgpack.packb({"written": float(cp.written), "boot": cp.boot,
                          "keyedBy": cp.keyed_by,
                          "records": [record_data(r) for r in cp.records]}, use_bin_type=True)
    return msgpack.packb({"format": FORMAT, "version": VERSION,
                          "sha256": _digest(VERSION, body), "body": body}, use_bin_type=True)


# ---------------------------------------------------------------------------------------------
# Decoding: the one decoder of a record, every field checked, the first problem named by its
# path. The paths are made only for the error: a restart decodes every record of the journal.


def _bad(where: str, problem: str) -> CheckpointError:
    return CheckpointError("corrupt", f"{where}: {problem}")


def _expected(value: Any, what: str, where: str) -> CheckpointError:
    got = repr(value) if isinstance(value, bool) else type(value).__name__
    return _bad(where, f"expected {what}, got {got}")


def _typed(value: Any, types: Any, what: str, where: str) -> Any:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _expected(value, what, where)
    if not isinstance(value, types):
        raise _expected(value, what, where)
    return value


def _map(value: Any, keys: tuple[str, ...], where: str, keyset: frozenset = frozenset()
         ) -> dict:
    """`value`, a map of exactly `keys` (`keyset`: the same as a set, made once)."""
    if type(value) is dict and value.keys() == (keyset or set(keys)):
        return value
    _typed(value, dict, "a map", where)
    missing = [k for k in keys if k not in value]
    if missing:
        raise _bad(where, f"missing {', '.join(missing)}")
    raise _bad(where, f"unexpected {', '.join(sorted(str(k) for k in value if k not in keys))}")


def _str(value: Any, where: str, field: str) -> str:
    if type(value) is str:
        return value
    raise _expected(value, "a string", where + field)


def _strs(value: Any, where: str, field: str) -> tuple[str, ...]:
    if type(value) is not list:
        raise _expected(value, "a list", where + field)
    for i, v in enumerate(value):
        if type(v) is not str:
            raise _expected(v, "a string", f"{where}{field}[{i}]")
    return tuple(value)


def _str_map(value: Any, where: str, field: str) -> dict[str, str]:
    if type(value) is not dict:
        raise _expected(value, "a map", where + field)
    for k, v in value.items():
        if type(k) is not str:
            raise _expected(k, "a string key", where + field)
        if type(v) is not str:
            raise _expected(v, "a string", f"{where}{field}.{k}")
    return value


def _time(value: Any, where: str, field: str) -> float:
    if type(value) is float or type(value) is int:
        return float(value)
    raise _expected(value, "a number", where + field)


def _triples(value: Any, kind: type, types: tuple, where: str, field: str) -> tuple:
    """A list of [a, b, c] lists of `types`, as `kind` tuples."""
    if type(value) is not list:
        raise _expected(value, "a list", where + field)
    out = []
    for i, item in enumerate(value):
        if type(item) is not list or len(item) != 3 or type(item[0]) is not types[0] or \
                type(item[1]) is not types[1] or type(item[2]) is not types[2]:
            at = f"{where}{field}[{i}]"
            _typed(item, list, "a list of 3", at)
            if len(item) != 3:
                raise _bad(at, f"expected 3 items, got {len(item)}")
            for j, (v, t) in enumerate(zip(item, types)):
                _typed(v, t, t.__name__, f"{at}[{j}]")
        out.append(from_fields(kind, item))
    return tuple(out)


_RECORD_KEYS = ("id", "resource", "devices", "gpus", "response", "time", "boot", "pod",
                "confirmed")
_RESPONSE_KEYS = ("envs", "mounts", "devices", "annotations", "cdiDevices")
_RECORD_SET, _RESPONSE_SET = frozenset(_RECORD_KEYS), frozenset(_RESPONSE_KEYS)
_record_fields = itemgetter(*_RECORD_KEYS)
_response_fields = itemgetter(*_RESPONSE_KEYS)


def _response(value: Any, where: str) -> Response:
    envs, mounts, devices, annotations, cdi = _response_fields(
        _map(value, _RESPONSE_KEYS, f"{where}.response", _RESPONSE_SET))
    return from_fields(Response, (
        _str_map(envs, where, ".response.envs"),
        _triples(mounts, MountRec, (str, str, bool), where, ".response.mounts"),
        _triples(devices, DeviceSpecRec, (str, str, str), where, ".response.devices"),
        _str_map(annotations, where, ".response.annotations"),
        _strs(cdi, where, ".response.cdiDevices"),
    ))


def _gpus(value: Any, where: str) -> tuple[GpuRef, ...]:
    if type(value) is not list:
        raise _expected(value, "a list", f"{where}.gpus")
    out = []
    for i, g in enumerate(value):
        if type(g) is not list or len(g) != 2 or type(g[0]) is not str or type(g[1]) is not int:
            at = f"{where}.gpus[{i}]"
            _typed(g, list, "[uuid, index]", at)
            if len(g) != 2:
                raise _bad(at, f"expected [uuid, index], got {len(g)} items")
            _typed(g[0], str, "a string", f"{at}[0]")
            _typed(g[1], int, "an integer", f"{at}[1]")
        out.append(from_fields(GpuRef, g))
    return tuple(out)


def record_from_data(value: Any, where: str) -> Record:
    """`record_data`'s map back as a Record; CheckpointError naming `where` and the field if
    it is bad."""
    rid, resource, devices, gpus, response, t, boot, pod, confirmed = _record_fields(
        _map(value, _RECORD_KEYS, where, _RECORD_SET))
    gpus = _gpus(gpus, where)
    if response is not None:
        response = _response(response, where)
    if pod is not None:
        parts = _strs(pod, where, ".pod")
        if len(parts) != 3:
            raise _bad(f"{where}.pod", f"expected [namespace, name, container], got "
                                       f"{len(parts)} items")
        pod = from_fields(PodRef, parts)
    return from_fields(Record, (
        _str(rid, where, ".id"), _str(resource, where, ".resource"),
        _strs(devices, where, ".devices"), gpus, response, _time(t, where, ".time"),
        _str(boot, where, ".boot"), pod,
        None if confirmed is None else _time(confirmed, where, ".confirmed")))


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
    return Checkpoint(records=records, written=_time(doc["written"], "body", ".written"),
                      boot=_typed(doc["boot"], str, "a string", "body.boot"), keyed_by=keyed_by)
