"""Fuzz the readers of untrusted files with fresh seeds for a bounded time; print cases and failures.

    python -m bench.fuzz_readers                       # 20 s per target, a fresh seed each run
    python -m bench.fuzz_readers --seconds 120 --seed 7 --targets spec,metrics

Targets (each the project's own public reader, on a file in a temporary directory):
    spec      jobspec.spec.loader.load_spec            YAML job specs
    data      runner.data.records.read_records         JSONL / JSON data sets, read to the end
    metrics   jobspec.report.load_run + plan.calibration.read_run   a run directory's metrics.jsonl
    manifest  runner.checkpoint.manifest.check         a checkpoint's checksum manifest over real files
    config    jobspec.catalog.model_config             a model directory's config.json
    cache     runner.data.dataset.encode_file          a data cache entry's meta.json and VERIFIED (shared cache dir)
    stamp     runner.data.cache.cache_key              a source's digest stamp in the cache root
    index     runner.data.stream.SourceStream.samples  a stream's position index, resumed from
    lease     runner.checkpoint.lease                  lease.json: read, the ranks' holder check, acquire
    heartbeat runner.process.heartbeat.Loss.from_json  a loss announced in the gang's store
    json      jobspec.untrusted.json_loads             the JSON reader under every file read back (linear, bounded)

Inputs are mutations of valid seeds: byte flips and cuts, splices of hostile fragments (deep nesting, huge
integers, NaN, long strings, control bytes, YAML aliases, wrong types), duplicated and truncated lines. A
case passes when the reader returns or raises the project's own error (JobspecError: exit 2 with a message);
it fails on any other exception, or when it takes longer than --case-seconds (a hang). Failures are written
to --out with their seed and case number, so `--seed S` replays a run exactly.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import io
import json
import logging
import random
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOSTILE: list[bytes] = [
    b"[" * 5000 + b"]" * 5000,
    b"{" * 3000,
    b'{"a":' * 2000 + b"1" + b"}" * 2000,
    b"9" * 5000,
    b"-" + b"9" * 400,
    b"1e999999",
    b"NaN",
    b"-Infinity",
    b"null",
    b"true",
    b'"' + b"x" * 300_000 + b'"',
    b"\x00\xff\xfe\x80",
    b"\n" * 1000,
    b"\\ud800",
    b"&a [*a, *a, *a, *a, *a, *a, *a, *a, *a]",
    b"!!python/object/apply:os.system ['true']",
    b"<<: *x",
    b"0x7fffffffffffffffffff",
    b"\t- - - - - - - - - -",
    b"\xef\xbb\xbf",
    b"'" * 1000,
    b"1_000_000_000_000_000_000",
    b'"' + b'\\"' * 16_000,  # an unterminated string of escaped quotes (a regex that backtracks: seconds)
    b'"\\' * 16_000,
    b'\\' * 32_000,
]


@dataclass
class Tally:
    cases: int = 0
    refused: int = 0  # the project's own error
    failures: list[str] = field(default_factory=list)
    slowest: float = 0.0


class Timeout(BaseException):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise Timeout


def mutate(rng: random.Random, seed: bytes) -> bytes:
    """One hostile variant of `seed`: 1-4 edits at random places."""
    data = bytearray(seed)
    for _ in range(rng.randint(1, 4)):
        at = rng.randint(0, len(data))
        op = rng.random()
        if op < 0.35:
            data[at:at] = rng.choice(HOSTILE)
        elif op < 0.5 and data:
            data[at : at + rng.randint(1, 16)] = b""
        elif op < 0.65 and data:
            i = rng.randrange(len(data))
            data[i] = rng.randrange(256)
        elif op < 0.8:
            data = data[:at]  # truncated (a writer killed mid-line)
        else:
            lines = bytes(data).splitlines(keepends=True) or [b""]
            line = rng.choice(lines)
            data[at:at] = line * rng.randint(2, 50)
    return bytes(data)


# --- targets: (seed inputs, run one case on its bytes in a fresh directory) ------------------------------------


def _spec_seeds() -> list[bytes]:
    root = Path(__file__).resolve().parents[1] / "examples"
    return [p.read_bytes() for p in sorted(root.glob("*.yaml"))]


def _spec_case(data: bytes, d: Path) -> None:
    from jobspec.spec.loader import load_spec

    (d / "spec.yaml").write_bytes(data)
    load_spec(d / "spec.yaml")


def _data_seeds() -> list[bytes]:
    chats = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
             for i in range(3)]  # fmt: skip
    texts = [{"text": f"row {i}"} for i in range(3)]
    return [b"".join(json.dumps(r).encode() + b"\n" for r in rows) for rows in (chats, texts)]


def _data_case(data: bytes, d: Path) -> None:
    from jobspec.spec.models import DataSpec
    from runner.data.records import read_records

    path = d / ("data.json" if data.lstrip()[:1] == b"[" else "data.jsonl")
    path.write_bytes(data)
    for _ in read_records(path, DataSpec(path=str(path))):
        pass


def _metrics_seeds() -> list[bytes]:
    rows = [
        {"kind": "plan", "tier": "fast", "micro_batch": 4, "grad_accum": 2, "world_size": 1, "seq_len": 64,
         "global_batch": 8, "precision": "fp32", "checkpointing": False, "estimated_bytes": 1000,
         "device": "cpu", "time": 1.0},
        *({"kind": "train", "step": s, "loss": 2.0 / s, "lr": 1e-3, "tokens_per_s": 100.0, "time": 1.0 + s,
           "tier": "fast", "micro_batch": 4, "peak_bytes": 2000} for s in range(1, 6)),
        {"kind": "eval", "step": 5, "loss": 1.5, "time": 7.0},
        {"kind": "summary", "steps": 5, "seconds": 6.0, "time": 8.0},
    ]  # fmt: skip
    return [b"".join(json.dumps(r).encode() + b"\n" for r in rows)]


def _metrics_case(data: bytes, d: Path) -> None:
    from jobspec.plan.calibration import read_run
    from jobspec.report import load_run

    (d / "metrics.jsonl").write_bytes(data)
    load_run(d)
    read_run(d)


def _manifest_seeds() -> list[bytes]:
    entry = {"size": 5, "crc32": "3610a686", "samples": []}
    return [json.dumps({"step": 3, "files": {"a.bin": entry}}).encode()]


def _manifest_case(data: bytes, d: Path) -> None:
    from runner.checkpoint import manifest

    ck = d / "step-3"
    ck.mkdir()
    (ck / "a.bin").write_bytes(b"hello")
    (ck / manifest.MANIFEST).write_bytes(data)
    problem = manifest.check(ck, 3, full=True)
    if problem is not None and not isinstance(problem, str):
        raise TypeError(f"manifest.check returned {type(problem).__name__}")


def _config_seeds() -> list[bytes]:
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 512, "intermediate_size": 128}  # fmt: skip
    return [json.dumps(cfg).encode(), json.dumps({"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 9}).encode()]


def _config_case(data: bytes, d: Path) -> None:
    from jobspec.catalog.model_config import read_config, shape_from_config

    (d / "config.json").write_bytes(data)
    shape_from_config(read_config(d))


# --- the shared directory: a data cache, its stamps, a stream index, a lease, a heartbeat announcement -------------


@functools.cache
def _template() -> dict[str, Any]:
    """One real cache entry, digest stamp and stream index, made once per process (the cases copy them): a source of
    40 chats, its cache root, its entry and its stream's index."""
    from jobspec.spec.models import DataSpec
    from runner.data.cache import cache_key
    from runner.data.dataset import encode_file
    from runner.data.stream import PositionIndex, SourceStream
    from runner.data.tokenizer import ByteTokenizer

    root = Path(tempfile.mkdtemp(prefix="jobspec-fuzz-template-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    source = root / "d.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"q{i} " + "w" * (i % 7), "response": f"a{i}"}) + "\n"
                              for i in range(40)))  # fmt: skip
    spec, cache = DataSpec(max_seq_len=32), root / "cache"
    encode_file(source, spec, ByteTokenizer(), cache_dir=cache)
    encode_file(source, spec, ByteTokenizer(), cache_dir=cache)  # VERIFIED written by the second read
    key = cache_key(source, spec, ByteTokenizer(), "data.path", ("train",), stamps=cache)
    streamed = DataSpec(max_seq_len=32, streaming=True, shuffle_buffer=0, packing=False)
    index = PositionIndex(root / "stream" / "fuzzindex.jsonl", write=True)
    stream = SourceStream(str(source), "data.path", streamed, ByteTokenizer(), 7, 0, index)
    samples = list(zip(range(25), stream.samples(0), strict=False))  # writes sample 0's entry
    for n in (8, 16, 24):  # more entries than the runner's INDEX_EVERY (256) gives: more for the cases to forge
        index.add(_position(n, samples[n][1]))
    return {"root": root, "source": source, "spec": spec, "streamed": streamed, "cache": cache,
            "entry": cache / key.digest, "stamp": next(cache.glob("source-*.stamp")), "index": index.path}  # fmt: skip


def _position(n: int, sample: Any) -> Any:
    """The index entry of sample `n` of an unpacked, unshuffled stream read from the start: record `n`, window 0."""
    from runner.data.stream import Position, token_digest

    where = Position(n, 0, 0, n, 0, 0)
    return Position(n, 0, 0, n, 0, 0, len(sample.ids), token_digest(sample.ids, where))


def _cache_seeds() -> list[bytes]:
    entry = _template()["entry"]
    return [(entry / "meta.json").read_bytes(), (entry / "verified.stamp").read_bytes()]


def _cache_case(data: bytes, d: Path) -> None:
    from runner.data.dataset import encode_file
    from runner.data.tokenizer import ByteTokenizer

    t = _template()
    shutil.copytree(t["cache"], d / "cache", symlinks=True)
    entry = d / "cache" / t["entry"].name
    name = "meta.json" if data.lstrip()[:1] == b"{" and b'"arrays"' in data else "verified.stamp"
    (entry / name).write_bytes(data)
    encode_file(t["source"], t["spec"], ByteTokenizer(), cache_dir=d / "cache")


def _stamp_seeds() -> list[bytes]:
    return [_template()["stamp"].read_bytes()]


def _stamp_case(data: bytes, d: Path) -> None:
    from runner.data.cache import cache_key
    from runner.data.tokenizer import ByteTokenizer

    t = _template()
    (d / t["stamp"].name).write_bytes(data)
    cache_key(t["source"], t["spec"], ByteTokenizer(), "data.path", ("train",), stamps=d)


def _index_seeds() -> list[bytes]:
    return [_template()["index"].read_bytes()]


def _index_case(data: bytes, d: Path) -> None:
    from runner.data.stream import PositionIndex, SourceStream
    from runner.data.tokenizer import ByteTokenizer

    t = _template()
    path = d / t["index"].name
    path.write_bytes(data)
    index = PositionIndex(path, write=False)
    stream = SourceStream(str(t["source"]), "data.path", t["streamed"], ByteTokenizer(), 7, 0, index)
    for _ in zip(range(2), stream.samples(20), strict=False):
        pass


def _lease_seeds() -> list[bytes]:
    import os
    import socket

    record = {"holder": "a" * 32, "job": "fuzz", "host": socket.gethostname(), "pid": os.getpid(), "pid_start": 1,
              "boot_id": "b", "pid_ns": "pid:[1]", "since": time.time() - 5, "heartbeat": time.time()}  # fmt: skip
    return [json.dumps(record, indent=1).encode(), json.dumps({**record, "pid": 1, "host": "elsewhere"}).encode()]


def _lease_case(data: bytes, d: Path) -> None:
    from runner.checkpoint import lease

    (d / lease.LEASE_FILE).write_bytes(data)
    lease.describe(lease.read_record(d / lease.LEASE_FILE))
    with contextlib.suppress(lease.Superseded, lease.LeaseLost):  # the ranks' answers to another holder
        lease.check_holder(d, "b" * 32, "fuzz")
    settle, lease.SETTLE_S = lease.SETTLE_S, 0.0  # an unreadable lease is read twice, a second apart: not here
    try:
        held = lease.Lease(d, "fuzz", timeout=60)
        held.acquire()  # LeaseHeld (exit 2) for a live holder, else taken over
        held.beat(force=True)
        held.release()
    finally:
        lease.SETTLE_S = settle


def _heartbeat_seeds() -> list[bytes]:
    from runner.process.heartbeat import Loss

    return [Loss("silent", 3, 12.5, time.time(), 0).to_json().encode(), Loss("self", 0, 61.0, 1.7e9, 0).to_json()
            .encode()]  # fmt: skip


def _heartbeat_case(data: bytes, d: Path) -> None:
    from runner.process.heartbeat import Loss

    loss = Loss.from_json(data)
    if not isinstance(loss.describe(), str):
        raise TypeError("Loss.describe did not return text")


def _json_seeds() -> list[bytes]:
    return [json.dumps({"step": 3, "files": {"a.bin": {"sha256": "ab", "size": 1}}, "s": 'q"u\\\\'}).encode(),
            json.dumps([[{"a": [1, "[{"]}]]).encode()]  # fmt: skip


def _json_case(data: bytes, d: Path) -> None:
    from jobspec.untrusted import json_loads

    with contextlib.suppress(ValueError):  # not JSON, or nested too deep: the reader's refusal
        json_loads(data[: 1 << 20])  # the size every caller bounds its reads to, about (a slow case is a hang)


TARGETS: dict[str, tuple[Callable[[], list[bytes]], Callable[[bytes, Path], None]]] = {
    "spec": (_spec_seeds, _spec_case),
    "data": (_data_seeds, _data_case),
    "metrics": (_metrics_seeds, _metrics_case),
    "manifest": (_manifest_seeds, _manifest_case),
    "config": (_config_seeds, _config_case),
    "cache": (_cache_seeds, _cache_case),
    "stamp": (_stamp_seeds, _stamp_case),
    "index": (_index_seeds, _index_case),
    "lease": (_lease_seeds, _lease_case),
    "heartbeat": (_heartbeat_seeds, _heartbeat_case),
    "json": (_json_seeds, _json_case),
}


def fuzz(target: str, seconds: float, seed: int, case_seconds: float, out: Path | None) -> Tally:
    """Run `target` on fresh mutations for `seconds`; the tally of cases, refusals and failures."""
    from jobspec.errors import JobspecError

    seeds, case = TARGETS[target]
    inputs, rng, tally = seeds(), random.Random(seed), Tally()
    previous = signal.signal(signal.SIGALRM, _alarm)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            data = mutate(rng, rng.choice(inputs))
            tally.cases += 1
            with tempfile.TemporaryDirectory(prefix="jobspec-fuzz-") as tmp:
                t0 = time.perf_counter()
                signal.setitimer(signal.ITIMER_REAL, case_seconds)
                try:
                    with contextlib.redirect_stderr(io.StringIO()):  # the readers' notes on skipped lines
                        case(data, Path(tmp))
                except JobspecError:
                    tally.refused += 1
                except Timeout:
                    tally.failures.append(_save(out, target, seed, tally.cases, data, f"over {case_seconds} s"))
                except Exception:  # the finding: anything but the project's own error
                    tally.failures.append(_save(out, target, seed, tally.cases, data, traceback.format_exc(limit=3)))
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                tally.slowest = max(tally.slowest, time.perf_counter() - t0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    return tally


def _save(out: Path | None, target: str, seed: int, n: int, data: bytes, why: str) -> str:
    head = why.strip().splitlines()[-1][:200]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{target}-seed{seed}-case{n}.bin").write_bytes(data)
        (out / f"{target}-seed{seed}-case{n}.txt").write_text(why)
    return f"case {n}: {head}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz_readers", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per target")
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--case-seconds", type=float, default=10.0, help="a case slower than this is a hang")
    parser.add_argument("--out", type=Path, default=Path("/tmp/jobspec-fuzz"), help="failing inputs go here")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the readers warn about every skipped line: thousands of cases' worth
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"seed {seed}, {args.seconds:g} s per target, a case over {args.case_seconds:g} s is a hang")
    failed = 0
    for target in args.targets.split(","):
        t0, c0 = time.perf_counter(), time.process_time()
        tally = fuzz(target, args.seconds, seed, args.case_seconds, args.out)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"{target:9} {tally.cases:6d} cases  {tally.refused:6d} refused (exit 2)  {len(tally.failures):3d} "
              f"failures  slowest {tally.slowest:.2f} s  ({wall:.1f} s wall, {cpu:.1f} s CPU)")  # fmt: skip
        for line in tally.failures[:10]:
            print(f"    {line}")
        failed += len(tally.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
