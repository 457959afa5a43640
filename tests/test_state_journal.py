"""The journal (agent.state.journal) on a real directory: written before it returns, group
commit under concurrent callers, the file's mode, a torn tail cut and reported, compaction,
the old checkpoint migrated, a full or read-only disk refused with the reason and recovered
from, and bad journals (bit-flipped, newer version, not a journal, unreadable) moved aside
with a timestamp, reported, never overwritten.
"""

from __future__ import annotations

import os
import stat
import subprocess
import threading

import msgpack
import pytest

from agent.errors import StateError
from agent.rm.allocate import ResponseOptions, container_response
from agent.rm.devices import Device
from agent.state import checkpoint as ck
from agent.state import frames
from agent.state.journal import (
    JOURNAL_FILE,
    LEGACY_FILE,
    Journal,
    read_journal,
    set_aside_files,
)

DEVICES = [Device(id=f"GPU-{i:08d}-0000-0000-0000-000000000000", index=str(i),
                  gpu_uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000", gpu_index=i,
                  numa_node=0, paths=(f"/dev/nvidia{i}",)) for i in range(8)]
OPTIONS = ResponseOptions(list_strategies=("envvar", "cdi-annotations"))


def allocate(journal: Journal, *indexes: int):
    devices = [DEVICES[i] for i in indexes]
    rid, = journal.record_allocation("nvidia.com/gpu",
                                     [(devices, container_response(devices, OPTIONS))])
    return held(journal, rid)


def held(journal: Journal, rid: str) -> ck.Record:
    """The record `journal` holds under `rid`, as records() gives it."""
    return next(r for r in journal.records() if r.id == rid)


@pytest.fixture
def state(tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    return d


def journal_at(state, boot="boot-1", keyed_by="uuid") -> Journal:
    j = Journal(str(state / JOURNAL_FILE), boot=boot, keyed_by=keyed_by)
    j.load()
    return j


def test_an_allocation_is_in_the_file_when_record_returns(state):
    j = journal_at(state)
    rec = allocate(j, 2, 5)
    cp = read_journal(j.path)
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


def test_each_repeat_of_an_allocate_is_a_record_of_its_own(state):
    # the same answer again and again (as kubelet asks for the same devices): each repeat is
    # a record of its own, in the file when the call returns
    j = journal_at(state)
    one = [DEVICES[3]]
    answer = [(one, container_response(one, OPTIONS))]
    both = [(DEVICES[i:i + 1], container_response(DEVICES[i:i + 1], OPTIONS)) for i in (4, 6)]
    ids = [j.record_allocation("nvidia.com/gpu", answer) for _ in range(3)] + \
        [j.record_allocation("nvidia.com/gpu", both)]
    assert [len(i) for i in ids] == [1, 1, 1, 2] and len({r for i in ids for r in i}) == 5
    on_disk = {r.id: r for r in read_journal(j.path).records}
    assert on_disk == {r.id: r for r in j.records()} and len(on_disk) == 5
    assert [on_disk[i[0]].devices for i in ids[:3]] == [(DEVICES[3].id,)] * 3
    assert [on_disk[i].devices for i in ids[3]] == [(DEVICES[4].id,), (DEVICES[6].id,)]
    assert journal_at(state).records() == j.records()


def test_the_allocate_listener_is_called_after_each_allocate_is_written(state):
    # the reconciler's "a pass soon" (Journal.on_allocate): after the write, once per Allocate
    # (however many containers), never for a reconciliation's own entries
    j = journal_at(state)
    seen = []
    j.on_allocate = lambda: seen.append(len(read_journal(j.path).records))
    allocate(j, 0)
    allocate(j, 1)
    j.record_allocation("nvidia.com/gpu", [([d], container_response([d], OPTIONS))
                                           for d in DEVICES[2:4]])
    j.apply(ck_outcome(dropped=[j.records()[0]]))
    assert seen == [1, 2, 4]


def test_concurrent_callers_share_writes_and_each_returns_durable(state):
    j = journal_at(state)
    callers, per_caller = 32, 8
    problems: list[str] = []
    start = threading.Barrier(callers)

    def caller(n: int) -> None:
        start.wait()
        for k in range(per_caller):
            rec = allocate(j, (n + k) % 8)
            on_disk = {r.id for r in read_journal(j.path).records}
            if rec.id not in on_disk:
                problems.append(f"caller {n}: record {rec.id} returned before it was written")

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []
    assert len(read_journal(j.path).records) == callers * per_caller
    # group commit: fewer writes than Allocates (each write carried several)
    assert j.writes < callers * per_caller


def test_a_record_that_cannot_be_written_fails_alone_and_the_journal_goes_on(state):
    # a record msgpack cannot pack (a bug upstream) must fail its own Allocate, not leave
    # every later Allocate waiting behind a write that never finished
    j = journal_at(state)
    kept = allocate(j, 0)
    bad = kept._replace(id="bad", boot=object())
    with pytest.raises(StateError, match="cannot write the journal"):
        j.append([bad])
    assert j.records() == (kept,)
    later = allocate(j, 1)  # returns: the journal is not wedged
    assert read_journal(j.path).records == (kept, later)


def _raw(state) -> bytes:
    return (state / JOURNAL_FILE).read_bytes()


def _flip(data: bytes, at: int) -> bytes:
    raw = bytearray(data)
    raw[at] ^= 0x10
    return bytes(raw)


def _future(raw: bytes) -> bytes:
    meta = frames.frame(msgpack.packb(["meta", frames.VERSION + 1, "boot-1", "uuid", 0.0]))
    return frames.MAGIC + meta + raw[len(frames.MAGIC):]


BAD = {
    # a flipped bit in the first entry, with a whole entry after it: damage, not a torn tail
    "bit-flipped": (lambda raw: _flip(raw, len(frames.MAGIC) + 12), "corrupt",
                    "checksum mismatch"),
    "future-version": (_future, "version", "newer than this gpu-agent reads"),
    "not-a-journal": (lambda raw: b"\x93 something else" + raw, "corrupt",
                      "not a gpu-agent journal"),
}


@pytest.mark.parametrize("damage", sorted(BAD))
def test_a_bad_checkpoint_is_moved_aside_and_reported(state, damage, caplog):
    j = journal_at(state)
    allocate(j, 3)
    spoil, kind, reason = BAD[damage]
    bad = spoil(_raw(state))
    (state / JOURNAL_FILE).write_bytes(bad)

    again = journal_at(state)
    assert again.records() == ()
    [aside] = again.set_aside
    assert aside.kind == kind and reason in aside.reason
    assert os.path.basename(aside.path).startswith(JOURNAL_FILE + ".bad-")
    assert open(aside.path, "rb").read() == bad  # kept as it was, for inspection
    assert read_journal(again.path).records == ()  # a fresh journal in its place
    assert f"moved aside to {aside.path}" in caplog.text
    status = again.status()
    assert status["setAside"][0]["path"] == aside.path and status["setAside"][0]["kind"] == kind

    # the agent goes on: a new checkpoint, the bad one untouched
    rec = allocate(again, 4)
    assert read_journal(again.path).records == (rec,)
    assert open(aside.path, "rb").read() == bad


def test_a_second_bad_file_in_the_same_second_gets_its_own_name(state):
    j = journal_at(state)
    allocate(j, 0)
    first = b"\x93 not a journal"
    (state / JOURNAL_FILE).write_bytes(first)
    a = journal_at(state).set_aside[0].path
    (state / JOURNAL_FILE).write_bytes(b"\xc1 second")
    j2 = Journal(str(state / JOURNAL_FILE), boot="boot-1", clock=lambda: os.stat(a).st_mtime)
    j2.load()
    b = j2.set_aside[0].path
    assert a != b
    assert open(a, "rb").read() == first and open(b, "rb").read() == b"\xc1 second"
    assert set_aside_files(j2.path) == sorted([a, b])
    assert j2.status()["setAsideEarlier"] == [a]


def test_an_unreadable_checkpoint_is_moved_aside(state):
    (state / JOURNAL_FILE).mkdir()  # reading it fails with EISDIR
    j = journal_at(state)
    [aside] = j.set_aside
    assert aside.kind == "unreadable" and "Is a directory" in aside.reason
    assert os.path.isdir(aside.path)
    rec = allocate(j, 1)
    assert read_journal(j.path).records == (rec,)


def test_a_temp_file_left_by_a_killed_write_is_ignored_and_removed(state):
    j = journal_at(state)
    rec = allocate(j, 6)
    (state / (JOURNAL_FILE + ".tmp")).write_bytes(_raw(state)[:7])
    again = journal_at(state)
    assert again.records() == (rec,) and again.set_aside == []
    assert not (state / (JOURNAL_FILE + ".tmp")).exists()


# -- torn tails, compaction, migration --------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 5, 9, 30])
def test_a_torn_tail_is_cut_reported_once_and_the_rest_kept(state, cut, caplog):
    j = journal_at(state)
    kept = [allocate(j, 0), allocate(j, 1)]
    lost = allocate(j, 2)
    j.close()
    whole = _raw(state)
    last = frames.frame(msgpack.packb(["put", __import__("agent.state.checkpoint",
                                                         fromlist=["x"]).record_data(lost)]))
    assert whole.endswith(last)
    (state / JOURNAL_FILE).write_bytes(whole[:len(whole) - len(last) + cut])  # a crash mid-write

    again = journal_at(state)
    assert again.records() == tuple(kept)
    assert again.set_aside == []
    assert again.status()["tornTail"]["bytes"] == cut
    assert caplog.text.count("cut off") == 1
    later = allocate(again, 3)  # appended after the cut, readable with the rest
    assert read_journal(again.path).records == (*kept, later)


def test_zeros_after_the_last_entry_are_a_torn_tail(state):
    j = journal_at(state)
    rec = allocate(j, 4)
    j.close()
    (state / JOURNAL_FILE).write_bytes(_raw(state) + b"\0" * 4096)  # size grew, data did not land
    again = journal_at(state)
    assert again.records() == (rec,) and again.status()["tornTail"]["bytes"] == 4096


def test_appends_are_entries_and_compaction_keeps_only_the_live_records(state):
    j = journal_at(state)
    recs = [allocate(j, i % 8) for i in range(300)]
    assert j.status()["entries"] == 300
    size = os.path.getsize(j.path)
    for r in recs[:-10]:  # claims would do as well: drops are the simplest change
        j.apply(ck_outcome(dropped=[r]))
    deadline = __import__("time").monotonic() + 30
    while j.compactions == 0 and __import__("time").monotonic() < deadline:
        j.flush()
    assert j.compactions >= 1
    assert j.records() == tuple(recs[-10:])
    assert read_journal(j.path).records == tuple(recs[-10:])
    assert os.path.getsize(j.path) < size / 10
    later = allocate(j, 5)
    assert journal_at(state).records() == (*recs[-10:], later)


def ck_outcome(dropped=(), kept=()):
    from agent.state.reconcile import Outcome
    return Outcome(tuple(kept), tuple((r, "test") for r in dropped), (), (), (), 0, True)


def test_the_old_checkpoint_is_migrated_once_and_kept_aside(state, caplog):
    caplog.set_level("INFO")
    j = journal_at(state)
    recs = [allocate(j, 1), allocate(j, 6)]
    j.close()
    os.unlink(j.path)
    old = ck.Checkpoint(records=tuple(recs), written=1.0, boot="boot-0", keyed_by="uuid")
    (state / LEGACY_FILE).write_bytes(ck.encode(old))
    assert read_journal(str(state / JOURNAL_FILE)).records == tuple(recs)  # readers see it too

    again = journal_at(state)
    assert again.records() == tuple(recs)
    assert again.status()["migratedFrom"] == str(state / LEGACY_FILE)
    assert not (state / LEGACY_FILE).exists() and (state / (LEGACY_FILE + ".migrated")).exists()
    assert read_journal(again.path).records == tuple(recs)
    assert "migrating the checkpoint" in caplog.text
    third = journal_at(state)
    assert third.records() == tuple(recs) and third.status()["migratedFrom"] == ""


# -- a failing disk ----------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs as the state directory (mounting needs root, as the agent runs)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    d = tmp_path / "small"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(d)],
                   check=True)
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def _fill(d) -> None:
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"x" * 512)
    except OSError:
        pass
    finally:
        os.close(fd)


def test_a_full_disk_refuses_with_the_reason_and_recovers_by_itself(small_fs, caplog):
    caplog.set_level("INFO")
    j = journal_at(small_fs)
    kept = [allocate(j, 0)]
    _fill(small_fs)
    with pytest.raises(StateError, match="No space left on device"):
        for _ in range(100):  # the file's last page may still take a few records
            kept.append(allocate(j, 1))
    for _ in range(2):
        with pytest.raises(StateError, match="No space left on device"):
            allocate(j, 1)
    assert "No space left" in j.status()["failing"]
    assert caplog.text.count("Allocate answers UNAVAILABLE") == 1  # once per state change
    assert j.records() == tuple(kept)
    assert read_journal(j.path).records == tuple(kept)  # nothing half-written left behind
    os.unlink(small_fs / "filler")
    later = allocate(j, 2)
    assert j.status()["failing"] == "" and "written again" in caplog.text
    j.close()
    assert journal_at(small_fs).records() == (*kept, later)


def test_a_read_only_state_dir_refuses_and_recovers_on_remount(small_fs):
    j = journal_at(small_fs)
    kept = allocate(j, 0)
    j.close()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        again = journal_at(small_fs)  # the agent starts on a read-only state directory
        assert again.records() == (kept,)
        with pytest.raises(StateError, match="Read-only file system"):
            allocate(again, 1)
        assert "Read-only" in again.status()["failing"]
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    later = allocate(again, 2)
    assert again.status()["failing"] == ""
    again.close()
    assert journal_at(small_fs).records() == (kept, later)


def test_a_new_records_entry_is_the_plain_one(state):
    # the bytes record_allocation writes must be those put_frame writes, or a replay would
    # read something else
    j = journal_at(state)
    first = allocate(j, 2, 3)
    second = allocate(j, 2, 3)
    # held in memory sharing the answer's parts: read back the same
    assert j.records() == (first, second)
    assert (j.status()["allocations"], j.status()["pending"]) == (2, 2)
    j.close()
    raw = _raw(state)
    for r in (first, second):
        assert frames.put_frame(r) in raw
    assert journal_at(state).records() == (first, second)


def test_a_pass_that_changes_no_new_record_writes_nothing(state):
    # A reconciliation hands back new Records for those it kept, and one that leaves them as
    # they were must write nothing
    from agent.state.reconcile import PodDevices, reconcile

    j = journal_at(state)
    claimed, pending = allocate(j, 0), allocate(j, 1, 2)
    listing = [PodDevices("ns", "p", "main", "nvidia.com/gpu", claimed.devices)]
    devices = {"nvidia.com/gpu": DEVICES}

    def reconcile_now(at: float) -> bool:
        return j.apply(reconcile(j.records(), listing, devices=devices, keyed_by="uuid",
                                 boot="boot-1", now=at))

    assert reconcile_now(claimed.time + 1)  # the claim is written
    size = os.path.getsize(state / JOURNAL_FILE)
    assert not reconcile_now(claimed.time + 2)  # a newer confirmation time: memory only
    assert os.path.getsize(state / JOURNAL_FILE) == size
    [got_claimed, got_pending] = j.records()
    assert got_pending == pending and got_claimed.pod == ck.PodRef("ns", "p", "main")
    assert got_claimed.confirmed == claimed.time + 2
    j.close()
