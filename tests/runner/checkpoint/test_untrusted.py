"""A checkpoint volume others can write: no file of a checkpoint runs code when read, none hangs a reader, and a
forged one (its manifest rewritten to match, as anyone who can write the volume can) is damage that a resume
skips like any other. The export side: tests/runner/output/test_export_untrusted.py; signed manifests:
test_signing.py.

Every malicious pickle here is real: the test ends by showing that plain pickle/torch.load would run it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobspec.contract import EXIT_OK
from runner.checkpoint import lease, manifest, rng, store, unpickle, verify
from runner.checkpoint.store import DamagedCheckpoint
from tests.runner.checkpoint.forge import (
    RunsShell,
    dcp_metadata,
    deflated,
    evil_pickles,
    evil_torch_file,
    forge_bytes_item,
    replace,
    rewrite_manifest,
    unblock_fifos,
    within,
    write_metadata,
)
from tests.runner.checkpoint.test_checkpoint import CTRL, save, small_model
from tests.runner.train_helpers import ROOT, records, runner_env, timeout_s, tiny_spec, tiny_spec_dict, write_spec

HANG_S = 30.0  # verify reads a few KB here: anything near this is a hang


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "PWNED"
    yield path
    unblock_fifos(tmp_path)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    model, opt = small_model()
    save(tmp_path / "run", 2, model, opt)
    return save(tmp_path / "run", 4, model, opt)


def _load_bypassing_verify(ckpt: Path) -> None:
    """store.load straight away: what a resume does if the file changed after verify (the reader must hold too)."""
    model, opt = small_model(seed=1)
    store.load(ckpt, model, opt, rank=0, ctrl=CTRL)


# --- .metadata: the restricted unpickler ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["os.system", "exec", "Path.touch", "protocol-0"])
def test_a_metadata_pickle_that_runs_code_is_damage_and_runs_nothing(ckpt, marker, shape):
    data = evil_pickles(marker)[shape]
    (ckpt / ".metadata").write_bytes(data)
    rewrite_manifest(ckpt)
    problem = store.verify(ckpt)
    assert problem is not None and problem.startswith(".metadata is not DCP metadata (it names "), problem
    assert "which DCP metadata never holds" in problem and "a forged or foreign file" in problem
    assert store.newest_intact(ckpt.parent) == ckpt.parent / "step-2"
    with pytest.raises(DamagedCheckpoint, match=r"cannot be loaded \(.*it names .*which DCP metadata never holds"):
        _load_bypassing_verify(ckpt)
    assert not marker.exists()
    pickle.loads(data)  # the control: an unrestricted unpickler runs it
    assert marker.exists()


def test_code_hidden_inside_real_metadata_runs_nothing(ckpt, marker):
    metadata = dcp_metadata(ckpt)
    metadata.version = RunsShell(marker)  # every other field DCP's own
    write_metadata(ckpt, metadata)
    rewrite_manifest(ckpt)
    problem = store.verify(ckpt)
    assert problem is not None and "it names posix.system" in problem, problem
    with pytest.raises(DamagedCheckpoint):
        _load_bypassing_verify(ckpt)
    assert not marker.exists()


def _storage(metadata, fqn: str = "0.weight"):
    return next(info for index, info in metadata.storage_data.items() if index.fqn == f"model.{fqn}")


def _tensor(metadata, fqn: str = "0.weight"):
    return metadata.state_dict_metadata[f"model.{fqn}"]


def _set(obj, **values):
    for k, v in values.items():
        setattr(obj, k, v)


# name -> (how DCP's own classes are bent, what verify must say): they unpickle, and would read where they must not
BENT = {
    "path-absolute": (lambda m: _set(_storage(m), relative_path="/dev/zero"), "it reads from /dev/zero, which"),
    "path-out": (lambda m: _set(_storage(m), relative_path="../step-2/__0_0.distcp"), "it reads from ../step-2/"),
    "path-other-file": (lambda m: _set(_storage(m), relative_path="meta.json"), "it reads from meta.json, which"),
    "past-the-end": (lambda m: _set(_storage(m), length=10**12), "it reads bytes "),
    "negative": (lambda m: _set(_storage(m), offset=-5), "is not two non-negative integers"),
    "transform": (lambda m: _set(_storage(m), transform_descriptors=["zstd"]), "stream transforms"),
    "chunk-outside": (lambda m: _set(_tensor(m).chunks[0], sizes=torch.Size([99, 4])), "lies outside its tensor"),
    "size-not-a-size": (lambda m: _set(_tensor(m), size=[8, 4]), "is not a tensor size"),
    "dtype-not-a-dtype": (lambda m: _set(_tensor(m).properties, dtype="float32"), "are not a dtype"),
    "chunk-unstored": (lambda m: m.storage_data.pop(next(i for i in m.storage_data if i.fqn == "model.0.weight")),
                       "model.0.weight has no stored bytes"),
    "extra-field": (lambda m: _set(m, planner=[1]), "its Metadata has the fields"),
}  # fmt: skip


@pytest.mark.parametrize("kind", BENT)
def test_metadata_of_dcp_classes_that_reads_outside_its_shards_is_damage(ckpt, kind):
    metadata = dcp_metadata(ckpt)
    bend, expected = BENT[kind]
    bend(metadata)
    write_metadata(ckpt, metadata)
    rewrite_manifest(ckpt)
    problem = within(HANG_S, lambda: store.verify(ckpt), "verify")
    assert problem is not None and problem.startswith(".metadata does not describe this checkpoint's shards (")
    assert expected in problem and problem.endswith("a forged or foreign file"), problem
    with pytest.raises(DamagedCheckpoint):
        within(HANG_S, lambda: _load_bypassing_verify(ckpt), "load")


def test_metadata_that_repeats_one_shared_list_costs_its_size_not_its_product(ckpt):
    """20,000 entries sharing one list of 20,000 chunks: ~250 KB of pickle, 4e8 chunk visits for a naive walk."""
    metadata = dcp_metadata(ckpt)
    shared = _tensor(metadata)
    shared.chunks = [shared.chunks[0]] * 20_000
    metadata.state_dict_metadata = {f"model.k{i}": shared for i in range(20_000)}
    write_metadata(ckpt, metadata)
    rewrite_manifest(ckpt)
    t0 = time.perf_counter()
    problem = within(HANG_S, lambda: store.verify(ckpt), "verify")
    assert problem is not None and "repeat shared parts" in problem, problem
    assert time.perf_counter() - t0 < 10


def test_a_memo_index_bomb_is_damage_without_the_memory(ckpt):
    """PUT 2**26: 10 bytes that make the C unpickler allocate and zero a 1 GiB memo array (2**31: 32 GiB)."""
    (ckpt / ".metadata").write_bytes(b"\x80\x04N\x72\x00\x00\x00\x04.")
    rewrite_manifest(ckpt)
    script = (
        "import resource, sys; from runner.checkpoint import store; "
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; problem = store.verify(sys.argv[1]); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before); print(problem)"
    )
    out = subprocess.run([sys.executable, "-c", script, str(ckpt)], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout_s(120))  # fmt: skip
    grown_kib, problem = out.stdout.splitlines()[-2:]
    assert problem.startswith(".metadata does not describe this checkpoint's shards (it holds a NoneType"), problem
    assert int(grown_kib) < 256 * 1024, f"verify grew by {int(grown_kib) // 1024} MiB"


def test_metadata_larger_than_its_bound_is_refused_before_it_is_read(ckpt, monkeypatch):
    monkeypatch.setattr(unpickle, "MAX_METADATA_BYTES", 100)
    problem = store.verify(ckpt)
    assert problem is not None and problem.startswith(".metadata has ")
    assert "more than a DCP metadata file may have (100)" in problem


def test_every_stored_item_is_bounded_by_what_its_tensor_or_value_can_take(ckpt, monkeypatch):
    """The reads DCP makes are bounded by the metadata's byte ranges: each at most the tensor chunk's bytes plus
    torch.save's zip (bytes items: MAX_BYTES_ITEM), so a range the size of a sparse terabyte shard is refused."""
    assert store.verify(ckpt) is None
    monkeypatch.setattr(unpickle, "_ITEM_OVERHEAD", 0)  # the zip around each tensor no longer fits
    problem = store.verify(ckpt)
    assert problem is not None and "bytes for model." in problem and "which takes at most" in problem, problem
    monkeypatch.undo()
    monkeypatch.setattr(unpickle, "MAX_BYTES_ITEM", 16)
    problem = store.verify(ckpt)
    assert problem is not None and "bytes for optim.param_groups.0." in problem and "at most 16" in problem, problem


def test_a_large_file_without_samples_is_malformed_not_read_whole(ckpt, monkeypatch):
    """A forged entry without samples would make a resume read a (sparse, terabyte) shard to its end."""
    monkeypatch.setattr(manifest, "FULL_CHECK_BYTES", 1024)  # the shard is larger: its entry would have samples
    assert (ckpt / "__0_0.distcp").stat().st_size > 1024 and "samples" not in (ckpt / "manifest.json").read_text()
    problem = store.verify(ckpt)
    assert problem is not None and problem.startswith("manifest.json is malformed (the entry of ")
    assert "bytes, has no samples)" in problem


# --- the byte items inside the shards and the RNG states ----------------------------------------------------


def test_an_optimizer_byte_item_that_runs_code_is_damage_and_runs_nothing(ckpt, marker):
    """DCP's DefaultLoadPlanner reads byte items with torch.load(weights_only=False): before, a resume ran this."""
    forge_bytes_item(ckpt, marker)
    rewrite_manifest(ckpt)
    problem = store.verify(ckpt)
    assert problem is not None and problem.startswith("__0_0.distcp: the stored value of optim.param_groups.0.lr ")
    assert "is not plain data" in problem
    with pytest.raises(DamagedCheckpoint, match=r"optim\.param_groups\.0\.lr"):
        _load_bypassing_verify(ckpt)  # the planner holds even when verify is skipped
    assert not marker.exists()
    torch.load(io.BytesIO(evil_torch_file(marker)), weights_only=False)  # the control
    assert marker.exists()


RNG = {
    "pickle": lambda marker: pickle.dumps(RunsShell(marker)),
    "torch-zip": evil_torch_file,
    "wrong-shape": lambda marker: rng.encode({"python": "not a state", "numpy": 1, "torch": 2, "cuda": []}),
    "short-torch-state": lambda marker: rng.encode({**rng.rng_state(), "torch": torch.zeros(3, dtype=torch.uint8)}),
    "garbage": lambda marker: os.urandom(4096),
    "deflated": lambda marker: deflated(rng.encode(rng.rng_state())),
}


@pytest.mark.parametrize("kind", RNG)
def test_a_forged_rng_state_is_damage_never_code_or_a_traceback(ckpt, marker, kind):
    (ckpt / "rng-0.pt").write_bytes(RNG[kind](marker))
    rewrite_manifest(ckpt)
    problem = store.verify(ckpt)
    assert problem is not None and problem.startswith("rng-0.pt is not an RNG state"), problem
    with pytest.raises(DamagedCheckpoint, match=r"rng-0\.pt is not an RNG state"):
        _load_bypassing_verify(ckpt)
    assert not marker.exists()


TIERS = {
    "ddp": {"memory": {"tier": "fast"}},
    "fsdp2": {"memory": {"tier": "zero3"}},
    "lora": {"model": {"preset": "tiny", "lora": {"rank": 4, "targets": ["c_attn"]}}},
}


@pytest.mark.parametrize("tier", TIERS)
def test_the_restricted_reader_reads_what_dcp_wrote_for_every_tier_exactly(tmp_path, tier):
    """Real checkpoints of the tiers the tests train (DDP/full, FSDP2 sharded, LoRA): the restricted unpickler
    admits everything they hold and reads the same metadata pickle.load does; verify passes."""
    from tests.runner.train_helpers import train_in_process

    sections = {"training": {"micro_batch": 4, "steps": 2, "warmup_steps": 1}, "checkpoints": {"every_steps": 2},
                "output": {"export": False}, **TIERS[tier]}  # fmt: skip
    assert train_in_process(tiny_spec(tmp_path / "run", **sections))[0] == EXIT_OK
    ckpt = tmp_path / "run" / "step-2"
    assert store.verify(ckpt) is None
    metadata, plain = unpickle.read_metadata(ckpt), dcp_metadata(ckpt)
    assert metadata.state_dict_metadata == plain.state_dict_metadata
    assert metadata.storage_data == plain.storage_data and metadata.planner_data == plain.planner_data
    assert any(type(v).__name__ == "BytesStorageMetadata" for v in metadata.state_dict_metadata.values())
    assert unpickle.items_problem(ckpt, metadata) is None and rng.shape_problem(rng.read(ckpt / "rng-0.pt")) is None


@pytest.mark.parametrize("fqn", ["model.0.weight", "optim.param_groups.0.lr"])
def test_an_item_whose_zip_would_inflate_is_damage_before_torch_reads_it(ckpt, fqn):
    """torch.load inflates deflated zip entries, allocating their declared size first (300 KB -> 300 MB)."""
    metadata = dcp_metadata(ckpt)
    shard = ckpt / "__0_0.distcp"
    info = next(v for i, v in metadata.storage_data.items() if i.fqn == fqn)
    with open(shard, "rb") as f:
        f.seek(info.offset)
        item = deflated(f.read(info.length))
    info.offset, info.length = shard.stat().st_size, len(item)
    with open(shard, "ab") as f:
        f.write(item)
    write_metadata(ckpt, metadata)
    rewrite_manifest(ckpt)
    problem = store.verify(ckpt)
    assert problem is not None and problem.startswith(f"__0_0.distcp: the stored bytes of {fqn} are a compressed zip")
    torch.load(io.BytesIO(item), weights_only=True)  # the control: torch itself reads (inflates) it


# --- only regular files ----------------------------------------------------------------------------------------

KINDS = {
    "devzero": "is a symbolic link (a checkpoint holds regular files only)",
    "link-out": "is a symbolic link (a checkpoint holds regular files only)",
    "fifo": "is a FIFO (named pipe), not a regular file",
    "dir": "is a directory, not a regular file",
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "rng-0.pt", "meta.json", "manifest.json"])
def test_a_file_replaced_by_a_link_fifo_or_directory_is_damage_never_a_hang(tmp_path, ckpt, marker, name, kind):
    """Before: a shard linked to /dev/zero (manifest: 0 bytes) hung verify; a FIFO hung export."""
    (tmp_path / "elsewhere").mkdir()
    replace(ckpt / name, kind, tmp_path / "elsewhere" / name)  # link-out: an identical copy outside the directory
    if name != "manifest.json" and kind != "link-out":
        rewrite_manifest(ckpt)
    problem = within(HANG_S, lambda: store.verify(ckpt), "verify")
    assert problem == f"{name} {KINDS[kind]}" or (problem or "").startswith(f"{name} {KINDS[kind]}"), problem
    assert within(HANG_S, lambda: store.newest_intact(ckpt.parent), "newest_intact") == ckpt.parent / "step-2"
    if name != "manifest.json":  # a load reads everything but the manifest
        with pytest.raises(DamagedCheckpoint, match=f"cannot be loaded \\({re.escape(name)} "):
            within(HANG_S, lambda: _load_bypassing_verify(ckpt), "load")


def test_a_step_directory_that_is_a_link_is_damage(tmp_path, ckpt):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(ckpt, elsewhere)
    ckpt.symlink_to(elsewhere)
    problem = store.verify(ckpt)
    assert problem == "step-4 is a symbolic link, not a directory of its own (a checkpoint is never written as one)"


MANIFESTS = {
    "path-out": (lambda f: f.update({"../step-2/meta.json": f["meta.json"]}), "malformed"),
    "absolute": (lambda f: f.update({"/dev/zero": {"bytes": 0, "crc32": "00000000"}}), "malformed"),
    "many-samples": (lambda f: f["meta.json"].update(samples=[[0, "0"]] * 100_000), "malformed"),
    "negative-size": (lambda f: f["meta.json"].update(bytes=-1), "malformed"),
}


@pytest.mark.parametrize("kind", MANIFESTS)
def test_a_manifest_cannot_make_verify_read_outside_or_without_end(ckpt, kind):
    record = json.loads((ckpt / "manifest.json").read_text())
    bend, expected = MANIFESTS[kind]
    bend(record["files"])
    (ckpt / "manifest.json").write_text(json.dumps(record))
    problem = within(HANG_S, lambda: store.verify(ckpt), "verify")
    assert problem is not None and expected in problem, problem


def test_json_nested_too_deeply_is_unreadable_not_a_recursion_error(ckpt):
    (ckpt / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    assert store.verify(ckpt) == "meta.json is unreadable (JSON nested deeper than 512 levels)"
    (ckpt / "meta.json").write_text(json.dumps({"step": 4, "plan": "fast"}))
    rewrite_manifest(ckpt)
    assert store.verify(ckpt) == "meta.json is malformed (its plan or lineage is not a table)"


def test_a_lease_file_that_is_a_fifo_is_unreadable_not_a_hang(tmp_path, marker):
    root = tmp_path / "run"
    root.mkdir()
    os.mkfifo(root / lease.LEASE_FILE)
    held = lease.Lease(root, "job", timeout=60)
    within(HANG_S, held.acquire, "Lease.acquire")  # an unreadable lease is taken over
    assert held.held and json.loads((root / lease.LEASE_FILE).read_text())["holder"] == held.holder


def test_the_room_a_checkpoint_takes_counts_its_own_files_only(ckpt):
    size = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    (ckpt / "big").symlink_to("/dev/zero")
    os.mkfifo(ckpt / "pipe")
    from runner.checkpoint import storage

    assert within(HANG_S, lambda: storage.directory_bytes(ckpt), "directory_bytes") == size


# --- a real resume against each attack ----------------------------------------------------------------------

STEPS = {
    "training": {"micro_batch": 4, "steps": 4},
    "checkpoints": {"every_steps": 2, "keep": 10},
    "output": {"export": False},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real run with checkpoints at steps 2 and 4."""
    from tests.runner.train_helpers import train_in_process

    run = tmp_path_factory.mktemp("trained") / "run"
    code, _ = train_in_process(tiny_spec(run, **STEPS))
    assert code == EXIT_OK
    return run


def _attack_metadata(ckpt: Path, marker: Path) -> None:
    (ckpt / ".metadata").write_bytes(evil_pickles(marker)["os.system"])


# attack -> (what it does to step-4, the damage the resume's warning names)
ATTACKS = {
    "metadata-pickle": (_attack_metadata, ".metadata is not DCP metadata (it names posix.system"),
    "byte-item-pickle": (forge_bytes_item, "__0_0.distcp: the stored value of optim.param_groups.0.lr"),
    "rng-pickle": (lambda c, m: (c / "rng-0.pt").write_bytes(evil_torch_file(m)), "rng-0.pt is not an RNG state"),
    "shard-devzero": (lambda c, m: replace(c / "__0_0.distcp", "devzero"), "__0_0.distcp is a symbolic link"),
    "shard-fifo": (lambda c, m: replace(c / "__0_0.distcp", "fifo"), "__0_0.distcp is a FIFO"),
    "metadata-fifo": (lambda c, m: replace(c / ".metadata", "fifo"), ".metadata is a FIFO"),
}  # fmt: skip


def _run_with_limit(spec: Path, limit: float) -> subprocess.CompletedProcess:
    """`python -m runner SPEC`, killed with its whole process group after `limit` s (a hang fails the test)."""
    cmd = [sys.executable, "-m", "runner", str(spec)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=runner_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"the resume hung (killed after {limit:g} s):\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# Each attack is read in process by the tests above; end to end, the default tier takes one of each kind (a pickle in
# DCP's metadata, one in a torch file, a file that is not regular) and the sweep tier (pytest -m sweep) the rest.
END_TO_END = ["metadata-pickle", "rng-pickle", "shard-fifo"]


@pytest.mark.parametrize(
    "attack", [a if a in END_TO_END else pytest.param(a, marks=pytest.mark.sweep) for a in ATTACKS]
)
def test_a_resume_skips_a_forged_or_piped_checkpoint_runs_no_code_and_finishes(tmp_path, trained, marker, attack):
    """step-4 forged (its manifest rewritten to match), step-2 intact: the run warns naming the file, resumes at 2
    and finishes with exit 0; the attacker's code never ran. Before: code ran (exit 0 or 1), or the run hung."""
    run = tmp_path / "run"
    run.mkdir()
    for step in (2, 4):
        shutil.copytree(trained / f"step-{step}", run / f"step-{step}")
    forge, expected = ATTACKS[attack]
    forge(run / "step-4", marker)
    rewrite_manifest(run / "step-4")
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run, **{**STEPS, "training": {"micro_batch": 4, "steps": 6}}))
    result = _run_with_limit(spec, timeout_s(240))
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    assert f"step-4 is damaged ({expected}" in result.stderr and "moved to step-4.damaged" in result.stderr
    assert "Traceback" not in result.stderr
    assert records(run, "plan")[0]["step"] == 2 and [r["step"] for r in records(run)] == [3, 4, 5, 6]
    assert not marker.exists()
    assert store.verify(run / "step-6") is None and manifest.check(run / "step-4", 4) is None


# --- any mutation: intact or damage, never code, a traceback or a hang ----------------------------------------


@functools.cache
def _pristine() -> Path:
    """One real checkpoint, written once per session (removed at exit), copied for every example."""
    root = Path(tempfile.mkdtemp(prefix="pristine-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    model, opt = small_model()
    return save(root, 4, model, opt)


MUTANT_MARKER = Path(tempfile.gettempdir()) / f"jobspec-mutant-ran-{os.getpid()}"
# pieces of pickles that run code, spliced into real files: os.system(touch MUTANT_MARKER), its opcodes alone
FRAGMENTS = [pickle.dumps(RunsShell(MUTANT_MARKER))[2:-1], b"cposix\nsystem\n", b"\x93", b"R", b"b", b"."]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=st.sampled_from([".metadata", "rng-0.pt", "__0_0.distcp"]),
    cut=st.floats(0, 1),
    op=st.sampled_from(["flip", "truncate", "insert", "overwrite"]),
    payload=st.one_of(st.binary(min_size=1, max_size=64), st.sampled_from(FRAGMENTS)),
)
def test_any_mutation_of_a_pickle_is_intact_or_damage_and_runs_nothing(name, cut, op, payload):
    work = Path(tempfile.mkdtemp(prefix="mutant-"))
    try:
        ckpt = work / "step-4"
        shutil.copytree(_pristine(), ckpt)
        data = bytearray((ckpt / name).read_bytes())
        at = int(cut * (len(data) if name != "__0_0.distcp" else min(len(data), 16_384)))  # the shard's byte items
        if op == "flip":
            data[min(at, len(data) - 1)] ^= payload[0] or 1
        elif op == "truncate":
            del data[at:]
        elif op == "insert":
            data[at:at] = payload
        else:
            data[at : at + len(payload)] = payload
        (ckpt / name).write_bytes(bytes(data))
        rewrite_manifest(ckpt)
        problem = within(HANG_S, lambda: store.verify(ckpt), "verify")
        assert problem is None or isinstance(problem, str)
        if problem is None:  # intact as far as verify can tell: the load holds or says DamagedCheckpoint
            with contextlib.suppress(DamagedCheckpoint):
                within(HANG_S, lambda: _load_bypassing_verify(ckpt), "load")
        assert not MUTANT_MARKER.exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_enum_members_pickled_through_getattr_are_read_and_nothing_else_is():
    """Python 3.12 (and 3.11's later patch releases, as in the runner image) pickle an enum member as
    `getattr(EnumClass, "NAME")`: DCP's metadata then names builtins.getattr. It must read, and getattr stay
    limited to the members of DCP's own enums."""
    import enum
    import io
    import pickle

    from runner.checkpoint.unpickle import _allowed_globals, _Unpickler

    class Py312(pickle._Pickler):  # the pure-Python pickler, with 3.12's enum reduction
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    def dumps(obj) -> bytes:
        buf = io.BytesIO()
        Py312(buf, protocol=4).dump(obj)
        return buf.getvalue()

    from torch.distributed.checkpoint.metadata import TensorProperties

    props = TensorProperties(dtype=torch.float32)
    data = dumps(props)
    assert b"getattr" in data
    assert _Unpickler(data, _allowed_globals()).load().memory_format == props.memory_format
    for target, name in ((torch.Size, "__new__"), (TensorProperties, "__init__"), (props, "dtype")):
        buf = io.BytesIO()
        pickler = pickle._Pickler(buf, protocol=4)
        pickler.save_reduce(getattr, (target, name), obj=None)
        pickler.write(pickle.STOP)
        with pytest.raises(pickle.UnpicklingError):
            _Unpickler(buf.getvalue(), _allowed_globals()).load()


def test_shards_of_an_older_step_under_a_newer_manifest_are_damage_and_skipped(tmp_path, ckpt, caplog):
    """step-2's shards and .metadata copied into step-4 and the manifest rewritten to match (no key): the shards say
    which step they hold, so step-4 is damaged and the resume takes step-2, as for any damaged step."""
    older = ckpt.parent / "step-2"
    for name in (store.DCP_METADATA, "__0_0.distcp"):
        shutil.copyfile(older / name, ckpt / name)
    rewrite_manifest(ckpt)
    assert store.verify(ckpt) == "the shards hold step 2, not step 4 (shards of another checkpoint under this one)"
    with caplog.at_level("WARNING", logger="jobspec.runner"):
        assert store.newest_intact(ckpt.parent, quarantine=True) == older
    assert "step-4 is damaged (the shards hold step 2" in caplog.text
    meta = json.loads((older / "meta.json").read_text())
    (older / "meta.json").write_text(json.dumps({**meta, "format": 3}))
    metadata = unpickle.read_metadata(older)
    assert verify._step_problem(older, metadata, 2, holds_step=True) is None
    del metadata.state_dict_metadata["jobspec.step"]  # a format-3 checkpoint whose shards hold no step
    assert "do not say which step" in verify._step_problem(older, metadata, 2, holds_step=True)


def test_every_shard_file_holds_its_step_and_the_optimizer_counters_add_up(ckpt):
    """FORMAT 4: the shard file holds its rank's own step item, and meta.json the sum of Adam's step counters (4
    parameters, one step each). A meta.json whose sum disagrees with the counters in the shards (rewritten with its
    manifest, no key) is damage, like a shard file that holds another step."""
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["format"] == store.FORMAT == 4 and meta[store.OPTIMIZER_STEPS] == 4
    assert verify._shards_problem(ckpt, 4, meta) is None
    (ckpt / "meta.json").write_text(json.dumps({**meta, store.OPTIMIZER_STEPS: 8}))
    rewrite_manifest(ckpt)
    assert store.verify(ckpt) == (
        "the optimizer's step counters in the shards add up to 4, meta.json says 8 "
        "(shards of another checkpoint under this one)"
    )
    metadata = unpickle.read_metadata(ckpt)
    del metadata.state_dict_metadata["jobspec.rank_step.0"]
    for index in [i for i in metadata.storage_data if i.fqn == "jobspec.rank_step.0"]:
        del metadata.storage_data[index]
    write_metadata(ckpt, metadata)
    rewrite_manifest(ckpt)
    assert store.verify(ckpt) == "__0_0.distcp does not say which step it holds (meta.json says format 4 or later)"
