"""runner.oom.detect: detection, release after the except block, rank agreement, the micro-batch ladder."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from jobspec.catalog import tiers
from runner.oom import detect as oom
from runner.oom.detect import OOM_MARKERS, describe, guarded, is_oom, next_micro_batch


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        torch.cuda.OutOfMemoryError("anything"),  # the same class; the type alone decides
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
        RuntimeError("HIP out of memory. Tried to allocate 20.00 MiB (GPU 0; 63.98 GiB total capacity)"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"),
        RuntimeError("HIP error: hipErrorOutOfMemory"),
    ],
)
def test_is_oom_recognises_every_form(exc: BaseException) -> None:
    assert is_oom(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("Expected all tensors to be on the same device"),
        ValueError("ran out of memory"),  # not a RuntimeError: not an allocator failure
        MemoryError(),  # host RAM: the micro-batch ladder cannot help an offload tier
        KeyboardInterrupt(),
        None,
    ],
)
def test_is_oom_rejects_other_errors(exc: BaseException | None) -> None:
    assert not is_oom(exc)


def test_is_oom_follows_the_cause_chain() -> None:
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except RuntimeError as inner:
            raise ValueError("backend compiler failed") from inner
    except ValueError as outer:
        assert is_oom(outer)


def test_markers_cover_the_documented_strings() -> None:
    for needle in ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "hipErrorOutOfMemory"):
        assert needle in OOM_MARKERS


def test_describe_is_one_line_and_bounded() -> None:
    text = describe(torch.OutOfMemoryError("CUDA out of memory. " + "x" * 1000 + "\nsecond line"))
    assert text.startswith("OutOfMemoryError: CUDA out of memory.")
    assert "\n" not in text and len(text) < 350


def test_guarded_returns_the_value_when_nothing_fails() -> None:
    out = guarded(lambda: 41 + 1)
    assert (out.value, out.oom, out.reason) == (42, False, "")


def test_guarded_reraises_other_errors_unchanged() -> None:
    def step() -> None:
        raise KeyError("not memory")

    with pytest.raises(KeyError, match="not memory"):
        guarded(step)


class _Big:
    """Stands for a step's activations: must be collectable once guarded() returns."""


def test_guarded_returns_with_the_failed_steps_tensors_already_unreferenced() -> None:
    refs: list[weakref.ref[_Big]] = []

    def step() -> None:
        activations = _Big()  # held only by this frame (and, while handled, the traceback)
        refs.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    gc.disable()  # no lucky gc pass: the references must be gone by construction
    try:
        out = guarded(step)
        freed = refs[0]() is None
    finally:
        gc.enable()
    assert out.oom and out.value is None and "Tried to allocate 1.00 GiB" in out.reason
    # Freed by reference counting as guarded returns (accelerate empties the cache inside the except
    # block, where the traceback still holds them); release_memory's empty_cache() then finds them free.
    assert freed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_release_memory_skips_the_full_collection_without_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    generations: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: generations.append(generation) or 0)
    oom.release_memory()
    assert generations == [1]  # young objects only: a full pass costs ~150 ms with torch loaded


def test_guarded_releases_tensors_of_a_failed_forward() -> None:
    model = torch.nn.Linear(4, 4)
    refs: list[weakref.ref[torch.Tensor]] = []

    def step() -> None:
        hidden = model(torch.randn(8, 4))
        refs.append(weakref.ref(hidden))
        raise RuntimeError("CUDA error: out of memory")

    assert guarded(step).oom
    assert refs[0]() is None


@pytest.mark.parametrize(
    ("current", "per_rank", "expected"),
    [(8, 8, 4), (4, 8, 2), (2, 8, 1), (1, 8, None), (8, 24, 6), (6, 24, 4), (3, 24, 2), (12, 12, 6), (7, 12, 6)],
)
def test_next_micro_batch_is_the_next_smaller_divisor(current: int, per_rank: int, expected: int | None) -> None:
    nxt = next_micro_batch(current, per_rank)
    assert nxt == expected
    if nxt is not None:
        assert per_rank % nxt == 0  # grad_accum = per_rank / nxt stays an integer


def test_next_micro_batch_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        next_micro_batch(0, 8)


REAL_CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB "
    "is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory "
    "75.56 GiB is allocated by PyTorch, and 1.98 GiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)


def test_parse_oom_reads_the_allocators_numbers() -> None:
    from runner.oom.detect import OOMInfo, parse_oom

    gib = 1024**3
    assert parse_oom(REAL_CUDA_OOM) == OOMInfo(2 * gib, int(1.06 * gib), int(75.56 * gib), int(1.98 * gib))
    assert parse_oom("CUDA error: out of memory") is None  # a kernel launch: no numbers
    assert parse_oom("HIP out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 15.98 GiB of "
                     "which 0 bytes is free. Of the allocated memory 15.2 GiB is allocated by PyTorch").free == 0


def test_a_real_oom_jumps_once_to_what_the_numbers_say_fits() -> None:
    from runner.oom.detect import headroom, parse_oom

    gib = 1024**3
    baseline = 60 * gib  # weights + optimizer state when the step started
    # 64 samples needed at least 75.56 + 2 - 60 = 17.56 GiB (0.27 GiB a sample); 75.56 + 1.98 + 1.06 - 60
    # = 18.6 GiB is there: 67 samples "fit" by the lower bound, so the jump is to 64's largest divisor below 64.
    room = headroom(parse_oom(REAL_CUDA_OOM), baseline, 64)
    assert room is not None and room.room / room.per_sample == pytest.approx(67.8, abs=0.1)
    assert next_micro_batch(64, 256, room) == 32  # divisors of 256 below 64: 32 is the largest that fits


def _oom_walk(per_rank: int, start: int, limit: int, per_sample: int) -> tuple[int, int]:
    """Shrink from `start` under JOBSPEC_FAULT_OOM=mbs>limit until a micro-batch runs: (it, OOMs)."""
    from runner.oom.detect import headroom, parse_oom
    from runner.oom.faults import FaultInjector, FaultRules

    injector = FaultInjector(FaultRules(mbs_above=limit), rank=0, tier="fast", per_sample_bytes=per_sample)
    mbs, ooms = start, 0
    while True:
        try:
            injector.check(mbs)
            return mbs, ooms
        except torch.OutOfMemoryError as err:
            ooms += 1
            nxt = next_micro_batch(mbs, per_rank, headroom(parse_oom(str(err)), None, mbs))
            assert nxt is not None, (per_rank, start, limit)
            mbs = nxt


@pytest.mark.parametrize("per_sample", [300 * 1024, 37 * 1024**2, 3 * 1024**3 // 7])
@pytest.mark.parametrize("per_rank", [128, 96, 120, 360])
def test_from_the_whole_batch_the_true_maximum_is_reached_with_at_most_two_ooms(per_rank, per_sample) -> None:
    for limit in range(1, per_rank):
        got, ooms = _oom_walk(per_rank, per_rank, limit, per_sample)
        assert got == max(d for d in tiers.divisors(per_rank) if d <= limit), (per_rank, limit)
        assert ooms <= 2, (per_rank, limit, ooms)


def test_without_numbers_the_next_smaller_divisor() -> None:
    assert [next_micro_batch(m, 24) for m in (24, 12, 8, 6, 4, 3, 2, 1)] == [12, 8, 6, 4, 3, 2, 1, None]
    from runner.oom.detect import Headroom

    assert next_micro_batch(24, 24, Headroom(per_sample=10.0, room=5.0)) == 12  # "nothing fits": one step only
