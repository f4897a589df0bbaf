"""Data formats: JSONL, JSON, Parquet and `datasets` directories give the same token rows; bad input names its place."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobspec.errors import ConfigError
from jobspec.spec.models import DataSpec
from runner.data.dataset import Row, encode_file, load_data
from runner.data.records import read_records
from runner.data.tokenizer import ByteTokenizer
from tests.runner.train_helpers import ROOT, timeout_s, tiny_spec, write_jsonl

PROMPT_RESPONSE = [{"prompt": f"question {i} é ✓", "response": f"answer {i}" * (i % 3 + 1)} for i in range(7)] + [
    {"prompt": "with an extra column", "response": "kept", "source": "web"}
]
CHAT = [
    {
        "messages": [
            *([{"role": "system", "content": "be brief"}] if i % 2 else []),
            {"role": "user", "content": f"hi {i} ü"},
            {"role": "assistant", "content": f"yo {i}", **({"name": "bot"} if i == 3 else {})},
        ]
    }
    for i in range(8)
]
LAYOUTS = {"prompt_response": PROMPT_RESPONSE, "messages": CHAT}


def write_json(path: Path, records: list[dict], wrap: bool = False) -> Path:
    path.write_text(json.dumps({"data": records} if wrap else records, ensure_ascii=False, indent=1))
    return path


def arrow_table(records: list[dict]):  # -> pyarrow.Table
    """Columns from every record's keys (`Table.from_pylist` and `Dataset.from_list` take the first's only)."""
    pa = pytest.importorskip("pyarrow")
    return pa.Table.from_struct_array(pa.array(records))


def write_parquet(path: Path, records: list[dict]) -> Path:
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(arrow_table(records), path, row_group_size=3)  # several row groups and batches
    return path


def save_dataset(path: Path, records: list[dict], split: str | None = None) -> Path:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(arrow_table(records).to_pydict())
    (datasets.DatasetDict({split: ds}) if split else ds).save_to_disk(str(path))
    return path


WRITERS = {
    "json": lambda d, r: write_json(d / "d.json", r),
    "json_wrapped": lambda d, r: write_json(d / "d.json", r, wrap=True),
    "parquet": lambda d, r: write_parquet(d / "d.parquet", r),
    "dataset": lambda d, r: save_dataset(d / "ds", r),
    "dataset_dict": lambda d, r: save_dataset(d / "dd", r, "train"),
}


def same_rows(a: list[Row], b: list[Row]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(xa, xb) and np.array_equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True)
    )


def load(tmp_path: Path, **data: Any):
    spec = tiny_spec(tmp_path, data={"max_seq_len": 64, "eval_fraction": 0.25, **data})
    return load_data(spec, ByteTokenizer())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_every_format_gives_the_rows_of_the_same_jsonl(tmp_path, kind, layout):
    records = LAYOUTS[layout]
    expected = load(tmp_path, path=str(write_jsonl(tmp_path / "d.jsonl", records)))
    path = WRITERS[kind](tmp_path, records)
    got = load(tmp_path, path=str(path))
    # the records themselves: plain dicts and lists, no nulls for the keys a record lacks
    assert [record for _, record in read_records(path, DataSpec())] == records
    assert len(expected.train) == 6 and len(expected.eval) == 2
    assert same_rows(got.train, expected.train) and same_rows(got.eval, expected.eval)


def test_a_dataset_dict_gives_train_to_path_and_validation_to_eval_path(tmp_path):
    datasets = pytest.importorskip("datasets")
    train, held = CHAT[:6], CHAT[6:]
    expected = load(
        tmp_path,
        path=str(write_jsonl(tmp_path / "train.jsonl", train)),
        eval_path=str(write_jsonl(tmp_path / "eval.jsonl", held)),
    )
    splits = {"train": datasets.Dataset.from_list(train), "validation": datasets.Dataset.from_list(held)}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    got = load(tmp_path, path=str(tmp_path / "dd"), eval_path=str(tmp_path / "dd"))
    assert same_rows(got.train, expected.train) and same_rows(got.eval, expected.eval)
    # eval_path may be any format, whatever data.path is
    mixed = load(tmp_path, path=str(tmp_path / "dd"), eval_path=str(write_parquet(tmp_path / "e.parquet", held)))
    assert same_rows(mixed.eval, expected.eval)


def test_a_dataset_dict_without_the_split_names_the_splits_it_has(tmp_path):
    path = save_dataset(tmp_path / "dd", PROMPT_RESPONSE, split="validation")
    with pytest.raises(ConfigError, match=r"data.path .*dd: no 'train' split; it has \['validation'\]"):
        encode_file(path, DataSpec(), ByteTokenizer())


def test_datasets_sequence_of_dicts_storage_reads_as_a_list_of_messages(tmp_path):
    """`datasets` stores a Sequence of dicts as a struct of lists: {role: [...], content: [...]}."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    chat = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(3)
    ]
    columns = [
        {"role": [m["role"] for m in r["messages"]], "content": [m["content"] for m in r["messages"]]} for r in chat
    ]
    pq.write_table(pa.table({"messages": pa.array(columns)}), tmp_path / "s.parquet")
    spec, tok = DataSpec(), ByteTokenizer()
    expected = encode_file(write_jsonl(tmp_path / "s.jsonl", chat), spec, tok)
    got = encode_file(tmp_path / "s.parquet", spec, tok)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(got, expected, strict=True))


def test_a_bad_utf8_byte_names_its_line_and_column(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = b'{"prompt": "a", "response": "b"}\r\n'
    path.write_bytes(good * 2 + b'{"prompt": "a\xffb", "response": "x"}\n' + good)
    with pytest.raises(ConfigError, match=r"bad.jsonl:3: not valid UTF-8 \(byte 0xff at column 14\)"):
        encode_file(path, DataSpec(), ByteTokenizer())
    path.write_bytes(good * 2)  # CRLF line ends read fine
    assert len(encode_file(path, DataSpec(), ByteTokenizer())) == 2
    array = tmp_path / "bad.json"
    array.write_bytes(b'[\n {"prompt": "a", "response": "b"},\n {"prompt": "\xc3(", "response": "b"}\n]')
    with pytest.raises(ConfigError, match=r"bad.json:3: not valid UTF-8 \(byte 0xc3 at column 14\)"):
        encode_file(array, DataSpec(), ByteTokenizer())


def test_lines_split_only_on_newline(tmp_path):
    """U+2028 and U+0085 are line breaks to str.splitlines but legal inside a JSON string."""
    records = [{"prompt": "a\u2028b\x85c", "response": "d\u2029e"}]
    path = tmp_path / "u.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(records[0], ensure_ascii=False).encode() + b"\n")  # with a BOM
    [(ids, _)] = encode_file(path, DataSpec(), ByteTokenizer())
    assert ByteTokenizer().decode(ids) == "a\u2028b\x85cd\u2029e"


def test_parquet_errors_name_the_row_and_the_field(tmp_path):
    tok = ByteTokenizer()
    rows = [{"prompt": "a", "response": "b"}] * 2 + [{"prompt": "a", "response": None}]
    path = write_parquet(tmp_path / "p.parquet", rows)
    with pytest.raises(ConfigError, match=r"p.parquet: row 2: 'response' is missing: 'prompt' and 'response' must"):
        encode_file(path, DataSpec(), tok)
    no_column = write_parquet(tmp_path / "q.parquet", [{"prompt": "a", "answer": "b"}])
    with pytest.raises(ConfigError, match=r"q.parquet: row 0: 'response' is missing"):
        encode_file(no_column, DataSpec(format="prompt_response"), tok)
    with pytest.raises(ConfigError, match=r"q.parquet: row 0: cannot tell the record format"):
        encode_file(no_column, DataSpec(), tok)
    assert len(encode_file(no_column, DataSpec(response_field="answer"), tok)) == 1
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("{}")
    with pytest.raises(ConfigError, match=r"x.parquet: not a readable Parquet file"):
        encode_file(not_parquet, DataSpec(), tok)


def test_json_layouts_and_errors(tmp_path):
    tok = ByteTokenizer()
    path = tmp_path / "j.json"
    cases = {
        '{"a": [], "b": []}': r"j.json: expected a JSON array of records.*got dict",
        '{"messages": [{"role": "user", "content": "x"}]}': r"j.json: expected a JSON array.*got one record",
        '[{"prompt": "a", "response": "b"}, 3]': r"j.json: row 1: expected a JSON object, got int",
        '[{"prompt": "a", "response": "b"},\n {"prompt": }]': r"j.json:2: not valid JSON \(Expecting value at column",
        "[]": r"data.path .*j.json: no records",
    }
    for text, error in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError, match=error):
            encode_file(path, DataSpec(), tok)


def test_unknown_suffix_and_non_files_say_what_is_supported(tmp_path):
    tok = ByteTokenizer()
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,response\na,b\n")
    with pytest.raises(ConfigError, match=r"data.path .*d.csv: unknown data format '.csv'; supported: .jsonl"):
        encode_file(csv, DataSpec(), tok)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"data.eval_path .*empty: a directory without a datasets save_to_disk"):
        encode_file(tmp_path / "empty", DataSpec(), tok, "data.eval_path")
    with pytest.raises(ConfigError, match=r"missing.jsonl: no such file or directory"):
        encode_file(tmp_path / "missing.jsonl", DataSpec(), tok)
    if hasattr(os, "mkfifo"):  # opening a FIFO would block until a writer comes: it must be refused first
        os.mkfifo(tmp_path / "pipe.jsonl")
        with pytest.raises(ConfigError, match=r"pipe.jsonl: not a regular file"):
            encode_file(tmp_path / "pipe.jsonl", DataSpec(), tok)


@pytest.mark.parametrize(
    ("modules", "writer", "error"),
    [
        (
            ("pyarrow", "pyarrow.parquet"),
            "parquet",
            r"is a Parquet file: install pyarrow \(pip install 'jobspec-k8s\[data\]'\)",
        ),
        (("datasets",), "dataset", r"is a datasets directory \(save_to_disk\): install datasets \(pip install"),
    ],
)
def test_a_missing_optional_package_is_a_config_error(tmp_path, monkeypatch, modules, writer, error):
    path = WRITERS[writer](tmp_path, PROMPT_RESPONSE)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    with pytest.raises(ConfigError, match=rf"data.path .*{path.name} {error}"):
        encode_file(path, DataSpec(), ByteTokenizer())


def test_a_hub_id_without_datasets_installed_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match=r"data.path 'org/name' is a Hugging Face hub dataset id .*install datasets"):
        encode_file("org/name", DataSpec(), ByteTokenizer())


def test_a_hub_id_offline_fails_fast_with_a_config_error(tmp_path):
    pytest.importorskip("datasets")
    script = (
        "import sys\n"
        "from jobspec.errors import ConfigError\n"
        "from jobspec.spec.models import DataSpec\n"
        "from runner.data.records import read_records\n"
        "try:\n"
        "    read_records('jobspec-test/no-such-dataset', DataSpec())\n"
        "except ConfigError as err:\n"
        "    print(err)\n"
        "    sys.exit(2)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s()
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stdout.startswith(
        "data.path 'jobspec-test/no-such-dataset' is not a local file or directory, and loading it as a "
        "Hugging Face hub dataset failed"
    )


record_text = st.text(max_size=40)
prompt_response = st.fixed_dictionaries({"prompt": record_text, "response": record_text})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": record_text})
chat = st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=4)})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.lists(prompt_response, min_size=1, max_size=6), st.lists(chat, min_size=1, max_size=6)))
def test_jsonl_json_and_parquet_give_the_same_rows(records):
    spec, tok = DataSpec(max_seq_len=32), ByteTokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        jsonl = d / "d.jsonl"  # raw UTF-8, so U+2028 and friends appear unescaped inside lines
        jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        expected = encode_file(jsonl, spec, tok)
        for path in (write_json(d / "d.json", records), write_parquet(d / "d.parquet", records)):
            got = encode_file(path, spec, tok)
            assert same_rows(got, expected), path.name
