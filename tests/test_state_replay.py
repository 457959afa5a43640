"""The journal's replay (agent.state.frames.scan, with agent.state.checkpoint's one decoder of a
record): a restart reads back exactly what was written; damage is a torn tail (the records
before it kept) or refused as corrupt, never another answer and never a record invented; a
record or entry the agent does not write is refused with the bad field named, or read as
msgpack reads it; every frame's checksum is zlib's CRC-32 of its payload and every new record's
entry is what msgpack packs; record IDs never repeat.
"""

from __future__ import annotations

import math
import os
import struct
import threading
import zlib

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_state_format import records

from agent.errors import CheckpointError
from agent.rm.allocate import ResponseOptions, container_response
from agent.rm.devices import Device
from agent.state import checkpoint as ck
from agent.state import frames
from agent.state.checkpoint import PodRef
from agent.state.journal import JOURNAL_FILE, Journal

_SETTINGS = settings(max_examples=60, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture])


@st.composite
def journals(draw):
    """A journal's bytes (meta, puts, claims, drops, and a second meta now and then) and the
    records it must replay to, by a model of the entries."""
    model: dict = {}
    chunks = [frames.MAGIC, frames.meta_frame("boot-1", "uuid", 1.0)]
    for r in draw(st.lists(records(), max_size=8, unique_by=lambda r: r.id)):
        chunks.append(frames.put_frame(r))
        model[r.id] = r
        for _ in range(draw(st.integers(0, 2))):
            op = draw(st.sampled_from(["claim", "drop", "meta"]))
            if op == "meta":
                chunks.append(frames.meta_frame("boot-2", "index", 2.0))
            elif r.id in model and op == "claim":
                pod = draw(st.one_of(st.none(), st.builds(PodRef, st.text(max_size=5),
                                                          st.text(max_size=5),
                                                          st.text(max_size=5))))
                confirmed = draw(st.one_of(st.none(), st.integers(0, 2**31),
                                           st.floats(0, 4e9)))
                model[r.id] = model[r.id].with_pod(pod, None if confirmed is None
                                                   else float(confirmed))
                chunks.append(frames.frame(msgpack.packb(["claim", r.id, pod and list(pod),
                                                          confirmed])))
            elif r.id in model:
                del model[r.id]
                chunks.append(frames.drop_frame(r.id))
    return b"".join(chunks), model


def _outcome(data: bytes) -> tuple:
    """What scan says about `data`: its whole result, or the error's kind and message."""
    try:
        return ("scan", frames.scan(data))
    except CheckpointError as exc:
        return ("error", exc.kind, str(exc))


@_SETTINGS
@given(journal=journals())
def test_property_a_journal_replays_to_what_was_written(journal):
    data, model = journal
    scan = frames.scan(data)
    assert scan.records == model
    assert list(scan.records) == list(model)  # in the order first written
    assert scan.torn == "" and scan.good_end == len(data)


@_SETTINGS
@given(journal=journals(), data=st.data())
def test_property_damage_is_a_torn_tail_or_refused_never_an_invented_record(journal, data):
    raw = bytearray(journal[0])
    what = data.draw(st.sampled_from(["flip", "cut", "byte", "zeros"]))
    at = data.draw(st.integers(len(frames.MAGIC), len(raw) - 1))
    if what == "flip":
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif what == "cut":
        del raw[at:]
    elif what == "byte":
        raw[at] = data.draw(st.integers(0, 255))
    else:
        raw[at:] = bytes(len(raw) - at)
    damaged = bytes(raw)
    outcome = _outcome(damaged)
    if outcome[0] == "error":
        assert outcome[1] in ("corrupt", "version"), outcome
        return
    scan = outcome[1]
    # what is kept is exactly what the whole entries before the cut replay to
    assert frames.scan(damaged[:scan.good_end]) == scan._replace(torn="")
    if what == "flip":  # a flipped bit is never read as a journal without damage
        assert scan.torn


# Records that are framed and checksummed right but are not what the journal writes: each is
# refused, with the bad field named.
_ODD_ENTRIES = {
    "bool-time": (lambda d: {**d, "time": True}, ".time: expected a number, got True"),
    "int-id": (lambda d: {**d, "id": 7}, ".id: expected a string, got int"),
    "extra-key": (lambda d: {**d, "extra": 1}, ": unexpected extra"),
    "missing-key": (lambda d: {k: v for k, v in d.items() if k != "boot"}, ": missing boot"),
    "none-for-devices": (lambda d: {**d, "devices": None},
                         ".devices: expected a list, got NoneType"),
    "gpu-index-str": (lambda d: {**d, "gpus": [["GPU-0", "0"]]},
                      ".gpus[0][1]: expected an integer, got str"),
    "gpu-index-bool": (lambda d: {**d, "gpus": [["GPU-0", False]]},
                       ".gpus[0][1]: expected an integer, got False"),
    "pod-of-2": (lambda d: {**d, "pod": ["ns", "pod"]},
                 ".pod: expected [namespace, name, container], got 2 items"),
    "mount-flag-int": (lambda d: {**d, "response": {**d["response"],
                                                    "mounts": [["/a", "/b", 1]]}},
                       ".response.mounts[0][2]: expected bool, got int"),
    "env-int": (lambda d: {**d, "response": {**d["response"], "envs": {"A": 1}}},
                ".response.envs.A: expected a string, got int"),
    "response-key-missing": (lambda d: {**d, "response": {"envs": {}}},
                             ".response: missing mounts, devices, annotations, cdiDevices"),
}


def _record_map() -> dict:
    r = ck.Record("r1", "nvidia.com/gpu", ("GPU-0",), (ck.GpuRef("GPU-0", 0),),
                  ck.Response(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-0"}), 5.0, "boot-1")
    return ck.record_data(r)


@pytest.mark.parametrize("odd", list(_ODD_ENTRIES))
def test_an_odd_record_is_refused_with_the_field_named(odd):
    spoil, message = _ODD_ENTRIES[odd]
    data = frames.MAGIC + frames.meta_frame("b", "uuid", 0.0) + \
        frames.frame(msgpack.packb(["put", spoil(_record_map())]))
    assert _outcome(data) == ("error", "corrupt", f"entry at byte 49{message}")


@pytest.mark.parametrize("entry, answer", [
    pytest.param(["claim", "nobody", None, None], "error", id="claim-of-unknown"),
    pytest.param(["drop", ["r1"]], "error", id="drop-of-a-list"),
    pytest.param(["drop", "nobody"], "error", id="drop-of-unknown"),
    pytest.param(["claim", "r1", ["ns", "pod", "c"], "soon"], "error", id="claim-confirmed-str"),
    pytest.param(["claim", "r1", ["ns", "pod", "c"], True], "scan", id="claim-confirmed-bool"),
    pytest.param(["put"], "error", id="put-without-record"),
    pytest.param(["rename", "r1"], "error", id="unknown-entry"),
    pytest.param([], "error", id="empty-list"),
    pytest.param({"put": 1}, "error", id="a-map"),
])
def test_an_odd_entry_gets_its_answer(entry, answer):
    data = frames.MAGIC + frames.meta_frame("b", "uuid", 0.0) + \
        frames.frame(msgpack.packb(["put", _record_map()])) + frames.frame(msgpack.packb(entry))
    outcome = _outcome(data)
    assert outcome[0] == answer, outcome
    if answer == "error":
        assert outcome[1] == "corrupt" and outcome[2].startswith("entry at byte "), outcome


@_SETTINGS
@given(r=records())
def test_property_a_record_map_reads_back_as_the_record(r):
    assert ck.record_from_data(ck.record_data(r), "x") == r


# A put entry in encodings other than the one the agent writes (map keys as fixstr, times as
# float64, small GPU indexes as fixint): each is read as msgpack reads it, or refused with the
# reason (msgpack's, or the bad field's).
def _pieces(d: dict) -> list[tuple[bytes, bytes]]:
    return [(msgpack.packb(k), msgpack.packb(v, use_bin_type=True)) for k, v in d.items()]


def _put(pieces: list[tuple[bytes, bytes]], header: bytes | None = None) -> bytes:
    head = msgpack.Packer().pack_map_header(len(pieces)) if header is None else header
    return b"\x92" + msgpack.packb("put") + head + b"".join(k + v for k, v in pieces)


def _with(key: str, raw: bytes):
    """The pieces with `key`'s value replaced by the raw msgpack bytes `raw`."""
    return lambda ps: _put([(k, raw if k == msgpack.packb(key) else v) for k, v in ps])


_ENCODINGS = {
    "the-agents-own": lambda ps: _put(ps),
    "keys-in-another-order": lambda ps: _put(ps[::-1]),
    "map16-header": lambda ps: _put(ps, b"\xde\x00\x09"),
    "map32-header": lambda ps: _put(ps, b"\xdf\x00\x00\x00\x09"),
    "str8-key": lambda ps: _put([(b"\xd9\x02id" if k == b"\xa2id" else k, v) for k, v in ps]),
    "str16-value": _with("boot", b"\xda\x00\x06boot-1"),
    "float32-time": _with("time", b"\xca" + struct.pack(">f", 5.5)),
    "fixint-time": _with("time", b"\x05"),
    "uint64-time": _with("time", b"\xcf" + struct.pack(">Q", 2**62 + 1)),
    "negative-time": _with("time", b"\xff"),
    "nan-time": _with("time", b"\xcb" + struct.pack(">d", float("nan"))),
    "bool-confirmed": _with("confirmed", b"\xc3"),
    "float32-confirmed": _with("confirmed", b"\xca" + struct.pack(">f", 7.25)),
    "a-key-twice": lambda ps: _put(ps + ps[:1]),
    "a-key-twice-one-missing": lambda ps: _put(ps[:-1] + ps[:1]),
    "a-byte-after-the-map": lambda ps: _put(ps) + b"\xc0",
    "the-map-cut-short": lambda ps: _put(ps[:-1], b"\x89"),
    "bad-utf8-id": _with("id", b"\xa2\xff\xfe"),
    "bin-id": _with("id", b"\xc4\x02r1"),
    "gpu-index-uint16": _with("gpus", msgpack.packb([["GPU-0", 300]])),
    "gpu-index-uint64": _with("gpus", msgpack.packb([["GPU-0", 2**40]])),
    "gpu-index-negative": _with("gpus", msgpack.packb([["GPU-0", -1]])),
    "gpu-index-float": _with("gpus", msgpack.packb([["GPU-0", 0.0]])),
    "gpu-of-3": _with("gpus", msgpack.packb([["GPU-0", 0, 0]])),
    "array16-devices": _with("devices", b"\xdc\x00\x01" + msgpack.packb("GPU-0")),
    "devices-of-none": _with("devices", msgpack.packb([None])),
    "pod-of-3": _with("pod", msgpack.packb(["ns", "pod", "c"])),
    "pod-of-2": _with("pod", msgpack.packb(["ns", "pod"])),
    "pod-a-str": _with("pod", msgpack.packb("ns/pod/c")),
    "response-none": _with("response", b"\xc0"),
    "response-mounts": _with("response", msgpack.packb({
        "envs": {"A": "1", "B": "2"}, "mounts": [["/a", "/b", True], ["/c", "/d", False]],
        "devices": [["/dev/x", "/dev/x", "rw"]], "annotations": {"k": "v"},
        "cdiDevices": ["nvidia.com/gpu=0"]})),
    "response-env-twice": _with("response", b"\x85\xa4envs\x82\xa1A\xa11\xa1A\xa12" + b"".join(
        msgpack.packb(x) for x in ("mounts", [], "devices", [], "annotations", {},
                                   "cdiDevices", []))),
    "response-key-twice": _with("response", b"\x86\xa4envs\x80\xa4envs\x80" + b"".join(
        msgpack.packb(x) for x in ("mounts", [], "devices", [], "annotations", {},
                                   "cdiDevices", []))),
    "response-mount-flag-nil": _with("response", msgpack.packb({
        "envs": {}, "mounts": [["/a", "/b", None]], "devices": [], "annotations": {},
        "cdiDevices": []})),
}


# What each encoding replays to: ("scan", the record map's fields that differ from
# _record_map()'s) or ("error", the message after "entry at byte 49").
_ANSWERS = {
    "float32-time": ("scan", {"time": 5.5}),
    "uint64-time": ("scan", {"time": float(2**62 + 1)}),
    "negative-time": ("scan", {"time": -1.0}),
    "nan-time": ("scan", {"time": math.nan}),
    "bool-confirmed": ("error", ".confirmed: expected a number, got True"),
    "float32-confirmed": ("scan", {"confirmed": 7.25}),
    "a-key-twice-one-missing": ("error", ": missing confirmed"),
    "a-byte-after-the-map": ("error", ": not valid msgpack (unpack(b) received extra data.)"),
    "the-map-cut-short": ("error", ": not valid msgpack (Unpack failed: incomplete input)"),
    "bad-utf8-id": ("error", ": not valid msgpack ('utf-8' codec can't decode byte 0xff in "
                             "position 0: invalid start byte)"),
    "bin-id": ("error", ".id: expected a string, got bytes"),
    "gpu-index-uint16": ("scan", {"gpus": [["GPU-0", 300]]}),
    "gpu-index-uint64": ("scan", {"gpus": [["GPU-0", 2**40]]}),
    "gpu-index-negative": ("scan", {"gpus": [["GPU-0", -1]]}),
    "gpu-index-float": ("error", ".gpus[0][1]: expected an integer, got float"),
    "gpu-of-3": ("error", ".gpus[0]: expected [uuid, index], got 3 items"),
    "devices-of-none": ("error", ".devices[0]: expected a string, got NoneType"),
    "pod-of-3": ("scan", {"pod": ["ns", "pod", "c"]}),
    "pod-of-2": ("error", ".pod: expected [namespace, name, container], got 2 items"),
    "pod-a-str": ("error", ".pod: expected a list, got str"),
    "response-none": ("scan", {"response": None}),
    "response-mounts": ("scan", {"response": {
        "envs": {"A": "1", "B": "2"}, "mounts": [["/a", "/b", True], ["/c", "/d", False]],
        "devices": [["/dev/x", "/dev/x", "rw"]], "annotations": {"k": "v"},
        "cdiDevices": ["nvidia.com/gpu=0"]}}),
    "response-env-twice": ("scan", {"response": {
        "envs": {"A": "2"}, "mounts": [], "devices": [], "annotations": {}, "cdiDevices": []}}),
    "response-key-twice": ("scan", {"response": {
        "envs": {}, "mounts": [], "devices": [], "annotations": {}, "cdiDevices": []}}),
    "response-mount-flag-nil": ("error", ".response.mounts[0][2]: expected bool, got NoneType"),
}


@pytest.mark.parametrize("encoding", list(_ENCODINGS))
def test_a_put_in_any_encoding_is_read_as_msgpack_reads_it(encoding):
    payload = _ENCODINGS[encoding](_pieces(_record_map()))
    put = frames.frame(payload)
    data = frames.MAGIC + frames.meta_frame("b", "uuid", 0.0) + put + put + \
        frames.drop_frame("r1") + put
    kind, expected = _ANSWERS.get(encoding, ("scan", {}))
    outcome = _outcome(data)
    if kind == "error":
        assert outcome == ("error", "corrupt", f"entry at byte 49{expected}")
    else:
        want = ck.record_from_data({**_record_map(), **expected}, "x")
        assert outcome[0] == "scan" and repr(outcome[1].records) == repr({"r1": want})


# -- what the journal writes and holds ---------------------------------------------------------

DEVICES = [Device(id=f"GPU-{i}", index=str(i), gpu_uuid=f"GPU-{i}", gpu_index=i, numa_node=0,
                  paths=(f"/dev/nvidia{i}",)) for i in range(4)]


def _journal(tmp_path) -> Journal:
    j = Journal(str(tmp_path / JOURNAL_FILE), boot="boot-1")
    j.load()
    return j


def _allocate(j: Journal, *indexes: int) -> str:
    devices = [DEVICES[i] for i in indexes]
    return j.record_allocation("nvidia.com/gpu",
                               [(devices, container_response(devices, ResponseOptions()))])[0]


def _frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """(length, checksum, payload) of each frame of a journal's bytes."""
    out, pos = [], len(frames.MAGIC)
    while pos < len(data):
        length, crc = struct.unpack_from("<II", data, pos)
        out.append((length, crc, data[pos + 8:pos + 8 + length]))
        pos += 8 + length
    return out


def test_each_entry_is_what_msgpack_packs_under_zlibs_checksum(tmp_path):
    j = _journal(tmp_path)
    ids = [_allocate(j, 0), _allocate(j, 1, 2), _allocate(j, 1, 2)]
    j.close()
    data = (tmp_path / JOURNAL_FILE).read_bytes()
    entries = _frames(data)
    assert all(length == len(p) and crc == zlib.crc32(p) for length, crc, p in entries)
    held = {r.id: r for r in j.records()}
    assert [p for _, _, p in entries[1:]] == [
        msgpack.packb(["put", ck.record_data(held[rid])]) for rid in ids]


def test_records_of_one_answer_share_what_they_repeat(tmp_path):
    """Repeated Allocates of one device set hold one copy of its devices, GPUs and response
    (10,000 unclaimed Allocates of one answer: 2.3 MB in memory instead of 8). Records a
    restart reads back come back equal, each with its own copy: the read has already taken
    that memory, and sharing them afterwards gave none back (docs/state.md)."""
    j = _journal(tmp_path)
    _allocate(j, 1, 2)
    _allocate(j, 1, 2)
    j.close()
    first, second = held = j.records()
    assert first.id != second.id
    for field in ("resource", "devices", "gpus", "response", "boot"):
        assert getattr(first, field) is getattr(second, field), field
    assert _journal(tmp_path).records() == held


def test_record_ids_never_repeat_across_threads_or_restarts(tmp_path):
    j = _journal(tmp_path)
    ids: list[str] = []
    lock = threading.Lock()

    def caller() -> None:
        mine = [_allocate(j, n % 4) for n in range(50)]
        with lock:
            ids.extend(mine)

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    j.close()
    again = _journal(tmp_path)
    ids.append(_allocate(again, 0))
    assert len(set(ids)) == len(ids) == 401
    assert {r.id for r in again.records()} == set(ids)
    assert os.path.getsize(again.path) > 0
