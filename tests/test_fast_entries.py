"""The journal's hot paths (agent._fast.entries and its twin _entries_py), run on both.

The replay: a restart reads back exactly what was written, and the hot path never changes an
answer. The oracle is the checked replay alone (agent.state.frames.scan with a replay module
that takes nothing): on any journal, damaged or not, both implementations give the same
records, the same torn tail or the same error with the same message.

The packing of a new Allocate's entry (new_put_frame): the oracle is msgpack, through
frames.put_frame of the same record.
"""

from __future__ import annotations

import struct
import types
import zlib

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_state_format import records

from agent.errors import CheckpointError
from agent.state import checkpoint as ck
from agent.state import frames
from agent.state.checkpoint import KINDS, PodRef

# takes no entry and no record: frames.scan then checks every frame itself
CHECKED_ONLY = types.SimpleNamespace(replay=lambda view, pos, records, kinds: (pos, 0),
                                     record=lambda value, kinds: None)
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


def _outcome(data: bytes, module) -> tuple:
    """What scan says about `data`: its whole result, or the error's kind and message."""
    try:
        return ("scan", frames.scan(data, module))
    except CheckpointError as exc:
        return ("error", exc.kind, str(exc))


@_SETTINGS
@given(journal=journals())
def test_property_a_journal_replays_to_what_was_written(fast_impl, journal):
    data, model = journal
    scan = frames.scan(data, fast_impl.entries)
    assert scan.records == model
    assert list(scan.records) == list(model)  # in the order first written
    assert scan.torn == "" and scan.good_end == len(data)
    assert scan == frames.scan(data, CHECKED_ONLY)


@_SETTINGS
@given(journal=journals(), data=st.data())
def test_property_damage_gets_the_checked_replays_answer(fast_impl, journal, data):
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
    assert _outcome(damaged, fast_impl.entries) == _outcome(damaged, CHECKED_ONLY)


# Entries that are framed and checksummed right but are not what the journal writes: the hot
# path must stop at each and leave it to the checked replay (its error, or its acceptance).
_ODD_ENTRIES = {
    "bool-time": lambda d: {**d, "time": True},
    "int-id": lambda d: {**d, "id": 7},
    "extra-key": lambda d: {**d, "extra": 1},
    "missing-key": lambda d: {k: v for k, v in d.items() if k != "boot"},
    "none-for-devices": lambda d: {**d, "devices": None},
    "gpu-index-str": lambda d: {**d, "gpus": [["GPU-0", "0"]]},
    "gpu-index-bool": lambda d: {**d, "gpus": [["GPU-0", False]]},
    "pod-of-2": lambda d: {**d, "pod": ["ns", "pod"]},
    "mount-flag-int": lambda d: {**d, "response": {**d["response"], "mounts": [["/a", "/b", 1]]}},
    "env-int": lambda d: {**d, "response": {**d["response"], "envs": {"A": 1}}},
    "response-key-missing": lambda d: {**d, "response": {"envs": {}}},
}


def _record_map() -> dict:
    r = ck.Record("r1", "nvidia.com/gpu", ("GPU-0",), (ck.GpuRef("GPU-0", 0),),
                  ck.Response(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-0"}), 5.0, "boot-1")
    return ck.record_data(r)


@pytest.mark.parametrize("odd", list(_ODD_ENTRIES))
def test_an_odd_record_is_left_to_the_checked_path(fast_impl, odd):
    value = _ODD_ENTRIES[odd](_record_map())
    assert fast_impl.entries.record(value, KINDS) is None
    data = frames.MAGIC + frames.meta_frame("b", "uuid", 0.0) + \
        frames.frame(msgpack.packb(["put", value]))
    assert _outcome(data, fast_impl.entries) == _outcome(data, CHECKED_ONLY)


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
def test_an_odd_entry_gets_the_checked_replays_answer(fast_impl, entry, answer):
    data = frames.MAGIC + frames.meta_frame("b", "uuid", 0.0) + \
        frames.frame(msgpack.packb(["put", _record_map()])) + frames.frame(msgpack.packb(entry))
    checked = _outcome(data, CHECKED_ONLY)
    assert checked[0] == answer, checked
    assert _outcome(data, fast_impl.entries) == checked


@_SETTINGS
@given(r=records())
def test_property_a_record_map_reads_back_as_the_checked_path_reads_it(fast_impl, r):
    value = ck.record_data(r)
    assert fast_impl.entries.record(value, KINDS) == r == ck.record_from_data(value, "x")


# A put entry in encodings other than the one the agent writes (agent.state.frames packs map
# keys as fixstr, times as float64, small GPU indexes as fixint): the compiled replay reads the
# agent's own encoding from the bytes and must leave every other one to msgpack, so that each
# still gets the checked replay's answer (taken as it is, or refused with its message).
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


@pytest.mark.parametrize("encoding", list(_ENCODINGS))
def test_a_put_in_any_encoding_gets_the_checked_replays_answer(fast_impl, encoding):
    payload = _ENCODINGS[encoding](_pieces(_record_map()))
    put = frames.frame(payload)
    data = frames.MAGIC + frames.meta_frame("b", "uuid", 0.0) + put + put + \
        frames.drop_frame("r1") + put
    fast, checked = _outcome(data, fast_impl.entries), _outcome(data, CHECKED_ONLY)
    assert repr(fast) == repr(checked)  # repr: a NaN time is equal to itself there
    if encoding == "the-agents-own":
        assert fast[0] == "scan" and fast[1].records == {"r1": ck.record_from_data(
            _record_map(), "x")}


def test_the_compiled_replay_shares_what_records_repeat():
    """Records that repeat their devices, GPUs, response, resource and boot hold one copy of
    each after a restart (a journal of 10,000 records: 15 MB instead of 22 MB in memory)."""
    from agent._fast import entries

    r = ck.Record("r1", "nvidia.com/gpu", ("GPU-0", "GPU-1"),
                  (ck.GpuRef("GPU-0", 0), ck.GpuRef("GPU-1", 1)),
                  ck.Response(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-0,GPU-1"}), 5.0, "boot-1")
    other = r._replace(id="r2", time=6.0, pod=PodRef("ns", "p", "c"), confirmed=7.0)
    data = frames.MAGIC + frames.meta_frame("b", "uuid", 0.0) + frames.put_frame(r) + \
        frames.put_frame(other)
    got = frames.scan(data, entries).records
    assert got == {"r1": r, "r2": other}
    for field in ("resource", "devices", "gpus", "response", "boot"):
        assert getattr(got["r1"], field) is getattr(got["r2"], field), field


@_SETTINGS
@given(prefix=st.text(alphabet=st.characters(max_codepoint=127), max_size=64))
def test_record_ids_are_the_prefix_then_a_hex_count(fast_impl, prefix):
    ids = fast_impl.entries.Ids(prefix)
    assert [ids() for _ in range(300)] == [f"{prefix}{n:x}" for n in range(1, 301)]


def test_an_id_prefix_too_long_is_refused(fast_impl):
    with pytest.raises(ValueError, match="at most 64"):
        fast_impl.entries.Ids("x" * 65)


@_SETTINGS
@given(rid=st.text(max_size=40), t=st.floats(allow_nan=False), answer=st.binary(max_size=2000),
       tail=st.binary(max_size=300))
@example(rid="a", t=1.5, answer=b"", tail=b"")
@example(rid="b" * 40, t=-0.0, answer=bytes(range(256)) * 20, tail=b"\xff" * 299)
def test_a_new_entrys_checksum_joined_from_its_pieces_is_zlibs(rid, t, answer, tail):
    # the compiled module checksums only the ID and time and joins the pieces' checksums
    # (zlib's crc32_combine); any bytes, empty pieces too, give the twin's frame, which is
    # zlib.crc32 of the whole payload
    from agent._fast import _entries_py as twin
    from agent._fast import entries as compiled

    frame = compiled.new_put_frame(rid, t, compiled.Piece(answer), compiled.Piece(tail))
    assert frame == twin.new_put_frame(rid, t, twin.Piece(answer), twin.Piece(tail))
    length, crc = struct.unpack_from("<II", frame)
    assert length == len(frame) - 8 and crc == zlib.crc32(frame[8:])


@_SETTINGS
@given(r=records(), rid=st.one_of(st.text(max_size=40), st.text(min_size=200, max_size=300),
                                  st.just("x" * 70_000)))
def test_a_new_records_entry_is_what_msgpack_packs(fast_impl, r, rid):
    # IDs of every msgpack str head (fixstr, str 8, 16, 32 by their UTF-8 length), any text
    new = r._replace(id=rid, pod=None, confirmed=None)
    e = fast_impl.entries
    packed = e.new_put_frame(rid, new.time, e.Piece(frames.answer_piece(new)),
                             e.Piece(frames.tail_piece(new.boot)))
    assert packed == frames.put_frame(new)  # its checksum too: zlib's of the whole payload
    assert frames.scan(frames.MAGIC + frames.meta_frame(new.boot, "uuid", 1.0) + packed,
                       fast_impl.entries).records == {rid: new}
