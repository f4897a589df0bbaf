"""runner.oom.detect: detection, release after the except block, rank agreement, the micro-batch ladder."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

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
