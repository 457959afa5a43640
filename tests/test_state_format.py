"""The checkpoint file format (agent.state.checkpoint): round trip (Hypothesis), and every
kind of damage refused with a reason: any single flipped bit, any truncation, a newer schema
version, wrong field types named by their path.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.constants import DEVICE_ID_STRATEGIES
from agent.errors import CheckpointError
from agent.state import checkpoint as ck
from agent.state.checkpoint import (
    Checkpoint,
    DeviceSpecRec,
    GpuRef,
    MountRec,
    PodRef,
    Record,
    Response,
    decode,
    encode,
)

text = st.text(max_size=12)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)
responses = st.builds(
    Response,
    envs=st.dictionaries(text, text, max_size=3),
    mounts=st.lists(st.builds(MountRec, text, text, st.booleans()), max_size=3).map(tuple),
    devices=st.lists(st.builds(DeviceSpecRec, text, text, st.sampled_from(["rw", "r", "mrw"])),
                     max_size=3).map(tuple),
    annotations=st.dictionaries(text, text, max_size=2),
    cdi_devices=st.lists(text, max_size=3).map(tuple),
)


@st.composite
def records(draw):
    n = draw(st.integers(1, 4))
    return Record(
        id=draw(st.uuids()).hex,
        resource=draw(st.sampled_from(["nvidia.com/gpu", "nvidia.com/a100", "nvidia.com/mig-1g.10gb"])),
        devices=tuple(draw(st.lists(text, min_size=n, max_size=n))),
        gpus=tuple(GpuRef(f"GPU-{draw(st.uuids())}", draw(st.integers(0, 63))) for _ in range(n)),
        response=draw(st.one_of(st.none(), responses)),
        time=draw(times),
        boot=draw(text),
        pod=draw(st.one_of(st.none(), st.builds(PodRef, text, text, text))),
        confirmed=draw(st.one_of(st.none(), times)),
    )


checkpoints = st.builds(
    Checkpoint,
    records=st.lists(records(), max_size=5, unique_by=lambda r: r.id).map(tuple),
    written=times, boot=text, keyed_by=st.sampled_from(DEVICE_ID_STRATEGIES),
)
_SETTINGS = settings(max_examples=100, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(checkpoints)
def test_property_a_checkpoint_round_trips(cp):
    assert decode(encode(cp)) == cp


@_SETTINGS
@given(checkpoints, st.data())
def test_property_any_flipped_bit_is_refused(cp, data):
    raw = bytearray(encode(cp))
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CheckpointError) as info:
        decode(bytes(raw))
    assert info.value.kind in ("corrupt", "truncated")


@_SETTINGS
@given(checkpoints, st.data())
def test_property_any_truncation_is_refused(cp, data):
    raw = encode(cp)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(CheckpointError) as info:
        decode(raw[:cut])
    assert info.value.kind == "truncated"


def _sample() -> Checkpoint:
    r = Record(id="a" * 32, resource="nvidia.com/gpu", devices=("GPU-1",), gpus=(GpuRef("GPU-1", 0),),
               response=Response(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-1"}), time=1.0, boot="b")
    return Checkpoint(records=(r,), written=2.0, boot="b", keyed_by="uuid")


def _frame(version: int, body: bytes, digest: bytes | None = None) -> bytes:
    return msgpack.packb({"format": ck.FORMAT, "version": version,
                          "sha256": digest if digest is not None else ck._digest(version, body),
                          "body": body}, use_bin_type=True)


def test_a_newer_schema_version_is_told_apart_from_damage():
    body = msgpack.packb({"anything": "a newer gpu-agent writes"})
    with pytest.raises(CheckpointError) as info:
        decode(_frame(ck.VERSION + 1, body))
    assert info.value.kind == "version"
    assert f"schema version {ck.VERSION + 1} is newer than this gpu-agent reads" in str(info.value)


@_SETTINGS
@given(checkpoints)
def test_the_file_is_the_plain_msgpack_frame(cp):
    # any msgpack reader sees the frame, its body the map of docs/state.md
    frame = msgpack.unpackb(encode(cp), raw=False)
    assert set(frame) == {"format", "version", "sha256", "body"}
    assert encode(cp) == msgpack.packb(frame, use_bin_type=True)
    body = msgpack.unpackb(frame["body"], raw=False)
    assert body["records"] == [ck.record_data(r) for r in cp.records]


def test_a_version_changed_by_damage_is_a_checksum_mismatch():
    good = msgpack.unpackb(encode(_sample()))
    good["version"] = 5  # the checksum covers the version
    with pytest.raises(CheckpointError, match="checksum mismatch") as info:
        decode(msgpack.packb(good, use_bin_type=True))
    assert info.value.kind == "corrupt"


@pytest.mark.parametrize("data, kind, message", [
    (b"", "truncated", "the file is empty"),
    (b"\x00" * 64, "corrupt", "not a gpu-agent checkpoint"),
    (msgpack.packb({"format": ck.FORMAT}) + b"\x00", "corrupt",
     "frame: bytes after the end of the data"),
    (b"{\"json\": true}", "corrupt", "not a gpu-agent checkpoint"),
    (msgpack.packb({"format": "something else"}), "corrupt", "not a gpu-agent checkpoint"),
    (msgpack.packb({"format": ck.FORMAT, "version": 1}), "corrupt", "frame: missing sha256, body"),
], ids=["empty", "zeros", "trailing", "json", "other-format", "no-body"])
def test_not_a_checkpoint(data, kind, message):
    with pytest.raises(CheckpointError, match=message) as info:
        decode(data)
    assert info.value.kind == kind


def _with_record_field(**fields) -> bytes:
    doc = msgpack.unpackb(msgpack.unpackb(encode(_sample()))["body"])
    doc["records"][0].update(fields)
    return _frame(ck.VERSION, msgpack.packb(doc, use_bin_type=True))


@pytest.mark.parametrize("fields, message", [
    ({"devices": "GPU-1"}, "records[0].devices: expected a list, got str"),
    ({"gpus": [["GPU-1", "0"]]}, "records[0].gpus[0][1]: expected an integer, got str"),
    ({"gpus": [["GPU-1", True]]}, "records[0].gpus[0][1]: expected an integer, got True"),
    ({"time": "yesterday"}, "records[0].time: expected a number, got str"),
    ({"pod": ["ns", "name"]}, "records[0].pod: expected [namespace, name, container], got 2"),
    ({"extra": 1}, "records[0]: unexpected extra"),
    ({"response": {"envs": {}}}, "records[0].response: missing mounts"),
], ids=["devices", "index-str", "index-bool", "time", "pod", "extra", "response"])
def test_a_well_framed_body_with_a_bad_field_names_it(fields, message):
    """A body a buggy writer produced (the checksum is right): every field is checked."""
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode(_with_record_field(**fields))


def test_a_record_id_twice_is_refused():
    cp = _sample()
    twice = Checkpoint(records=cp.records * 2, written=1.0, boot="b")
    with pytest.raises(CheckpointError, match="a record ID appears twice"):
        decode(encode(twice))
