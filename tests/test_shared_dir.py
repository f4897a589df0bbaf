"""jobspec.shared_dir, the one way to write into a directory others can write: every operation against the names
another job can plant (a symbolic link, a hard link, a FIFO, a directory), and the file outside keeps its bytes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from jobspec import shared_dir
from jobspec.shared_dir import Unsafe


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "outside" / "victim.txt"
    path.parent.mkdir()
    path.write_text("another job's bytes\n" * 100)
    return path


@pytest.fixture
def shared(tmp_path) -> Path:
    path = tmp_path / "shared"
    path.mkdir()
    return path


def _plant(kind: str, at: Path, victim: Path) -> None:
    if kind == "symlink":
        at.symlink_to(victim)
    elif kind == "hardlink":
        os.link(victim, at)
    elif kind == "fifo":
        os.mkfifo(at)
    else:
        at.mkdir()


KINDS = ["symlink", "hardlink", "fifo", "directory"]


@pytest.mark.parametrize("kind", KINDS)
def test_write_atomic_replaces_what_is_planted_never_writes_through_it(shared, victim, kind):
    before = victim.read_bytes()
    _plant(kind, shared / "stamp", victim)
    if kind == "directory":
        with pytest.raises(OSError):
            shared_dir.write_atomic(shared / "stamp", b"mine")
    else:
        shared_dir.write_atomic(shared / "stamp", b"mine")
        assert (shared / "stamp").read_bytes() == b"mine" and not (shared / "stamp").is_symlink()
    assert victim.read_bytes() == before
    assert sorted(p.name for p in shared.iterdir()) == ["stamp"]  # no temporary left behind


@pytest.mark.parametrize("kind", KINDS)
def test_appends_and_locks_refuse_a_planted_name(shared, victim, kind):
    before = victim.read_bytes()
    _plant(kind, shared / "metrics.jsonl", victim)
    with pytest.raises(Unsafe) as err:
        shared_dir.open_append(shared / "metrics.jsonl")
    assert err.value.problem.startswith("metrics.jsonl ")
    with pytest.raises(Unsafe):
        shared_dir.open_lock(shared / "metrics.jsonl")
    assert victim.read_bytes() == before


@pytest.mark.parametrize("kind", KINDS)
def test_create_and_create_exclusive_never_take_a_name_someone_made(shared, victim, kind):
    before = victim.read_bytes()
    _plant(kind, shared / "lease.json", victim)
    with pytest.raises(OSError):
        shared_dir.create(shared / "lease.json")
    if kind != "directory":
        assert shared_dir.create_exclusive(shared / "lease.json", b"mine") is False
    assert victim.read_bytes() == before


def test_a_fifo_never_blocks_an_open(shared):
    os.mkfifo(shared / "index.jsonl")
    done = threading.Event()

    def opener() -> None:
        with pytest.raises(Unsafe, match="FIFO"):
            shared_dir.open_read(shared / "index.jsonl")
        done.set()

    threading.Thread(target=opener, daemon=True).start()
    assert done.wait(10), "opening a FIFO blocked"


def test_plain_files_work_as_files(shared):
    with shared_dir.open_append(shared / "m.jsonl") as f:
        f.write("one\n")
    with shared_dir.open_append(shared / "m.jsonl") as f:
        f.write("two\n")
    assert (shared / "m.jsonl").read_text() == "one\ntwo\n"
    assert shared_dir.create_exclusive(shared / "new", b"x") and (shared / "new").read_bytes() == b"x"
    fd = shared_dir.open_lock(shared / "x.lock")
    os.close(fd)
    with shared_dir.open_read(shared / "new") as f:
        assert f.read() == b"x"


def test_directories_of_its_own_and_fresh_temporary_ones(shared, victim):
    assert shared_dir.directory(shared / "a" / "b") == shared / "a" / "b" and (shared / "a" / "b").is_dir()
    (shared / "link").symlink_to(victim.parent)
    with pytest.raises(Unsafe, match="symbolic link"):
        shared_dir.directory(shared / "link")
    assert shared_dir.directory(shared / "link", follow=True) == shared / "link"  # a directory a person named
    (shared / "dangling").symlink_to(shared / "nowhere")
    with pytest.raises(Unsafe, match="dangling"):
        shared_dir.directory(shared / "dangling")
    a, b = shared_dir.make_temp_dir(shared, ".tmp-x-"), shared_dir.make_temp_dir(shared, ".tmp-x-")
    assert a != b and a.is_dir() and not a.is_symlink() and a.name.startswith(".tmp-x-")
    assert shared_dir.temp_name("n") != shared_dir.temp_name("n")
    with pytest.raises(ValueError, match="not in one directory"):
        shared_dir.replace(a / "f", b / "f")
    assert list(victim.parent.iterdir()) == [victim]
