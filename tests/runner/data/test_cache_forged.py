"""Content binds the cache (issue 32, item 2): a forged or copied digest stamp, another entry copied under the right
name, or a forged VERIFIED stamp never makes a job train on other tokens; with JOBSPEC_CHECKPOINT_KEY set, entries
and stamps are signed and an unsigned one is not used. Each case ends in the job's own tokens, logged."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from jobspec.shared_dir import signing
from jobspec.spec.models import DataSpec
from runner.data import cache
from runner.data.dataset import encode_file
from runner.data.tokenizer import ByteTokenizer
from tests.runner.data.test_cache import Counting, reference, same, write_chats

KEY = "cache-" + "0123456789abcdef" * 4
SPEC = DataSpec(max_seq_len=64)


def _pair(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Sources A and B of different chats and one cache root, each already cached."""
    a, b, root = write_chats(tmp_path / "a.jsonl", 30, seed=1), write_chats(tmp_path / "b.jsonl", 30, seed=2), \
        tmp_path / "cache"  # fmt: skip
    for source in (a, b):
        encode_file(source, SPEC, ByteTokenizer(), cache_dir=root)
    return a, b, root


def _key(source: Path, root: Path) -> cache.CacheKey:
    key = cache.cache_key(source, SPEC, ByteTokenizer(), "data.path", ("train",), stamps=root)
    assert key is not None
    return key


def _stamp_of(source: Path, root: Path) -> Path:
    st = source.stat()
    return root / f"source-{hashlib.sha256(str([st.st_dev, st.st_ino]).encode()).hexdigest()[:32]}.stamp"


def test_a_forged_digest_stamp_cannot_redirect_a_job_to_other_data(tmp_path, caplog):
    a, b, root = _pair(tmp_path)
    want = reference(a, SPEC, ByteTokenizer())
    stamp = _stamp_of(a, root)
    record = json.loads(stamp.read_text())
    b_sha = json.loads(_stamp_of(b, root).read_text())["sha256"]
    # The forger's best: A's identity and A's sampled digest (they can read A), B's sha256.
    stamp.write_text(json.dumps({**record, "sha256": b_sha}))
    tok = Counting(ByteTokenizer())
    same(encode_file(a, SPEC, tok, cache_dir=root), want)  # A's tokens (built again: no entry has this key)
    # A stamp that disagrees with the file (not A's sampled digest): ignored, the file hashed, the stamp rewritten.
    stamp.write_text(json.dumps({**record, "sha256": b_sha, "sample": "0" * 64}))
    with caplog.at_level(logging.INFO, logger="jobspec.runner"):
        same(encode_file(a, SPEC, ByteTokenizer(), cache_dir=root), want)
    assert "disagrees with the file it names" in caplog.text
    assert json.loads(stamp.read_text())["sha256"] == record["sha256"]


def test_another_entry_copied_under_the_right_name_is_damage_not_data(tmp_path, caplog):
    a, b, root = _pair(tmp_path)
    key_a, key_b = _key(a, root), _key(b, root)
    entry_a = root / key_a.digest
    shutil.rmtree(entry_a)
    shutil.copytree(root / key_b.digest, entry_a)
    meta = json.loads((entry_a / cache.META).read_text())
    (entry_a / cache.META).write_text(json.dumps({**meta, "key": key_a.digest}))  # renamed: only its parts tell
    tok = Counting(ByteTokenizer())
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        same(encode_file(a, SPEC, tok, cache_dir=root), reference(a, SPEC, ByteTokenizer()))
    assert tok.calls == 30 and "made from other data or another tokenizer" in caplog.text


def _forge_ids(entry: Path, ids: np.ndarray) -> None:
    """ids.npy replaced by `ids`, meta.json's size and sha256 rewritten to match, VERIFIED forged for the new files."""
    np.save(entry / "ids.npy", ids, allow_pickle=False)
    meta = json.loads((entry / cache.META).read_text())
    data = (entry / "ids.npy").read_bytes()
    meta["arrays"]["ids"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (entry / cache.META).write_text(json.dumps(meta))
    names = [cache.META, *(f"{n}.npy" for n in cache.ARRAYS)]
    verified = json.loads((entry / cache.VERIFIED).read_text())
    verified["identity"] = cache._identities(entry, names)
    (entry / cache.VERIFIED).write_text(json.dumps(verified))


def test_a_forged_verified_stamp_does_not_skip_the_vocabulary_check(tmp_path, caplog):
    a, _, root = _pair(tmp_path)
    entry = root / _key(a, root).digest
    encode_file(a, SPEC, ByteTokenizer(), cache_dir=root)  # read once more: VERIFIED is there
    ids = np.load(entry / "ids.npy")
    ids[3] = ByteTokenizer().vocab_size + 7  # an IndexError in the embedding; a device-side assert on a GPU
    _forge_ids(entry, ids)
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        got = encode_file(a, SPEC, ByteTokenizer(), cache_dir=root)
    assert "outside the vocabulary" in caplog.text
    same(got, reference(a, SPEC, ByteTokenizer()))


def test_with_a_key_entries_and_stamps_are_signed_and_unsigned_ones_unused(tmp_path, monkeypatch, caplog):
    a, _, root = _pair(tmp_path)  # written without a key: unsigned
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    want = reference(a, SPEC, ByteTokenizer())
    tok = Counting(ByteTokenizer())
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        same(encode_file(a, SPEC, tok, cache_dir=root), want)
    assert tok.calls == 30 and "is not signed" in caplog.text  # rebuilt, now signed
    entry = root / _key(a, root).digest
    assert signing.FIELD in json.loads((entry / cache.META).read_text())
    assert signing.FIELD in json.loads(_stamp_of(a, root).read_text())
    tok = Counting(ByteTokenizer())
    same(encode_file(a, SPEC, tok, cache_dir=root), want)
    assert tok.calls == 0  # the signed entry is used
    # A forger without the key: the same out-of-vocabulary ids, meta.json and VERIFIED rewritten to match.
    ids = np.load(entry / "ids.npy")
    ids[0] = 60000
    _forge_ids(entry, ids)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        same(encode_file(a, SPEC, ByteTokenizer(), cache_dir=root), want)
    assert "does not match its signature" in caplog.text
    stamp = _stamp_of(a, root)
    record = json.loads(stamp.read_text())
    del record[signing.FIELD]
    stamp.write_text(json.dumps(record))  # an unsigned stamp: the file is hashed again
    hashed: list[int] = []
    real = cache._sha256
    monkeypatch.setattr(cache, "_sha256", lambda f, size: hashed.append(size) or real(f, size))
    _key(a, root)
    assert hashed == [os.path.getsize(a)]
