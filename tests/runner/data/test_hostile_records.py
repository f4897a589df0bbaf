"""Hostile data: records past the limits, files that are not files, huge rows and row groups.

Every case ends in the project's own error (exit 2) naming the file, its line or row and the limit, within
seconds and in bounded memory; never a traceback, a hang or gigabytes. The limits are the real ones
(runner/data/limits.py) except where a test lowers one to keep its file small, which it says.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobspec.errors import ConfigError
from jobspec.spec.models import DataSpec
from runner.data import files, limits, tables
from runner.data.dataset import encode_file, flatten, load_data, to_messages
from runner.data.records import read_json, read_jsonl, read_parquet, read_records
from runner.data.tokenizer import ByteTokenizer, load_tokenizer
from runner.data.tokens import StreamsBuilder
from tests.runner.train_helpers import ROOT, run_supervisor, save_test_tokenizer, tiny_spec, tiny_spec_dict, write_spec

GOOD = '{"prompt": "hello", "response": "world"}'
DEEP = r"nested more than 64 levels deep \(MAX_DEPTH"
# A field's JSON text -> the error its record gives. The record itself is level 1 of the nesting.
REFUSED = {
    "arrays 5000 deep": ("[" * 5000 + "]" * 5000, DEEP),
    "objects 5000 deep": ('{"a": ' * 5000 + "1" + "}" * 5000, DEEP),
    "lists 64 deep: one past the limit, well within Python's recursion": ("[" * 64 + "]" * 64, DEEP),
    "an integer of 5000 digits": ("9" * 5000, r"a number of 5,000 digits \(99999.*over the limit of 100 \(MAX_NUMBER"),
    "a negative integer of 101 digits": ("-" + "1" * 101, r"a number of 101 digits \(-1111"),
    "a float of 5000 digits": ("0." + "1" * 5000, r"a number of 5,000 digits"),
    "a huge float": ("9" * 4000 + ".5e99999", r"a number of 4,000 digits"),
    "an exponent of 400 digits": ("1e" + "9" * 400, r"a number of 400 digits"),
}
ACCEPTED = {
    "lists 63 deep: the limit": "[" * 63 + "]" * 63,
    "an integer of 100 digits": "-" + "9" * 100,
    "5000 digits in a string": '"' + "7" * 5000 + '"',
    "a float that overflows to inf": "1e999999",
    "NaN": "NaN",
    "many numbers, each short": "[" + ",".join(["123456789.5e-3"] * 2000) + "]",
}


def with_field(value: str) -> str:
    return '{"prompt": "a", "response": "b", "x": ' + value + "}"


def write_jsonl_lines(path: Path, third: str) -> Path:
    path.write_text("\n".join([GOOD, GOOD, third, GOOD]) + "\n")
    return path


def write_json_rows(path: Path, third: str, wrap: bool = False) -> Path:
    array = "[\n" + ",\n".join([GOOD, GOOD, third, GOOD]) + "\n]"
    path.write_text('{"data": ' + array + "}" if wrap else array)
    return path


def encode(path: Path, **data) -> int:
    return len(encode_file(path, DataSpec(**data), ByteTokenizer()))


@contextlib.contextmanager
def deadline(seconds: float):
    """A blocked open or read (a FIFO, /dev/zero) fails the test instead of hanging it."""

    def fire(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s: the reader hangs")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- JSON records: nesting and numbers --------------------------------------------------------------------


@pytest.mark.parametrize("shape", sorted(REFUSED))
def test_a_record_past_a_limit_is_refused_naming_its_line_or_row_and_the_limit(tmp_path, shape):
    value, error = REFUSED[shape]
    jsonl = write_jsonl_lines(tmp_path / "d.jsonl", with_field(value))
    with pytest.raises(ConfigError, match=rf"d.jsonl:3: {error}") as err:
        encode(jsonl)
    assert err.value.exit_code == 2
    for wrap in (False, True):
        array = write_json_rows(tmp_path / "d.json", with_field(value), wrap)
        with pytest.raises(ConfigError, match=rf"d.json: row 2: {error}"):
            encode(array)


@pytest.mark.parametrize("shape", sorted(ACCEPTED))
def test_records_within_the_limits_load_in_every_format(tmp_path, shape):
    record = with_field(ACCEPTED[shape])
    assert encode(write_jsonl_lines(tmp_path / "d.jsonl", record)) == 4
    assert encode(write_json_rows(tmp_path / "d.json", record)) == 4
    assert encode(write_json_rows(tmp_path / "w.json", record, wrap=True)) == 4


def test_a_deep_top_level_document_and_a_deep_key_are_refused(tmp_path):
    path = tmp_path / "d.json"
    path.write_text("[" * 5000 + "]" * 5000)  # the array of records itself: row 0 is the deep one
    with pytest.raises(ConfigError, match=rf"d.json: row 0: {DEEP}"):
        encode(path)
    path.write_text('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}")  # one record, not an array: refused whole
    with pytest.raises(ConfigError, match=rf"d.json: {DEEP}"):
        encode(path)


def test_json_array_syntax_errors_name_the_line(tmp_path):
    path = tmp_path / "d.json"
    cases = {
        "[\n" + GOOD + ",\n" + GOOD + ",\n]": r"d.json:3: not valid JSON \(Illegal trailing comma",
        "[\n" + GOOD + "\n" + GOOD + "]": r"d.json:3: not valid JSON \(Expecting ',' delimiter",
        "[\n" + GOOD + "]\n]": r"d.json:3: not valid JSON \(Extra data",
        '{"data": [' + GOOD + "]\n, 3": r"d.json: expected a JSON array of records, or an object whose only key",
        '{"data": [' + GOOD + "]": r"d.json:1: not valid JSON \(Expecting ',' delimiter",
        "[" + GOOD + ", ": r"d.json:1: not valid JSON \(Expecting value",
    }
    for text, error in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError, match=error):
            encode(path)


# --- sizes: lines, records, .json files ---------------------------------------------------------------------


def test_a_100_mb_line_is_refused_naming_its_line_and_the_limit_without_reading_it_whole(tmp_path):
    path = tmp_path / "long.jsonl"
    with path.open("w") as f:
        f.write(GOOD + "\n" + '{"prompt": "' + "a" * 100_000_000 + '", "response": "b"}\n' + GOOD + "\n")
    with pytest.raises(
        ConfigError,
        match=r"long.jsonl:2: a line longer than that: over the limit of 33,554,432 bytes \(32 MiB\) a line",
    ):
        encode(path)


def test_the_line_limit_counts_the_line_without_its_newline(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "MAX_LINE_BYTES", 100)  # small, to keep the file small
    fits = '{"prompt": "a", "response": "' + "b" * 60 + '"}'
    fits += " " * (100 - len(fits))
    path = tmp_path / "d.jsonl"
    path.write_text(fits + "\n" + fits)  # 100 bytes, then the same without its newline at the end of the file
    assert encode(path) == 2
    path.write_text(fits + " \n")
    with pytest.raises(
        ConfigError, match=r"d.jsonl:1: a line longer than that: over the limit of 100 bytes a line \(MAX_LINE_BYTES"
    ):
        encode(path)


def test_a_json_record_over_the_limit_is_refused_by_its_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "MAX_RECORD_BYTES", 4096)  # the real one is 32 MiB
    path = write_json_rows(tmp_path / "d.json", '{"prompt": "' + "a" * 5000 + '", "response": "b"}')
    with pytest.raises(ConfigError, match=r"d.json: row 2: a record of 5,0\d\d characters .*: over the limit of 4,096"):
        encode(path)
    # 1,500 characters but 4,500 bytes of UTF-8: the limit is in bytes
    path.write_text(json.dumps([{"prompt": "✓" * 1500, "response": "b"}], ensure_ascii=False))
    with pytest.raises(ConfigError, match=r"d.json: row 0: a record of 4,5\d\d bytes"):
        encode(path)


def test_a_json_file_over_its_limit_is_refused_with_the_jsonl_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "MAX_JSON_FILE_BYTES", 1000)  # the real one is 256 MiB
    path = tmp_path / "d.json"
    path.write_text(json.dumps([json.loads(GOOD)] * 40))
    with pytest.raises(
        ConfigError, match=r"d.json: a .json file of 1,\d{3} bytes, over the limit of 1,000 bytes .*jq -c"
    ):
        encode(path)


# --- Parquet and datasets: rows and row groups -----------------------------------------------------------


def write_parquet(path: Path, prompts: list[str], row_group_size: int | None = None) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"prompt": prompts, "response": ["r"] * len(prompts)})
    pq.write_table(table, path, row_group_size=row_group_size or len(prompts))
    return path


def test_a_row_group_holding_a_row_over_the_limit_is_refused_from_the_footer(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", ["b", "a" * 40_000_000, "c"], row_group_size=1)
    with pytest.raises(ConfigError, match=r"p.parquet: row 1 \(row group 1\): 40,000,\d+ bytes .* uncompressed in 1"):
        encode(path)
    path = write_parquet(tmp_path / "p.parquet", ["a" * 70_000_000, "b"])  # 35 MB a row on average
    with pytest.raises(ConfigError, match=r"p.parquet: rows 0-1 \(row group 0\): .* so at least one row is larger"):
        encode(path)


def test_a_large_row_among_small_ones_is_refused_naming_its_row(tmp_path):
    prompts = [f"p{i}" for i in range(5000)]
    prompts[3456] = "a" * 40_000_000
    path = write_parquet(tmp_path / "p.parquet", prompts, row_group_size=2000)  # in the second row group
    with pytest.raises(ConfigError, match=r"p.parquet: row 3456: a record of 40,000,\d{3} bytes \(38.1 MiB\): over"):
        encode(path)


def test_a_datasets_row_over_the_limit_is_refused_naming_its_row(tmp_path):
    datasets = pytest.importorskip("datasets")
    prompts = ["p"] * 100 + ["a" * 40_000_000]
    datasets.Dataset.from_dict({"prompt": prompts, "response": ["r"] * 101}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ConfigError, match=r"ds: row 100: a record of 40,000,\d{3} bytes"):
        encode(tmp_path / "ds")


def test_an_arrow_schema_nested_past_the_limit_is_refused_and_one_within_it_reads(tmp_path):
    pa = pytest.importorskip("pyarrow")
    deep = pa.int64()
    for _ in range(64):  # the row is level 1: 64 lists reach level 65
        deep = pa.list_(deep)
    with pytest.raises(ConfigError, match=rf"w: the schema {DEEP}"):
        tables.check_schema(pa.schema([("x", deep)]), "w")
    tables.check_schema(pa.schema([("x", deep.value_type)]), "w")
    nested = pa.array([[[[1]]], [[[2, 3]]]])
    path = tmp_path / "n.parquet"
    pytest.importorskip("pyarrow.parquet").write_table(
        pa.table({"prompt": ["a", "b"], "response": ["c", "d"], "x": nested}), path
    )
    assert [r["x"] for _, r in read_records(path, DataSpec())] == [[[[1]]], [[[2, 3]]]]


def test_a_large_row_group_is_read_in_bounded_memory(tmp_path):
    """400k rows in one row group (44 MB of text): the reader's peak grows by a batch, not by the row group.
    Converted at once the rows would take ~400 MB of Python objects."""
    n = 400_000
    write_parquet(tmp_path / "big.parquet", [f"question {i} about something long enough to matter" for i in range(n)])
    script = (
        "import json, resource, sys\n"
        "import pyarrow.parquet\n"
        "from jobspec.spec.models import DataSpec\n"
        "from runner.data.records import read_records\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "n = sum(1 for _ in read_records(sys.argv[1], DataSpec()))\n"
        "print(json.dumps([n, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "big.parquet")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows, grew_mb = json.loads(done.stdout)
    assert rows == n and grew_mb < 150, grew_mb


# --- files that are not regular files ------------------------------------------------------------------


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _link_to_fifo(path: Path) -> None:
    os.mkfifo(path.with_name("real-fifo"))
    os.symlink(path.with_name("real-fifo"), path)


NOT_FILES = {
    "a link to /dev/zero": lambda p: os.symlink("/dev/zero", p),
    "a link to /dev/null": lambda p: os.symlink("/dev/null", p),
    "a FIFO": _fifo,
    "a link to a FIFO": _link_to_fifo,
}
READERS = {
    ".jsonl": lambda p: read_jsonl(p),
    ".json": lambda p: read_json(p, DataSpec()),
    ".parquet": lambda p: read_parquet(p, "data.path"),
}


@pytest.mark.parametrize("suffix", sorted(READERS))
@pytest.mark.parametrize("kind", sorted(NOT_FILES))
def test_a_data_file_that_is_not_a_regular_file_is_refused_without_reading(tmp_path, kind, suffix):
    path = tmp_path / f"data{suffix}"
    NOT_FILES[kind](path)
    with deadline(10):
        with pytest.raises(ConfigError, match=rf"data{suffix}: not a regular file"):
            encode(path)
        # the reader's own check, on the open descriptor (the name could be swapped after the first)
        if suffix == ".parquet":
            pytest.importorskip("pyarrow")
        with pytest.raises(ConfigError, match=rf"data{suffix} is (a FIFO|a character device).*not a regular file"):
            list(READERS[suffix](path))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_reads_stop_at_the_size_the_file_had_when_opened(tmp_path):
    """/proc files are regular files of size 0 that read as text: read nothing, not without end."""
    os.symlink("/proc/self/status", tmp_path / "p.jsonl")
    with deadline(10), pytest.raises(ConfigError, match=r"p.jsonl: no records"):
        encode(tmp_path / "p.jsonl")


def saved_dataset(path: Path) -> tuple[Path, str]:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"prompt": ["hello"] * 4, "response": ["world"] * 4}).save_to_disk(str(path))
    return path, json.loads((path / "state.json").read_text())["_data_files"][0]["filename"]


def _swap(path: Path, make) -> None:
    path.unlink()
    make(path)


def _edit_state(ds: Path, **changes) -> None:
    state = json.loads((ds / "state.json").read_text())
    (ds / "state.json").write_text(json.dumps({**state, **changes}))


DATASET_ATTACKS = {
    "its Arrow file a FIFO": (lambda ds, arrow: _swap(ds / arrow, _fifo), r"\.arrow is a FIFO"),
    "its state.json a link to /dev/zero": (
        lambda ds, arrow: _swap(ds / "state.json", lambda p: os.symlink("/dev/zero", p)),
        r"state.json links to /dev/zero, outside",
    ),
    "its Arrow file a link out": (
        lambda ds, arrow: _swap(ds / arrow, lambda p: os.symlink(ds.parent / "good" / arrow, p)),
        r"\.arrow links to .*good.*, outside",
    ),
    "a file name that climbs out": (
        lambda ds, arrow: _edit_state(ds, _data_files=[{"filename": f"../good/{arrow}"}]),
        r"good/data.*links to .*, outside",
    ),
    "a state.json nested 900 deep": (lambda ds, arrow: _edit_state(ds, x=json.loads("[" * 900 + "]" * 900)), DEEP),
    "a state.json without its file list": (lambda ds, arrow: _edit_state(ds, _data_files=3), r'expected "_data_files"'),
}


@pytest.mark.parametrize("attack", sorted(DATASET_ATTACKS))
def test_every_file_of_a_datasets_directory_is_a_regular_file_inside_it(tmp_path, attack):
    saved_dataset(tmp_path / "good")
    ds, arrow = saved_dataset(tmp_path / "ds")
    change, error = DATASET_ATTACKS[attack]
    change(ds, arrow)
    with deadline(20), pytest.raises(ConfigError, match=error):
        encode(ds)
    assert encode(tmp_path / "good") == 4


def test_datasets_metadata_is_read_within_its_limit(tmp_path, monkeypatch):
    ds, _ = saved_dataset(tmp_path / "ds")
    monkeypatch.setattr(files, "MAX_METADATA_BYTES", 100)  # the real one is 16 MiB
    with pytest.raises(ConfigError, match=r"dataset_info.json is \d+ bytes, more than the 100 allowed"):
        encode(ds)


def test_a_dataset_dict_split_outside_the_directory_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_dict({"prompt": ["a"], "response": ["b"]})
    datasets.DatasetDict({"train": train}).save_to_disk(str(tmp_path / "dd"))
    saved_dataset(tmp_path / "other")
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "../other"]}))
    with pytest.raises(ConfigError, match=r"other/dataset_info.json links to .*, outside .*dd"):
        encode(tmp_path / "dd")


# --- text that reaches the tokenizer --------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_test_tokenizer(path)
    return load_tokenizer(str(path), 1000)


def test_a_lone_surrogate_is_refused_naming_the_line_with_either_tokenizer(tmp_path, hf_tokenizer):
    path = tmp_path / "s.jsonl"
    path.write_text(GOOD + '\n{"prompt": "a\\ud800b", "response": "c"}\n')
    for tok in (ByteTokenizer(), hf_tokenizer):  # transformers' tokenizers raised a TypeError (a traceback)
        with pytest.raises(
            ConfigError, match=r"s.jsonl:2: message 0: a lone UTF-16 surrogate \('\\ud800' at character 1"
        ):
            encode_file(path, DataSpec(), tok)
    path.write_text(GOOD + '\n{"prompt": "a\\ud83d\\ude00b", "response": "c"}\n')  # a full pair is one character
    assert len(encode_file(path, DataSpec(), hf_tokenizer)) == 2


PIECES = ["a", "hello", " ", "    ", "é", "✓", "\n", "😀", "<|end|>"]  # spaces merge; <|end|> is a special token
long_text = st.lists(st.sampled_from(PIECES), max_size=400).map("".join)
chat_record = st.lists(
    st.tuples(st.sampled_from(["system", "user", "assistant"]), long_text), min_size=1, max_size=60
).map(lambda turns: {"messages": [{"role": r, "content": c} for r, c in turns]})
pair_record = st.tuples(long_text, long_text).map(lambda pr: {"prompt": pr[0] * 20, "response": pr[1] * 20})


@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(records=st.one_of(st.lists(chat_record, min_size=1, max_size=4), st.lists(pair_record, min_size=1, max_size=4)),
       max_seq_len=st.sampled_from([16, 40]))  # fmt: skip
def test_clipping_before_tokenizing_changes_no_row(tmp_path, hf_tokenizer, records, max_seq_len):
    """The text and messages clipped away (past what max_seq_len can reach) would have been truncated anyway."""
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    spec = DataSpec(max_seq_len=max_seq_len)
    fmt = "messages" if "messages" in records[0] else "prompt_response"
    for tok in (ByteTokenizer(), hf_tokenizer):
        got = encode_file(path, spec, tok)
        whole = [flatten(tok.render(to_messages(r, fmt, spec)), max_seq_len + 1) for r in records]
        assert len(got) == len(whole)
        for (ids, flags), (ref_ids, ref_flags) in zip(got, whole, strict=True):
            assert np.array_equal(ids, ref_ids) and np.array_equal(flags, ref_flags)


def test_a_30_mb_text_is_tokenized_in_bounded_memory(tmp_path):
    """Tokenized whole, the 30 MB prompt took ~650 MB (a list of 30M ints, then an int64 array of them)."""
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "p" * 30_000_000, "response": "r"}) + "\n" + GOOD + "\n")
    script = (
        "import json, logging, resource, sys\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from jobspec.spec.models import DataSpec\n"
        "from runner.data.dataset import encode_file\n"
        "from runner.data.tokenizer import ByteTokenizer\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "streams = encode_file(sys.argv[1], DataSpec(max_seq_len=64), ByteTokenizer())\n"
        "print(json.dumps([len(streams), int(streams.lengths[0]), "
        "(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    records, first_len, grew_mb = json.loads(done.stdout)
    assert records == 2 and first_len == 65  # truncated to max_seq_len + 1 tokens, as before
    assert grew_mb < 300, grew_mb  # the line as bytes, text and parsed string (~90 MB), not its tokens
    assert "1 record(s) clipped before tokenizing" in done.stderr and "longest 30000000" in done.stderr


hostile_json = st.sampled_from(
    [*(v for v, _ in REFUSED.values()), *ACCEPTED.values(), '"\\ud800"', '"\\udfff x"', "-0", "1E400", '"\\u0000"']
)


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.tuples(st.sampled_from(["prompt", "response", "messages", "x"]), hostile_json), max_size=4),
    as_array=st.booleans(),
)
def test_hostile_fields_end_in_a_config_error_or_rows(tmp_path, hf_tokenizer, parts, as_array):
    record = (
        "{"
        + ", ".join([f'"{k}": {v}' for k, v in parts] + ['"prompt": "p"', '"response": "r"'][: 2 - len(parts) % 2])
        + "}"
    )
    path = write_json_rows(tmp_path / "h.json", record) if as_array else write_jsonl_lines(tmp_path / "h.jsonl", record)
    for tok in (ByteTokenizer(), hf_tokenizer):
        with contextlib.suppress(ConfigError):
            encode_file(path, DataSpec(max_seq_len=32), tok)


# --- the tokenized store ----------------------------------------------------------------------------------


def test_token_rows_take_about_three_bytes_a_token_and_train_and_eval_share_them(tmp_path):
    data = load_data(tiny_spec(tmp_path, data={"eval_fraction": 0.1}), ByteTokenizer())
    store = data.train.streams
    assert data.eval.streams is store  # the held-out rows are indices, not a copy
    tokens, records = len(store.ids), len(store.bounds) - 1
    assert store.ids.dtype == np.uint16 and store.flags.dtype == bool
    assert store.ids.nbytes + store.flags.nbytes + store.bounds.nbytes + store.trainable.nbytes <= 3 * tokens + 9 * (
        records + 1
    )
    assert len(data.train) + len(data.eval) == records == 4000


def test_the_store_takes_the_id_type_of_the_vocabulary_and_refuses_ids_past_it():
    assert StreamsBuilder(70_000).dtype == np.int32
    builder = StreamsBuilder(300)
    builder.add(np.array([1, 70_000]), np.array([False, True]))
    with pytest.raises(ConfigError, match=r"token id 70000, outside its vocabulary of 300"):
        builder.build()


# --- end to end -------------------------------------------------------------------------------------------


def test_the_runner_exits_2_on_a_hostile_record_without_a_traceback(tmp_path):
    path = write_jsonl_lines(tmp_path / "deep.jsonl", with_field("[" * 5000 + "]" * 5000))
    spec = write_spec(tmp_path / "spec.yaml", tiny_spec_dict(tmp_path / "run", data={"path": str(path)}))
    done = run_supervisor([str(spec)])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    assert "deep.jsonl:3: nested more than 64 levels deep (MAX_DEPTH" in done.stderr


def test_a_message_carrying_the_key_the_runner_reserves_is_refused_naming_the_line(tmp_path):
    """`jobspec_prompt_turn` marks the replies of a preference pair's prompt as never trained on; from the user's data
    it silently untrained the marked replies (all marked: exit 2 blaming global_batch). Refused with file and line, in
    SFT messages and in a pair's dialogues alike."""
    from runner.data.preference import load_preference

    sft = tmp_path / "sft.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    marked = [chat[0], {**chat[1], "jobspec_prompt_turn": True}]
    sft.write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"messages": marked}) + "\n")
    with pytest.raises(ConfigError, match=r"sft.jsonl:2: .*'jobspec_prompt_turn', which jobspec reserves"):
        encode_file(sft, DataSpec(), ByteTokenizer())
    pairs = tmp_path / "pairs.jsonl"
    turn = {"role": "assistant", "content": "earlier", "jobspec_prompt_turn": True}
    pairs.write_text(json.dumps({"prompt": [{"role": "user", "content": "q"}, turn, {"role": "user", "content": "r"}],
                                 "chosen": [{"role": "assistant", "content": "a"}],
                                 "rejected": [{"role": "assistant", "content": "b"}]}) + "\n")  # fmt: skip
    training = {"objective": "dpo", "global_batch": 1, "steps": 1, "warmup_steps": 0}
    spec = tiny_spec(tmp_path / "run", data={"path": str(pairs)}, training=training)
    with pytest.raises(ConfigError, match=r"pairs.jsonl:1: .*'jobspec_prompt_turn', which jobspec reserves"):
        load_preference(spec, ByteTokenizer())
