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


@pytest.fixture
def flight(monkeypatch) -> shared_dir._Flight:
    """This test's own record of writes under way: a seal here must not seal the test process's writes."""
    fresh = shared_dir._Flight()
    monkeypatch.setattr(shared_dir, "_FLIGHT", fresh)
    return fresh


def test_ready_is_asked_before_the_temporary_is_made_and_before_the_rename(shared):
    seen = []

    def ready() -> bool:
        seen.append(sorted(p.name for p in shared.iterdir()))
        return len(seen) == 1 or (shared / "go").exists()

    assert not shared_dir.write_atomic(shared / "lease.json", b"x", ready=ready)
    assert seen[0] == [] and len(seen[1]) == 1 and seen[1][0].startswith(".lease.json.")  # the temporary, then gone
    assert list(shared.iterdir()) == []
    seen.clear()
    assert not shared_dir.write_atomic(shared / "lease.json", b"x", ready=lambda: seen.append(1) and False)
    assert seen == [1] and list(shared.iterdir()) == []  # refused first: nothing created at all


def test_a_seal_removes_the_temporary_of_a_write_under_way_and_refuses_every_later_one(shared, flight):
    """A process ending with os._exit from its watchdog thread while its main thread writes (runner/process/worker.py
    `_exit`): the temporary is removed, the write under way fails at its rename, and no later write creates one."""
    inside, release, outcome = threading.Event(), threading.Event(), []
    calls = []

    def ready() -> bool:  # the second call: the data is written and synced, the rename is next
        calls.append(1)
        if len(calls) == 2:
            inside.set()
            release.wait(10)
        return True

    def write() -> None:
        try:
            outcome.append(shared_dir.write_atomic(shared / "lease.json", b"mine", ready=ready))
        except OSError as err:
            outcome.append(err)

    writer = threading.Thread(target=write)
    writer.start()
    assert inside.wait(10)
    assert next(p.name for p in shared.iterdir()).endswith(".tmp")
    shared_dir.seal()
    assert list(shared.iterdir()) == []
    release.set()
    writer.join(10)
    assert isinstance(outcome[0], FileNotFoundError) and list(shared.iterdir()) == []
    with pytest.raises(shared_dir.Sealed, match="ending"):
        shared_dir.write_atomic(shared / "metrics.json", b"late")
    assert list(shared.iterdir()) == [] and flight.temporaries == {}


def test_the_worker_exit_leaves_no_temporary_of_a_write_its_main_thread_has_under_way(shared):
    """runner/process/worker.py's `_exit` from another thread, the main thread inside write_atomic: exit code kept,
    nothing left in the directory."""
    import subprocess
    import sys

    code = f"""
import threading, time
from pathlib import Path
from jobspec import shared_dir
from runner.process import worker
def ready():  # the first call, before the temporary: go on; the second, before the rename: the watchdog ends it
    if not shared_dir._FLIGHT.temporaries:
        return True
    threading.Thread(target=worker._exit, args=(7,)).start()
    time.sleep(30)
    return True
shared_dir.write_atomic(Path({str(shared)!r}) / "lease.json", b"mine", ready=ready)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 7, done.stderr
    assert list(shared.iterdir()) == []
