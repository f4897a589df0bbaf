"""JOBSPEC_CHECKPOINT_KEY: a signed manifest (HMAC-SHA256, SHA-256 of every file) makes a forged manifest or a
swapped shard damage, where a CRC-32 manifest rewritten by the forger passes; without the key nothing changes."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from jobspec.errors import ConfigError
from jobspec.shared_dir import signing
from runner.checkpoint import manifest, store
from tests.runner.checkpoint.forge import rewrite_manifest
from tests.runner.checkpoint.test_checkpoint import CTRL, save, small_model
from tests.runner.train_helpers import records, tiny_spec, train_in_process

KEY = "k3y-" + "0123456789abcdef" * 4  # 68 bytes
OTHER_KEY = "other-" + "fedcba9876543210" * 4


@pytest.fixture
def keyed(monkeypatch):
    monkeypatch.setenv(signing.KEY_ENV, KEY)


def _swap_shard(src, dst) -> None:
    """Another checkpoint's shard (other weights, same size) in place: how a forger poisons the model."""
    shutil.copyfile(src / "__0_0.distcp", dst / "__0_0.distcp")


def _two_checkpoints(tmp_path):
    a, opt_a = small_model(seed=0)
    b, opt_b = small_model(seed=5)
    return save(tmp_path / "a", 4, a, opt_a), save(tmp_path / "b", 4, b, opt_b)


def test_without_a_key_a_rewritten_manifest_lets_a_swapped_shard_pass(tmp_path):
    """The limit the key removes: CRC-32 finds accidents, and a forger rewrites it."""
    mine, theirs = _two_checkpoints(tmp_path)
    _swap_shard(theirs, mine)
    assert "__0_0.distcp does not match its checksum" in store.verify(mine)
    rewrite_manifest(mine)
    assert store.verify(mine) is None


def test_with_a_key_the_manifest_is_signed_and_every_file_has_a_sha256(tmp_path, keyed):
    mine, _ = _two_checkpoints(tmp_path)
    record = json.loads((mine / "manifest.json").read_text())
    assert len(record[signing.FIELD]) == 64 and all(len(e["sha256"]) == 64 for e in record["files"].values())
    assert store.verify(mine) is None


@pytest.mark.parametrize("forgery", ["rewritten", "mac-removed", "mac-copied"])
def test_with_a_key_a_forged_manifest_is_damage(tmp_path, keyed, forgery):
    mine, theirs = _two_checkpoints(tmp_path)
    _swap_shard(theirs, mine)
    record = json.loads((mine / "manifest.json").read_text())
    if forgery == "rewritten":  # the forger recomputes CRCs and SHA-256s but cannot recompute the MAC
        rewrite_manifest(mine)
        record = json.loads((mine / "manifest.json").read_text())
        record[signing.FIELD] = "0" * 64
    elif forgery == "mac-removed":
        rewrite_manifest(mine)
        record = json.loads((mine / "manifest.json").read_text())
        del record[signing.FIELD]
    else:  # the whole signed manifest of the other checkpoint: valid MAC, other step directory contents
        record = json.loads((theirs / "manifest.json").read_text())
    (mine / "manifest.json").write_text(json.dumps(record))
    problem = store.verify(mine)
    expected = {
        "rewritten": "manifest.json does not match its signature",
        "mac-removed": "manifest.json is not signed, but JOBSPEC_CHECKPOINT_KEY is set",
        "mac-copied": "does not match its checksum",  # signed, but for the other files: meta.json differs
    }[forgery]
    assert problem is not None and expected in problem, problem


def test_with_a_key_a_block_changed_between_samples_is_found(tmp_path, keyed, monkeypatch):
    """Signed manifests are checked whole: sampling would let a forged block between samples through."""
    monkeypatch.setattr(manifest, "FULL_CHECK_BYTES", 1024)
    monkeypatch.setattr(manifest, "BLOCK_BYTES", 64)
    model, opt = small_model()
    ckpt = save(tmp_path, 1, model, opt)
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-200] ^= 0xFF  # inside the last tensor, between sampled blocks
    shard.write_bytes(bytes(data))
    assert "__0_0.distcp does not match its checksum" in store.verify(ckpt)
    monkeypatch.delenv(signing.KEY_ENV)
    assert store.verify(ckpt) is None  # unsigned: the sampled check's documented limit


def test_a_checkpoint_signed_with_another_key_or_unsigned_is_damage(tmp_path, monkeypatch):
    model, opt = small_model()
    unsigned = save(tmp_path / "u", 1, model, opt)
    monkeypatch.setenv(signing.KEY_ENV, OTHER_KEY)
    other = save(tmp_path / "o", 1, model, opt)
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    assert "manifest.json is not signed, but JOBSPEC_CHECKPOINT_KEY is set" in store.verify(unsigned)
    assert "signed with another JOBSPEC_CHECKPOINT_KEY" in store.verify(other)
    monkeypatch.delenv(signing.KEY_ENV)
    assert store.verify(other) is None  # no key: CRC checks only, as before


def test_with_a_key_a_checkpoint_without_a_manifest_is_damage(tmp_path, keyed):
    """Removing the manifest and the format from meta.json would look like a checkpoint from before manifests."""
    model, opt = small_model()
    ckpt = save(tmp_path, 4, model, opt)
    (ckpt / "manifest.json").unlink()
    meta = store.read_meta(ckpt)
    del meta["format"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert (
        store.verify(ckpt)
        == "manifest.json is missing, but JOBSPEC_CHECKPOINT_KEY is set (signed checkpoints have one)"
    )


@pytest.mark.parametrize("value", ["", "short-key", " " * 40])
def test_a_key_too_short_is_a_config_error_that_never_shows_it(tmp_path, monkeypatch, value):
    monkeypatch.setenv(signing.KEY_ENV, value)
    with pytest.raises(ConfigError) as err:
        store.resume_point(tmp_path, rank=0, ctrl=CTRL)
    assert err.value.exit_code == EXIT_CONFIG and "shorter than 32 bytes (its value is not shown)" in str(err.value)
    assert not value.strip() or value not in str(err.value)


def test_a_signed_run_resumes_past_a_forged_checkpoint_and_never_logs_the_key(tmp_path, keyed, caplog):
    run = tmp_path / "run"
    steps = {"training": {"micro_batch": 4, "steps": 4}, "checkpoints": {"every_steps": 2, "keep": 10},
             "output": {"export": False}}  # fmt: skip
    with caplog.at_level(logging.DEBUG):
        assert train_in_process(tiny_spec(run, **steps))[0] == EXIT_OK
        _swap_shard(run / "step-2", run / "step-4")  # step-2's weights passed off as step-4's
        rewrite_manifest(run / "step-4")
        longer = {**steps, "training": {"micro_batch": 4, "steps": 6}}
        assert train_in_process(tiny_spec(run, **longer))[0] == EXIT_OK
    assert "step-4 is damaged (manifest.json does not match its signature" in caplog.text
    assert records(run, "plan")[-1]["step"] == 2
    assert KEY not in caplog.text
