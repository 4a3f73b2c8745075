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
