"""The tokenize-once cache: a restart reads it without tokenizing, a damaged entry is rebuilt, a change of any
key part misses, two processes build once, and what is cached equals what tokenizing gives; the chunked,
pooled and vectorized tokenizing gives the Streams of the record-by-record path it replaced."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import runner.data.dataset as dataset
import runner.data.prepare as prepare
from jobspec.errors import ConfigError
from jobspec.spec.models import DataSpec
from runner.data.cache import cache_key, cached_streams
from runner.data.dataset import BUNDLED, encode_file, flatten
from runner.data.records import read_records
from runner.data.tokenizer import ByteTokenizer
from runner.data.tokens import Streams, StreamsBuilder
from tests.runner.data.test_chat_masks import CHATML, CHATML_GENERATION, CHATS, TRIMMING, chat, hf_tokenizer
from tests.runner.train_helpers import Drained

ROOT = Path(__file__).resolve().parents[3]


class Counting:
    """A tokenizer that counts its rendering calls (the wrapped one does the work)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.name, self.vocab_size, self.pad_id = inner.name, inner.vocab_size, inner.pad_id
        self.eos_id, self.max_token_chars = inner.eos_id, inner.max_token_chars

    def render(self, messages):
        self.calls += 1
        return self.inner.render(messages)

    def render_batch(self, chats):
        self.calls += len(chats)
        return self.inner.render_batch(chats)

    def cache_identity(self):
        return self.inner.cache_identity()


def write_chats(path: Path, n: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"messages": chat(int(rng.integers(1, 9)), system=bool(i % 3), seed=i)}) + "\n")
    return path


def reference(source: Path, spec: DataSpec, tok) -> Streams:
    """The record-by-record path encode_file took before chunks, pools and caches."""
    out = StreamsBuilder(tok.vocab_size)
    for _, record in read_records(source, spec):
        messages = dataset.to_messages(record, dataset.detect_format(record, spec, "x"), spec)
        out.add(*flatten(tok.render(messages), spec.max_seq_len + 1))
    return out.build()


def same(a: Streams, b: Streams) -> None:
    for name in ("ids", "flags", "bounds", "trainable"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def test_the_byte_tokenizers_vectorized_render_is_its_render():
    tok = ByteTokenizer()
    odd = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}, {"role": "system", "content": "é✓"}]
    for messages in [*CHATS, odd, chat(64, seed=9)]:
        ids, flags = tok.render_ids(messages)
        want = flatten(tok.render(messages), 1 << 30)
        assert np.array_equal(ids, want[0]) and np.array_equal(flags, want[1])


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION, TRIMMING, ""])
def test_the_batched_hf_render_is_the_per_chat_render(tmp_path, template):
    tok = hf_tokenizer(tmp_path, template)
    if not template:
        tok.has_template = False
    chats = [*CHATS, [{"role": "user", "content": "  pad  "}, {"role": "assistant", "content": "  yo  "}]]
    for (ids, flags), messages in zip(tok.render_batch(chats), chats, strict=True):
        want = flatten(tok.render(messages), 1 << 30)
        assert np.array_equal(ids, want[0]) and np.array_equal(flags, want[1])


@pytest.mark.parametrize("kind", ["bytes", "hf"])
def test_chunked_and_pooled_tokenizing_gives_the_record_by_record_streams(tmp_path, monkeypatch, kind):
    tok = ByteTokenizer() if kind == "bytes" else hf_tokenizer(tmp_path / "tok", CHATML)
    source = write_chats(tmp_path / "chats.jsonl", 300)
    spec = DataSpec(max_seq_len=48)  # some chats truncated
    want = reference(source, spec, tok)
    same(encode_file(source, spec, tok), want)  # in process (a small file)
    monkeypatch.setattr(dataset, "CHUNK_RECORDS", 16)
    monkeypatch.setattr(prepare, "POOL_AFTER", 32)
    monkeypatch.setattr(prepare, "usable_cpus", lambda: 2)
    same(encode_file(source, spec, tok), want)  # over 2 worker processes after the first chunks, in order
    same(encode_file(BUNDLED, DataSpec(max_seq_len=64), tok), reference(BUNDLED, DataSpec(max_seq_len=64), tok))


def test_a_bad_record_in_a_chunk_is_named(tmp_path):
    source = write_chats(tmp_path / "chats.jsonl", 20)
    lines = source.read_text().splitlines()
    lines[12] = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]})
    source.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"chats.jsonl:13: each message needs a role"):
        encode_file(source, DataSpec(), ByteTokenizer())


def test_a_restart_reads_the_cache_without_tokenizing(tmp_path, caplog):
    source, spec, cache = write_chats(tmp_path / "chats.jsonl", 200), DataSpec(max_seq_len=64), tmp_path / "cache"
    cold = Counting(ByteTokenizer())
    first = encode_file(source, spec, cold, cache_dir=cache)
    assert cold.calls == 200
    restart = Counting(ByteTokenizer())
    with caplog.at_level(logging.INFO, logger="jobspec.runner"):
        again = encode_file(source, spec, restart, cache_dir=cache)
    assert restart.calls == 0 and "from the cache" in caplog.text
    same(again, reference(source, spec, ByteTokenizer()))
    same(first, again)
    assert isinstance(again.ids, np.memmap) and isinstance(again.flags, np.memmap)  # mapped, not copied
    assert again.ids.dtype == np.uint16
    # The same bytes under another name are the same entry.
    moved = tmp_path / "elsewhere.jsonl"
    moved.write_bytes(source.read_bytes())
    encode_file(moved, spec, restart, cache_dir=cache)
    assert restart.calls == 0
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1


def _truncate(entry: Path) -> None:
    with (entry / "ids.npy").open("r+b") as f:
        f.truncate(os.path.getsize(entry / "ids.npy") - 2)


def _flip(entry: Path) -> None:
    raw = bytearray((entry / "flags.npy").read_bytes())
    raw[-1] ^= 1
    (entry / "flags.npy").write_bytes(bytes(raw))


def _meta(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    meta["arrays"]["bounds"]["length"] += 1
    (entry / "meta.json").write_text(json.dumps(meta))


def _symlink(entry: Path) -> None:
    (entry / "bounds.npy").rename(entry.parent / "outside.npy")
    (entry / "bounds.npy").symlink_to(entry.parent / "outside.npy")


def _fifo(entry: Path) -> None:
    (entry / "trainable.npy").unlink()
    os.mkfifo(entry / "trainable.npy")


def _bounds(entry: Path) -> None:
    """Consistent meta.json, wrong content: bounds that do not rise (as a bug in a writer could leave)."""
    bounds = np.load(entry / "bounds.npy")
    bounds[1], bounds[2] = bounds[2], bounds[1]
    np.save(entry / "bounds.npy", bounds)
    _rehash(entry, "bounds")


def _vocab(entry: Path) -> None:
    ids = np.load(entry / "ids.npy")
    ids[3] = 999
    np.save(entry / "ids.npy", ids)
    _rehash(entry, "ids")


def _rehash(entry: Path, name: str) -> None:
    import hashlib

    meta = json.loads((entry / "meta.json").read_text())
    raw = (entry / f"{name}.npy").read_bytes()
    meta["arrays"][name].update(sha256=hashlib.sha256(raw).hexdigest(), bytes=len(raw))
    (entry / "meta.json").write_text(json.dumps(meta))


DAMAGE = {
    "truncated array": _truncate,
    "flipped byte": _flip,
    "wrong meta": _meta,
    "symlink": _symlink,
    "fifo": _fifo,
    "missing file": lambda e: (e / "ids.npy").unlink(),
    "meta not json": lambda e: (e / "meta.json").write_bytes(b"\xff{"),
    "meta nested past the parser": lambda e: (e / "meta.json").write_bytes(b"[" * 100_000),
    "bounds not rising": _bounds,
    "id past the vocabulary": _vocab,
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cache_is_detected_and_rebuilt(tmp_path, caplog, damage):
    source, spec, cache = write_chats(tmp_path / "chats.jsonl", 50), DataSpec(max_seq_len=64), tmp_path / "cache"
    encode_file(source, spec, ByteTokenizer(), cache_dir=cache)
    want = reference(source, spec, ByteTokenizer())  # in memory: the mapped entry is what gets damaged
    [entry] = [p for p in cache.iterdir() if p.is_dir()]
    DAMAGE[damage](entry)
    tok = Counting(ByteTokenizer())
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        got = encode_file(source, spec, tok, cache_dir=cache)
    assert tok.calls == 50, "rebuilt"
    assert "cache entry damaged, rebuilding it" in caplog.text and str(entry) in caplog.text
    same(got, want)
    again = Counting(ByteTokenizer())
    same(encode_file(source, spec, again, cache_dir=cache), want)
    assert again.calls == 0, "the rebuilt entry is read"


def test_a_change_of_any_key_part_misses_the_cache(tmp_path):
    source = write_chats(tmp_path / "chats.jsonl", 20)
    byte, spec = ByteTokenizer(), DataSpec()
    chatml = hf_tokenizer(tmp_path / "a", CHATML)
    other = hf_tokenizer(tmp_path / "b", CHATML.replace("\n{{ m['content'] }}", ": {{ m['content'] }}"))

    def key(src=source, s=spec, tok=byte, splits=("train",)):
        k = cache_key(src, s, tok, "data.path", splits)
        assert k is not None
        return k.digest

    changed = tmp_path / "changed.jsonl"
    changed.write_bytes(source.read_bytes().replace(b"be brief", b"be brisk"))
    digests = [
        key(),
        key(src=changed),
        key(s=DataSpec(max_seq_len=1024)),
        key(s=DataSpec(format="messages")),
        key(s=DataSpec(messages_field="chat")),
        key(s=DataSpec(prompt_field="q")),
        key(s=DataSpec(response_field="a")),
        key(splits=("validation", "test")),
        key(tok=chatml),
        key(tok=other),  # the same vocabulary, another template
    ]
    assert len(set(digests)) == len(digests)
    assert key() == key() and key(tok=chatml) == key(tok=hf_tokenizer(tmp_path / "c", CHATML))
    assert key(s=DataSpec(packing=True)) == key()  # packing is done from the cached records at load time
    # End to end: other bytes are tokenized again.
    cache = tmp_path / "cache"
    encode_file(source, spec, byte, cache_dir=cache)
    tok = Counting(byte)
    encode_file(changed, spec, tok, cache_dir=cache)
    assert tok.calls == 20


def test_a_hub_id_is_not_cached_and_the_log_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="jobspec.runner"):
        assert cache_key("org/some-set", DataSpec(), ByteTokenizer(), "data.path", ("train",)) is None
    assert "are not cached" in caplog.text and "save_to_disk" in caplog.text


def test_a_datasets_directory_is_keyed_by_its_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    datasets.Dataset.from_list([{"prompt": "p", "response": "r"}]).save_to_disk(str(folder))
    first = cache_key(folder, DataSpec(), ByteTokenizer(), "data.path", ("train",))
    (folder / "cache-0123.arrow").write_bytes(b"left by a map()")  # not part of the data
    assert cache_key(folder, DataSpec(), ByteTokenizer(), "data.path", ("train",)) == first
    datasets.Dataset.from_list([{"prompt": "p", "response": "s"}]).save_to_disk(str(tmp_path / "other"))
    assert cache_key(tmp_path / "other", DataSpec(), ByteTokenizer(), "data.path", ("train",)) != first


def test_meta_json_holds_no_secret_and_no_tokenizer_state(tmp_path, monkeypatch):
    secret = "hf_SECRETxyz123"
    monkeypatch.setenv("HF_TOKEN", secret)
    tok = hf_tokenizer(tmp_path / "tok", CHATML)
    source, cache = write_chats(tmp_path / "chats.jsonl", 10), tmp_path / "cache"
    encode_file(source, DataSpec(), tok, cache_dir=cache)
    [meta] = list(cache.glob("*/meta.json"))
    text = meta.read_text()
    assert secret not in text and "merges" not in text  # hashes of the tokenizer state, not the state
    doc = json.loads(text)
    assert doc["parts"]["max_seq_len"] == "512" and doc["parts"]["tokenizer.chat_template"] == CHATML
    assert all(isinstance(v, str) for v in doc["parts"].values())
    for name in ("ids", "flags", "bounds", "trainable"):
        np.load(meta.parent / f"{name}.npy", allow_pickle=False)  # plain arrays, no pickle


def test_a_waiter_past_the_bound_gets_a_clear_error(tmp_path):
    source, cache = write_chats(tmp_path / "chats.jsonl", 5), tmp_path / "cache"
    key = cache_key(source, DataSpec(), ByteTokenizer(), "data.path", ("train",))
    cache.mkdir()
    held = os.open(cache / f"{key.digest}.lock", os.O_RDWR | os.O_CREAT)
    try:
        os.write(held, b"node-3 pid 42")
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ConfigError, match=r"node-3 pid 42 has been tokenizing this source.*data.cache_dir"):
            cached_streams(cache, key, lambda: pytest.fail("built while another process held the lock"), wait_s=0.3)
    finally:
        os.close(held)


BUILD_SCRIPT = """
import json, sys, time
from jobspec.spec.models import DataSpec
from runner.data.dataset import encode_file
from runner.data.tokenizer import ByteTokenizer

class Slow(ByteTokenizer):
    calls = 0
    def render_batch(self, chats):
        Slow.calls += len(chats)
        time.sleep(1.0)  # long enough for the other process to arrive while this one builds
        return super().render_batch(chats)

streams = encode_file(sys.argv[1], DataSpec(max_seq_len=64), Slow(), cache_dir=sys.argv[2])
print(json.dumps([Slow.calls, int(streams.ids.sum()), len(streams)]))
"""


def test_two_processes_asking_at_once_build_once(tmp_path):
    source, cache = write_chats(tmp_path / "chats.jsonl", 40), tmp_path / "cache"
    command = [sys.executable, "-c", BUILD_SCRIPT, str(source), str(cache)]
    procs = [Drained(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert sorted(calls for calls, _, _ in results) == [0, 40]  # one built, the other waited and read
    assert results[0][1:] == results[1][1:]
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1
    assert not list(cache.glob(".tmp-*"))


def test_the_data_bench_runs_quick():
    done = subprocess.run([sys.executable, "bench/data.py", "--quick", "--tokenizer", "bytes"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for figure in ("cold ours", "cold datasets.map", "restart (fresh process", "resident per token", "64-turn"):
        assert figure in done.stdout, done.stdout


def test_a_restart_does_not_read_the_source_again_to_find_its_key_unless_it_changed(tmp_path, monkeypatch):
    """The source's digest is kept in a stamp (device, inode, size, mtime, ctime): a restart on a large source costs a
    stat; a rewritten file (even with its mtime set back) is hashed again; a forged or broken stamp is ignored."""
    import runner.data.cache as cache_mod

    source = tmp_path / "d.jsonl"
    source.write_text('{"prompt": "a", "response": "b"}\n' * 50)
    stamps, reads = tmp_path / "cache", []
    real = cache_mod._sha256
    monkeypatch.setattr(cache_mod, "_sha256", lambda f, size: reads.append(size) or real(f, size))

    def key():
        return cache_key(source, DataSpec(), ByteTokenizer(), "data.path", ("train",), stamps=stamps)

    first = key()
    assert len(reads) == 1 and len(list(stamps.glob("source-*.stamp"))) == 1
    assert key() == first and len(reads) == 1  # the restart: no read
    st = source.stat()
    source.write_text('{"prompt": "a", "response": "c"}\n' * 50)  # same size, new content
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime: ctime still moved
    changed = key()
    assert changed != first and len(reads) == 2
    (stamp,) = stamps.glob("source-*.stamp")
    record = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**record, "sha256": "f" * 64, "identity": [0, 0, 0, 0, 0]}))  # someone else's
    assert key() == changed and len(reads) == 3
    for broken in ("not json", json.dumps({**record, "sha256": "../../x"}), "[" * 5000):
        stamp.write_text(broken)
        assert key() == changed
    stamp.unlink()
    stamp.symlink_to("/dev/zero")  # never a hang
    assert key() == changed


def test_a_verified_entry_is_not_hashed_again_until_a_file_changes(tmp_path, monkeypatch):
    """The first reader checks every byte and leaves the files' identities in the entry; later readers stat them
    instead of hashing (a restart of every rank on a large cache); a file changed since is checked whole again."""
    from runner.data import cache

    source, spec, root = write_chats(tmp_path / "chats.jsonl", 50), DataSpec(max_seq_len=64), tmp_path / "cache"
    encode_file(source, spec, ByteTokenizer(), cache_dir=root)
    [entry] = [p for p in root.iterdir() if p.is_dir()]
    hashed: list[int] = []
    real = cache._sha256
    monkeypatch.setattr(cache, "_sha256", lambda f, size: hashed.append(size) or real(f, size))
    want = reference(source, spec, ByteTokenizer())
    assert (entry / cache.VERIFIED).is_file()  # the writer read its entry back, checked whole
    for _ in range(2):  # the next readers trust the stamp
        hashed.clear()
        same(encode_file(source, spec, ByteTokenizer(), cache_dir=root), want)
        assert hashed == []
    os.utime(entry / "flags.npy")  # a write of any kind moves ctime: the identity no longer matches
    hashed.clear()
    same(encode_file(source, spec, ByteTokenizer(), cache_dir=root), want)
    assert len(hashed) == len(cache.ARRAYS)


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_after_a_verified_read_is_still_detected(tmp_path, caplog, damage):
    source, spec, cache = write_chats(tmp_path / "chats.jsonl", 50), DataSpec(max_seq_len=64), tmp_path / "cache"
    encode_file(source, spec, ByteTokenizer(), cache_dir=cache)
    want = reference(source, spec, ByteTokenizer())
    same(encode_file(source, spec, ByteTokenizer(), cache_dir=cache), want)  # verified, stamp written
    [entry] = [p for p in cache.iterdir() if p.is_dir()]
    DAMAGE[damage](entry)
    tok = Counting(ByteTokenizer())
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        same(encode_file(source, spec, tok, cache_dir=cache), want)
    assert tok.calls == 50 and "cache entry damaged, rebuilding it" in caplog.text


def test_a_stamp_that_is_not_a_stamp_is_ignored(tmp_path):
    from runner.data import cache

    source, spec, root = write_chats(tmp_path / "chats.jsonl", 20), DataSpec(max_seq_len=64), tmp_path / "cache"
    encode_file(source, spec, ByteTokenizer(), cache_dir=root)
    [entry] = [p for p in root.iterdir() if p.is_dir()]
    want = reference(source, spec, ByteTokenizer())
    # the last two: past the 4 KB bound, and within it but nested deeper than json's C parser recurses
    for forged in ('["not", "a", "dict"]', '{"identity": {}, "key": "x"}', "\xff{", "{" * 10_000, "[" * 3000):
        (entry / cache.VERIFIED).write_text(forged, errors="surrogateescape")
        same(encode_file(source, spec, ByteTokenizer(), cache_dir=root), want)
    (entry / cache.VERIFIED).unlink()
    (entry / cache.VERIFIED).symlink_to("/dev/zero")
    same(encode_file(source, spec, ByteTokenizer(), cache_dir=root), want)
