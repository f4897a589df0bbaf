"""Hypothesis profiles, the container tier last, and Triton's interpreter on a machine without a GPU.

Hypothesis profiles: CI is deterministic, a developer's run explores, `bench/fuzz.py` explores longer.

- `ci` (.ci/run sets HYPOTHESIS_PROFILE=ci): derandomized, so the same code gives the same examples and
  a red CI is never luck; no example database (a clean clone has none anyway).
- `dev` (the default): fresh random seeds on every run, as hypothesis does by default, with the failing
  examples kept in .hypothesis/ so the next run replays them first.
- `fuzz` (bench/fuzz.py): fresh seeds, run again and again over the property tests.

A counter-example found by `dev` or `fuzz` is fixed in the code and kept as an `@example` next to its property.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

# No per-example deadline anywhere: hypothesis measures it in wall time, which a loaded machine stretches (a
# "flaky" failure for nothing). Where speed matters, a test asserts on CPU time (time.process_time) instead.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.register_profile("fuzz", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# The record of images `jobspec image push` wrote (~/.config/jobspec/images.json) would change what every rendered Job
# runs: the tests read none unless they make one (tests/test_image_cli.py). Subprocesses inherit it.
os.environ["JOBSPEC_IMAGES"] = os.path.join(os.path.dirname(__file__), ".no-image-record", "images.json")


# Under pytest-xdist (the test command: pytest -n 2) each worker runs its own trainings beside the other's: one torch
# thread pool per process, not one per core each (the runner's supervisor gives its CPU ranks a share of the cores
# the same way). Set before any test imports torch; subprocesses inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# Triton decides at import whether its kernels compile for a GPU or run in its interpreter (TRITON_INTERPRET=1, on
# CPU tensors), and torchao imports it at collection: without a GPU, the interpreter is the only way a Triton kernel
# runs (tests/runner/train/test_loss_liger.py runs Liger Kernel's). A GPU machine (the gpu tier) compiles them.
if not any(os.path.exists(dev) for dev in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd")):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The container tier runs after everything else: on a clean machine its images take minutes to build, which
    .ci/run does in the background meanwhile (its fixtures wait for the builder's lock)."""
    items.sort(key=lambda item: item.get_closest_marker("container") is not None)  # stable: the rest keep their order


GPU_LEAK_BYTES = 256 * 1024**2  # cuBLAS/cuDNN workspaces a test's first matmuls leave allocated, and then some


@pytest.fixture(autouse=True)
def _gpu_memory_hygiene(request: pytest.FixtureRequest) -> Iterator[None]:
    """Around every gpu-tier test (one pytest process runs them all): the allocator's cache emptied before, and
    after, the memory fraction put back to 1, the cache emptied, and the test failed if it left device tensors
    behind. On the H200 a test that reserved ~105 GiB left it cached, and the next test's probe step at a micro-batch
    that fits counted it and "ran out of memory" (bench/gpu/records/2026-11-28-h200)."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    import gc

    import torch

    if not torch.cuda.is_available():
        yield
        return
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    yield
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.synchronize()
    torch.cuda.empty_cache()
    leaked = torch.cuda.memory_allocated() - before
    if leaked > GPU_LEAK_BYTES:
        pytest.fail(f"the test left {leaked / 1024**3:.2f} GiB of device memory allocated (tensors still referenced)")
