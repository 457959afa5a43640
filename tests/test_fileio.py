"""agent.fileio.write_atomic on a real directory: the contents and the exact mode, no temp file
left behind, file and directory fsynced, and the previous file intact when a write fails.
"""

from __future__ import annotations

import os
import stat

import pytest

from agent.fileio import TEMP_SUFFIX, write_atomic


def leftovers(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(TEMP_SUFFIX))


BIG = [bytes([i]) * 70_000 for i in range(3)]  # more than the write buffer


@pytest.mark.parametrize("make, expected", [
    (lambda: b"", b""),
    (lambda: b"one piece\n", b"one piece\n"),
    (lambda: [b"several ", b"pieces", b"\n"], b"several pieces\n"),
    (lambda: (chunk for chunk in BIG), b"".join(BIG)),
], ids=["empty", "bytes", "chunks", "generator-beyond-the-buffer"])
def test_the_file_holds_the_data(tmp_path, make, expected):
    path = tmp_path / "state.json"
    write_atomic(str(path), make())
    assert path.read_bytes() == expected
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o640], ids=oct)
def test_the_mode_is_exact_whatever_the_umask_or_an_old_temp_file(tmp_path, mode):
    path = tmp_path / "checkpoint"
    (tmp_path / ("checkpoint" + TEMP_SUFFIX)).write_bytes(b"cut short")  # a crashed write
    os.chmod(tmp_path / ("checkpoint" + TEMP_SUFFIX), 0o777)
    old = os.umask(0o077)
    try:
        write_atomic(str(path), b"x", mode)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    assert path.read_bytes() == b"x" and leftovers(tmp_path) == []


def test_an_existing_file_is_replaced_not_rewritten_in_place(tmp_path):
    path = tmp_path / "health.json"
    path.write_bytes(b"old\n")
    before = os.stat(path).st_ino
    write_atomic(str(path), b"new\n")
    assert path.read_bytes() == b"new\n"
    assert os.stat(path).st_ino != before  # a new inode renamed over the old name


def test_the_file_then_the_directory_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_atomic(str(tmp_path / "f"), b"data")
    assert synced == ["file", "dir"]


def test_a_file_rebuilt_at_every_start_is_replaced_without_fsyncs(tmp_path, monkeypatch):
    # status.json: rewritten each loop tick, rebuilt from memory at start; not worth 2 fsyncs
    path = tmp_path / "status.json"
    path.write_bytes(b"old\n")
    before = os.stat(path).st_ino
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    write_atomic(str(path), b"new\n", mode=0o644, durable=False)
    assert (path.read_bytes(), synced) == (b"new\n", [])
    assert os.stat(path).st_ino != before and stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert sorted(os.listdir(tmp_path)) == ["status.json"]


def test_data_that_raises_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "checkpoint"
    path.write_bytes(b"old")

    def chunks():
        yield b"half of the new "
        raise ValueError("cannot pack a record")

    with pytest.raises(ValueError, match="cannot pack a record"):
        write_atomic(str(path), chunks())
    assert path.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


def test_a_failed_rename_leaves_the_target_and_no_temp_file(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "inside").write_bytes(b"kept")
    with pytest.raises(OSError):
        write_atomic(str(target), b"data")
    assert (target / "inside").read_bytes() == b"kept"
    assert leftovers(tmp_path) == []


def test_a_missing_directory_is_an_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomic(str(tmp_path / "gone" / "f"), b"data")
    assert not (tmp_path / "gone").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_leaves_the_old_file(tmp_path):
    path = tmp_path / "status.json"
    path.write_bytes(b"old")
    os.chmod(tmp_path, 0o500)
    try:
        with pytest.raises(PermissionError):
            write_atomic(str(path), b"new")
    finally:
        os.chmod(tmp_path, 0o700)
    assert path.read_bytes() == b"old"
    assert leftovers(tmp_path) == []
