"""Packing without cross-contamination: every record of a packed row gets the logits and the loss it has alone.

Real tiny models on CPU (GPT-2 and Llama families, sdpa and eager, full and LoRA), real runs of every tier; the
numbers are compared in fp32 within 1e-5. Before per-record positions the logits differed by about 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jobspec.catalog.presets import PRESETS
from runner.data.dataset import IGNORE, SFTData, pack
from runner.data.tokens import Rows, StreamsBuilder, record_positions
from runner.model.build import build_model
from runner.train.loss import install_chunked_loss
from runner.train.step import summed_loss
from tests.runner.train_helpers import records as metric_records
from tests.runner.train_helpers import tiny_spec, train_in_process

LORA = {"tiny": {"rank": 4, "targets": ["c_attn"]}, "llama-tiny": {"rank": 4, "targets": ["q_proj", "v_proj"]}}
LENGTHS = (9, 4, 13, 6, 11, 5, 7)  # tokens of the test records: rows of max_seq_len 24 hold 2-3 of them


def _streams(lengths=LENGTHS, vocab=256, seed=0, first_is_target=False):
    """Records of `lengths` random tokens; targets from the 3rd token on (or every token)."""
    rng = np.random.default_rng(seed)
    out = StreamsBuilder(vocab)
    for n in lengths:
        flags = np.ones(n, dtype=bool) if first_is_target else np.arange(n) >= 2
        out.add(rng.integers(0, vocab, n), flags)
    return out.build()


def _data(streams, max_seq_len=24):
    rows = pack(streams, max_seq_len)
    return SFTData(rows, rows, pad_id=0, max_seq_len=max_seq_len)


def _alone(streams, k):
    """Record k as an unpacked row would give it: (input_ids, labels) (1, n - 1)."""
    ids, flags = streams[k]
    x, y = ids[:-1], np.where(flags[1:], ids[1:], IGNORE)
    return torch.from_numpy(x)[None], torch.from_numpy(y)[None]


# --- positions and targets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_the_positions_of_a_packed_row_restart_at_each_record(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 12, rng.integers(1, 9))
    width = int(lengths.sum()) - 1 + int(rng.integers(0, 5))  # input positions, then some padding
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    # per position, the slow way: minus the start of its record; padding belongs to the last record
    expected = [t - int(starts[starts <= t].max()) for t in range(width)]
    got = record_positions(lengths, width)
    assert got.dtype == np.int64 and got.tolist() == expected


def test_a_packed_batch_carries_positions_and_an_unpacked_one_none():
    streams = _streams()
    data = _data(streams)
    assert data.train.packed and [len(data.train.record_lengths(r)) for r in range(len(data.train))] == [2, 2, 3]
    batch = data.collate([0, 1, 2])
    assert batch.position_ids is not None and batch.position_ids.shape == batch.input_ids.shape == (3, 24)
    assert batch.position_ids.dtype == torch.int64
    # row 2 joins records 4, 5, 6 (11, 5, 7 tokens): 23 tokens, 22 positions, then 2 of padding counted on
    assert batch.position_ids[2].tolist() == [*range(11), *range(5), *range(6), 6, 7]
    assert batch.position_ids[1].tolist() == [*range(13), *range(5), *range(5, 11)]
    assert data.train.positions(2).tolist() == batch.position_ids[2, :22].tolist()
    assert batch.position_ids[0, :12].tolist() == [*range(9), *range(3)]
    unpacked = Rows(streams, np.arange(len(streams)), np.arange(len(streams) + 1))
    assert not unpacked.packed
    assert SFTData(unpacked, unpacked, 0, 24).collate([0, 1]).position_ids is None


def test_pinning_keeps_the_positions():
    from runner.data.loader import StepBatches

    batch = _data(_streams()).collate([0, 1])
    item = StepBatches(0, 2, (0, 1), (batch,))
    if not torch.cuda.is_available():  # pinning needs an accelerator: check what the pin-memory thread calls
        from unittest import mock

        with mock.patch.object(torch.Tensor, "pin_memory", lambda t: t.clone()):
            pinned = item.pin_memory().batches[0]
    else:
        pinned = item.pin_memory().batches[0]
    assert pinned.position_ids is not None and torch.equal(pinned.position_ids, batch.position_ids)


def test_no_target_crosses_a_record_boundary():
    """Even records whose first token is flagged a target: packed, its label is never scored from the record before."""
    streams = _streams(first_is_target=True)
    rows = pack(streams, 24)
    for r in range(len(rows)):
        _x, y = rows[r]
        starts = np.cumsum(rows.record_lengths(r))[:-1]  # token index where each later record begins
        assert (y[starts - 1] == IGNORE).all()  # the last position of a record is not scored on the next one
        expected = np.concatenate([[*_alone(streams, k)[1][0].numpy().tolist(), IGNORE] for k in _records(rows, r)])
        assert y.tolist() == expected[:-1].tolist()  # each record's own targets, nothing else


def _records(rows, r):
    return rows.records[rows.groups[r] : rows.groups[r + 1]].tolist()


# --- logits and loss: packed equals alone --------------------------------------------------------------------------


def _model(tmp_path, preset, attention, lora):
    spec = tiny_spec(
        tmp_path / "run",
        model={"preset": preset, "attention": attention, **({"lora": LORA[preset]} if lora else {})},
        data={"max_seq_len": 24, "packing": True},
    )
    vocab = PRESETS[preset].vocab
    model = build_model(spec, bos=1, eos=2, vocab=vocab, precision="fp32").eval()
    if lora:  # peft starts its B matrices at 0; give the adapters something to do
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])  # GPT-2 (learned positions) and Llama (RoPE, GQA)
def test_packed_logits_and_loss_equal_each_record_alone(tmp_path, preset, attention, lora):
    model = _model(tmp_path, preset, attention, lora)
    streams = _streams()
    data = _data(streams)
    ids = list(range(len(data.train)))
    batch = data.collate(ids)
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        before = model(input_ids=batch.input_ids).logits  # what packing did before: one causal row
        worst, unconfined = 0.0, 0.0
        for r in ids:
            start = 0
            for k in _records(data.train, r):
                x, _ = _alone(streams, k)
                alone = model(input_ids=x).logits[0]
                n = x.shape[1]
                worst = max(worst, float((packed[r, start : start + n] - alone).abs().max()))
                unconfined = max(unconfined, float((before[r, start : start + n] - alone).abs().max()))
                start += n + 1
    assert worst < 1e-5, worst
    assert unconfined > 1e-2  # the comparison can fail: without per-record positions the records do differ

    # the runner's loss, full logits and the chunked head, packed == the sum over the records alone
    with torch.no_grad():
        alone_sum = sum(float(summed_loss(model, None, *_alone(streams, k))) for k in range(len(streams)))
        full = float(summed_loss(model, None, batch.input_ids, batch.labels, batch.position_ids))
        head = install_chunked_loss(model, run=model, device=torch.device("cpu"))
        assert head is not None  # LoRA targets the attention here: the output layer is a plain nn.Linear
        chunked = float(summed_loss(model, head, batch.input_ids, batch.labels, batch.position_ids))
    targets = sum(int((_alone(streams, k)[1] != IGNORE).sum()) for k in range(len(streams)))
    assert batch.targets == targets
    assert full == pytest.approx(alone_sum, rel=1e-5) and chunked == pytest.approx(alone_sum, rel=1e-5)


def test_an_unpacked_batch_calls_the_model_as_before(tmp_path):
    """No position ids for rows of one record: the model gets exactly the call it got before packing existed."""
    model = _model(tmp_path, "llama-tiny", "sdpa", False)
    streams = _streams()
    unpacked = Rows(streams, np.arange(len(streams)), np.arange(len(streams) + 1))
    batch = SFTData(unpacked, unpacked, 0, 24).collate([0, 1, 2])
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(sorted(kwargs)), with_kwargs=True)
    summed_loss(model, None, batch.input_ids, batch.labels, batch.position_ids)
    assert calls == [["input_ids"]]


# --- every tier: the first step's loss is the records' own -----------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("tier", ["fast", "zero2", "zero2_offload", "zero3", "minimal"])
def test_every_tier_trains_packed_rows_on_each_records_own_loss(tmp_path, tier, lora):
    spec = tiny_spec(
        tmp_path / "run",
        model={"preset": "llama-tiny", **({"lora": LORA["llama-tiny"]} if lora else {})},
        data={"packing": True, "max_seq_len": 128},
        training={"steps": 2, "warmup_steps": 1, "micro_batch": 4},
        memory={"tier": tier},
    )
    code, worker = train_in_process(spec)
    assert code == 0
    rows = worker.data.train
    assert worker.spec.data.packing and getattr(rows, "packed", True)
    step0 = worker.step_ids(0)
    parts = [rows.locate(i) if hasattr(rows, "locate") else (rows, i) for i in step0]
    assert max(len(part.record_lengths(k)) for part, k in parts) > 1  # the step really holds packed rows
    logged = metric_records(tmp_path / "run")[0]["loss"]

    # the same samples, record by record, on the same initial weights
    model = build_model(spec, bos=getattr(worker.tokenizer, "BOS", worker.tokenizer.eos_id),
                        eos=worker.tokenizer.eos_id, vocab=worker.tokenizer.vocab_size, precision="fp32")  # fmt: skip
    total, targets = 0.0, 0
    with torch.no_grad():
        for part, k in parts:
            for rec in _records(part, k):
                x, y = _alone(part.streams, rec)
                total += float(summed_loss(model, None, x, y))
                targets += int((y != IGNORE).sum())
    assert logged == pytest.approx(total / targets, rel=1e-5, abs=1e-5)


# --- the memory trace traces the packed step -----------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["fast", "zero3"])
def test_the_trace_of_a_packed_step_equals_real_tensors(tier):
    from runner.train.trace import runner_loss, trace_step

    def trace(fake, packed):
        return trace_step(PRESETS["llama-tiny"], tier=tier, world_size=1, micro_batch=2, seq_len=64,
                          loss=runner_loss, fused=None, fake=fake, packed=packed)  # fmt: skip

    fake, real = trace(True, True), trace(False, True)
    assert fake.raw == real.raw and fake.peak == real.peak
    assert fake.peak > trace(True, False).peak  # the block-diagonal mask is in it
