"""The warmup path's choice of dense attention kernel (msa/_ops.py::_dense_backend), on the host: cuDNN
only for equal sequence lengths of >= 2 tokens outside deterministic mode with cuDNN SDPA enabled, flash
otherwise; MSA_DENSE_BACKEND overrides and is validated. (The kernels themselves: tests/test_warmup_gpu.py.)"""
import pytest
import torch

from msa import _ops


@pytest.fixture
def cudnn_on(monkeypatch):
    monkeypatch.delenv("MSA_DENSE_BACKEND", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)


def _qk():
    return torch.empty(64, 8, 128), torch.empty(64, 2, 128)


def test_rule(cudnn_on):
    q, k = _qk()
    assert _ops._dense_backend(q, k, 64, True, False) == "cudnn"
    assert _ops._dense_backend(q, k, 64, False, False) == "flash"  # ragged varlen
    assert _ops._dense_backend(q, k, 64, True, True) == "flash"  # deterministic
    assert _ops._dense_backend(q, k, 1, True, False) == "flash"  # cuDNN takes no one-token sequences


def test_sdp_flag_is_respected(cudnn_on, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    q, k = _qk()
    assert _ops._dense_backend(q, k, 64, True, False) == "flash"


def test_override(cudnn_on, monkeypatch):
    q, k = _qk()
    monkeypatch.setenv("MSA_DENSE_BACKEND", "flash")
    assert _ops._dense_backend(q, k, 64, True, False) == "flash"
    monkeypatch.setenv("MSA_DENSE_BACKEND", "cudnn")
    assert _ops._dense_backend(q, k, 64, True, False) == "cudnn"
    assert _ops._dense_backend(q, k, 64, False, False) == "flash"  # cuDNN cannot take ragged lengths
    assert _ops._dense_backend(q, k, 64, True, True) == "flash"  # nor give a repeatable backward
    monkeypatch.setenv("MSA_DENSE_BACKEND", "fast")
    with pytest.raises(ValueError, match="MSA_DENSE_BACKEND"):
        _ops._dense_backend(q, k, 64, True, False)


def test_a_failed_shape_takes_flash(cudnn_on, monkeypatch):
    monkeypatch.setattr(_ops, "_CUDNN_FAILED", set())
    q, k = _qk()
    with pytest.warns(RuntimeWarning, match="cuDNN attention failed"):
        _ops._cudnn_failed(q, k, 64, RuntimeError("unsupported"))
    assert _ops._dense_backend(q, k, 64, True, False) == "flash"
    assert _ops._dense_backend(q, k, 128, True, False) == "cudnn"  # another shape still tries cuDNN
