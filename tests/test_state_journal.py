"""The journal (agent.state.journal) on a real directory: durable before it returns, group
commit under concurrent callers, the file's mode, a failed write refused and forgotten, and
bad checkpoints (truncated, bit-flipped, newer version, unreadable) moved aside with a
timestamp, reported, never overwritten.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import threading

import msgpack
import pytest

from agent.errors import StateError
from agent.rm.allocate import ResponseOptions, container_response
from agent.rm.devices import Device
from agent.state import checkpoint as ck
from agent.state.journal import CHECKPOINT_FILE, Journal, read_checkpoint, set_aside_files

DEVICES = [Device(id=f"GPU-{i:08d}-0000-0000-0000-000000000000", index=str(i),
                  gpu_uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000", gpu_index=i,
                  numa_node=0, paths=(f"/dev/nvidia{i}",)) for i in range(8)]
OPTIONS = ResponseOptions(list_strategies=("envvar", "cdi-annotations"))


def allocate(journal: Journal, *indexes: int):
    devices = [DEVICES[i] for i in indexes]
    return journal.record_allocation("nvidia.com/gpu",
                                     [(devices, container_response(devices, OPTIONS))])[0]


@pytest.fixture
def state(tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    return d


def journal_at(state, boot="boot-1", keyed_by="uuid") -> Journal:
    j = Journal(str(state / CHECKPOINT_FILE), boot=boot, keyed_by=keyed_by)
    j.load()
    return j


def test_an_allocation_is_in_the_file_when_record_returns(state):
    j = journal_at(state)
    rec = allocate(j, 2, 5)
    cp = read_checkpoint(j.path)
    assert cp.records == (rec,)
    assert rec.devices == (DEVICES[2].id, DEVICES[5].id)
    assert rec.gpus == (ck.GpuRef(DEVICES[2].gpu_uuid, 2), ck.GpuRef(DEVICES[5].gpu_uuid, 5))
    assert rec.response.envs["NVIDIA_VISIBLE_DEVICES"] == f"{DEVICES[2].id},{DEVICES[5].id}"
    assert rec.boot == "boot-1" and rec.pod is None
    assert cp.boot == "boot-1" and cp.keyed_by == "uuid"
    assert stat.S_IMODE(os.stat(j.path).st_mode) == 0o600
    assert not os.path.exists(j.path + ".tmp")


def test_records_survive_a_new_journal(state):
    j = journal_at(state)
    recs = [allocate(j, i) for i in range(4)]
    again = journal_at(state)
    assert again.records() == tuple(recs)
    assert again.loaded == 4 and again.set_aside == []


def test_concurrent_callers_share_writes_and_each_returns_durable(state):
    j = journal_at(state)
    callers, per_caller = 32, 8
    problems: list[str] = []
    start = threading.Barrier(callers)

    def caller(n: int) -> None:
        start.wait()
        for k in range(per_caller):
            rec = allocate(j, (n + k) % 8)
            on_disk = {r.id for r in read_checkpoint(j.path).records}
            if rec.id not in on_disk:
                problems.append(f"caller {n}: record {rec.id} returned before it was written")

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []
    assert len(read_checkpoint(j.path).records) == callers * per_caller
    # group commit: fewer writes than Allocates (each write carried several)
    assert j.writes < callers * per_caller


def test_a_write_that_fails_raises_and_forgets_the_record(state, tmp_path):
    j = journal_at(state)
    kept = allocate(j, 0)
    moved = tmp_path / "moved"
    os.rename(state, moved)  # the state directory disappears under the agent
    with pytest.raises(StateError, match=f"cannot write the checkpoint {j.path}: .*No such file"):
        allocate(j, 1)
    assert j.records() == (kept,)
    assert "No such file" in j.last_error
    os.rename(moved, state)
    later = allocate(j, 2)
    assert read_checkpoint(j.path).records == (kept, later)
    assert j.last_error == ""


def test_a_record_that_cannot_be_written_fails_alone_and_the_journal_goes_on(state):
    # a record msgpack cannot pack (a bug upstream) must fail its own Allocate, not leave
    # every later Allocate waiting behind a write that never finished
    j = journal_at(state)
    kept = allocate(j, 0)
    bad = dataclasses.replace(kept, id="bad", boot=object())
    with pytest.raises(StateError, match="cannot write the checkpoint"):
        j.append([bad])
    assert j.records() == (kept,)
    later = allocate(j, 1)  # returns: the journal is not wedged
    assert read_checkpoint(j.path).records == (kept, later)


def _raw(state) -> bytes:
    return (state / CHECKPOINT_FILE).read_bytes()


def _flip(data: bytes, at: int) -> bytes:
    raw = bytearray(data)
    raw[at] ^= 0x10
    return bytes(raw)


def _future(_: bytes) -> bytes:
    body = msgpack.packb({"records": "in a form this version does not know"})
    return msgpack.packb({"format": ck.FORMAT, "version": ck.VERSION + 1,
                          "sha256": ck._digest(ck.VERSION + 1, body), "body": body})


BAD = {
    "truncated": (lambda raw: raw[: len(raw) // 2], "truncated", "ends early"),
    "bit-flipped": (lambda raw: _flip(raw, len(raw) - 20), "corrupt", "checksum mismatch"),
    "future-version": (_future, "version", "newer than this gpu-agent reads"),
    "empty": (lambda raw: b"", "truncated", "the file is empty"),
}


@pytest.mark.parametrize("damage", sorted(BAD))
def test_a_bad_checkpoint_is_moved_aside_and_reported(state, damage, caplog):
    j = journal_at(state)
    allocate(j, 3)
    spoil, kind, reason = BAD[damage]
    bad = spoil(_raw(state))
    (state / CHECKPOINT_FILE).write_bytes(bad)

    again = journal_at(state)
    assert again.records() == ()
    [aside] = again.set_aside
    assert aside.kind == kind and reason in aside.reason
    assert os.path.basename(aside.path).startswith(CHECKPOINT_FILE + ".bad-")
    assert open(aside.path, "rb").read() == bad  # kept as it was, for inspection
    assert not os.path.exists(again.path)
    assert f"moved aside to {aside.path}" in caplog.text
    status = again.status()
    assert status["setAside"][0]["path"] == aside.path and status["setAside"][0]["kind"] == kind

    # the agent goes on: a new checkpoint, the bad one untouched
    rec = allocate(again, 4)
    assert read_checkpoint(again.path).records == (rec,)
    assert open(aside.path, "rb").read() == bad


def test_a_second_bad_file_in_the_same_second_gets_its_own_name(state):
    j = journal_at(state)
    allocate(j, 0)
    first = _raw(state)[:10]
    (state / CHECKPOINT_FILE).write_bytes(first)
    a = journal_at(state).set_aside[0].path
    (state / CHECKPOINT_FILE).write_bytes(b"\xc1 second")
    j2 = Journal(str(state / CHECKPOINT_FILE), boot="boot-1", clock=lambda: os.stat(a).st_mtime)
    j2.load()
    b = j2.set_aside[0].path
    assert a != b
    assert open(a, "rb").read() == first and open(b, "rb").read() == b"\xc1 second"
    assert set_aside_files(j2.path) == sorted([a, b])
    assert j2.status()["setAsideEarlier"] == [a]


def test_an_unreadable_checkpoint_is_moved_aside(state):
    (state / CHECKPOINT_FILE).mkdir()  # reading it fails with EISDIR
    j = journal_at(state)
    [aside] = j.set_aside
    assert aside.kind == "unreadable" and "Is a directory" in aside.reason
    assert os.path.isdir(aside.path)
    rec = allocate(j, 1)
    assert read_checkpoint(j.path).records == (rec,)


def test_a_temp_file_left_by_a_killed_write_is_ignored_and_removed(state):
    j = journal_at(state)
    rec = allocate(j, 6)
    (state / (CHECKPOINT_FILE + ".tmp")).write_bytes(_raw(state)[:7])
    again = journal_at(state)
    assert again.records() == (rec,) and again.set_aside == []
    assert not (state / (CHECKPOINT_FILE + ".tmp")).exists()
