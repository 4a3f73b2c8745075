import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import msa  # noqa: E402


def cuda_ready(op="reverse_index"):
    return torch.cuda.is_available() and msa.has_cuda_kernel(op)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device and msa's CUDA kernels")
    for item in items:
        if "gpu" in item.keywords and not cuda_ready():
            item.add_marker(skip)


@pytest.fixture(params=["default", "portable"])
def kernel_choice(request, monkeypatch):
    """Runs a test with the default kernels (the Hopper ones on an sm_90 GPU with a 90a build) and with
    the portable ones (MSA_PORTABLE_KERNELS=1, read at every call)."""
    if request.param == "portable":
        monkeypatch.setenv("MSA_PORTABLE_KERNELS", "1")
    else:
        monkeypatch.delenv("MSA_PORTABLE_KERNELS", raising=False)
    return request.param


@pytest.fixture
def backends(monkeypatch):
    """The dense backends the warmup path chose during the test (msa._ops._dense_backend's answers)."""
    from msa import _ops
    taken = []
    choose = _ops._dense_backend

    def record(*args):
        taken.append(choose(*args))
        return taken[-1]
    monkeypatch.setattr(_ops, "_dense_backend", record)
    return taken
