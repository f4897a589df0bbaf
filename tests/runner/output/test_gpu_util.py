"""gpu_util comes from torch.cuda.utilization (NVML or amdsmi, so ROCm too); None on CPU and after a failure,
which is asked only once (the query sits in the training loop)."""

from __future__ import annotations

import logging

import pytest
import torch

from runner.output.metrics import GpuUtil


class FakeUtilization:
    """torch.cuda.utilization at the boundary: returns `value`, or raises `error`; counts its calls."""

    def __init__(self, value: int = 0, error: Exception | None = None):
        self.value, self.error, self.devices = value, error, []

    def __call__(self, device=None) -> int:
        self.devices.append(device)
        if self.error is not None:
            raise self.error
        return self.value


@pytest.mark.parametrize("hip", [None, "6.2.41133"], ids=["cuda", "rocm"])
def test_utilisation_of_the_training_device_on_nvidia_and_rocm(monkeypatch, hip):
    fake = FakeUtilization(73)
    monkeypatch.setattr(torch.cuda, "utilization", fake)
    monkeypatch.setattr(torch.version, "hip", hip)
    util = GpuUtil(torch.device("cuda", 1))
    assert util() == 73 and util() == 73
    assert fake.devices == [torch.device("cuda", 1)] * 2


def test_cpu_is_none_without_asking(monkeypatch):
    fake = FakeUtilization(50)
    monkeypatch.setattr(torch.cuda, "utilization", fake)
    assert GpuUtil(torch.device("cpu"))() is None and fake.devices == []


@pytest.mark.parametrize(
    "error",
    [
        ModuleNotFoundError("nvidia-ml-py does not seem to be installed or it can't be imported."),
        RuntimeError("cuda driver can't be loaded, is cuda enabled?"),
        RuntimeError("device 3 is not visible (CUDA_VISIBLE_DEVICES=[0, 1])"),
        Exception("Not Supported"),  # what NVMLError_NotSupported (a MIG slice) and AmdSmiException derive from
    ],
    ids=["no-library", "no-driver", "not-visible", "not-supported"],
)
def test_a_failure_is_logged_once_and_never_asked_again(monkeypatch, caplog, error):
    fake = FakeUtilization(error=error)
    monkeypatch.setattr(torch.cuda, "utilization", fake)
    util = GpuUtil(torch.device("cuda", 0))
    with caplog.at_level(logging.INFO, logger="jobspec.runner"):
        assert [util() for _ in range(5)] == [None] * 5
    assert len(fake.devices) == 1
    assert caplog.text.count("gpu_util: not available") == 1 and str(error) in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the real failure on a machine without a GPU")
def test_the_real_call_without_a_gpu_is_none():
    assert GpuUtil(torch.device("cuda", 0))() is None
