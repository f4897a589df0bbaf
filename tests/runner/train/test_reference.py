"""DPO's reference pass: dealt over the ranks (each record scored once, every rank as many forwards), keyed by the
weights themselves, and signed like the rest of the shared directory when a key is set (runner/train/reference.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from jobspec.contract import EXIT_OK
from jobspec.shared_dir import signing
from jobspec.spec.models import JobSpec
from runner.train import reference
from tests.runner.train.test_dpo import dpo, text_pairs
from tests.runner.train_helpers import run_supervisor, train_in_process, write_jsonl, write_spec

KEY = "k" * 64


@pytest.mark.parametrize("n, world", [(7, 2), (8, 2), (5, 3), (1, 2), (0, 2)])
def test_the_records_are_dealt_once_and_every_rank_runs_as_many_forwards(n, world):
    records = list(range(10, 10 + n))
    shares = [reference.share(records, r, world) for r in range(world)]
    assert sorted(k for mine, _ in shares for k in mine) == records  # each record on exactly one rank
    assert len({len(mine) + len(pad) for mine, pad in shares}) == 1  # as many forwards on every rank
    assert all(set(pad) <= set(records) for _, pad in shares)


def test_two_ranks_share_the_pass_and_store_what_one_rank_computes(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", text_pairs(12))
    one = dpo(tmp_path / "one", data, cache=str(tmp_path / "c1"), steps=1, eval_every=None)
    assert train_in_process(one)[0] == EXIT_OK
    two = dpo(tmp_path / "two", data, cache=str(tmp_path / "c2"), steps=1, eval_every=None)
    spec = write_spec(tmp_path / "two.yaml", two.model_dump(mode="json", exclude_unset=True))
    result = run_supervisor([str(spec), "--nproc", "2"], timeout=600)
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    assert "24 records scored by the starting model" in result.stderr and "(12 on this rank of 2)" in result.stderr
    (a,) = (tmp_path / "c1").glob("*.reference-*.npy")
    (b,) = (tmp_path / "c2").glob("*.reference-*.npy")
    assert a.name == b.name  # the same data and model: the same entry
    np.testing.assert_allclose(np.load(b), np.load(a), rtol=0, atol=1e-5)
    assert (np.load(b) < 0).all()  # every record scored (a record left out would be 0)


def test_new_weights_at_the_same_model_path_are_another_reference(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "model"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=64)).save_pretrained(folder)
    spec = JobSpec.model_validate({**dpo(tmp_path, tmp_path / "p.jsonl").model_dump(mode="json"),
                                   "model": {"path": str(folder)}})  # fmt: skip
    first = reference.model_key(spec, "fp32", None)
    assert reference.model_key(spec, "fp32", None) == first
    torch.manual_seed(1)  # a fine-tune written over the same directory: same config, same names, same sizes
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=64)).save_pretrained(folder)
    assert reference.model_key(spec, "fp32", None) != first
    snapshot = "/hf/hub/models--org--name/snapshots/" + "a" * 40
    assert reference.weights_identity(snapshot) == "org/name@" + "a" * 40
    assert reference.weights_identity(None) is None


def test_with_a_key_the_reference_needs_its_signed_sidecar(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    path = tmp_path / "entry.reference-m.npy"
    values = -np.arange(1, 5, dtype=np.float64)
    reference.write_reference(path, values)
    np.testing.assert_array_equal(reference.read_reference(path, 4), values)
    sidecar = path.with_name(path.name + ".json")
    forged = np.array([-1.0, -1.0, -1.0, -1.0])  # rewritten without the key: the sidecar vouches for other bytes
    np.save(path, forged, allow_pickle=False)
    with caplog.at_level("WARNING", logger="jobspec.runner"):
        assert reference.read_reference(path, 4) is None
    assert "vouches for other bytes" in caplog.text
    record = json.loads(sidecar.read_text())
    import hashlib

    sidecar.write_text(json.dumps({**record, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}))
    assert reference.read_reference(path, 4) is None  # its MAC no longer holds
    sidecar.unlink()
    assert reference.read_reference(path, 4) is None  # unsigned, while a key is set
    monkeypatch.delenv(signing.KEY_ENV)
    np.testing.assert_array_equal(reference.read_reference(path, 4), forged)  # no key: checksums are all there is
