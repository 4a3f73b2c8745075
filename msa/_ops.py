"""torch.ops.msa: CPU kernels (the reference), fake kernels and autograd for the C++ schemas.

The schemas live in csrc/torch_bindings.cpp; CUDA kernels register in csrc/api. Everything here is
registered once, at import.
"""
from __future__ import annotations

import torch

from . import reference as ref

try:
    from . import _C  # noqa: F401  (loading the library registers the schemas)
except ImportError as e:  # pragma: no cover - only without a build
    import glob
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    what = "does not load" if glob.glob(os.path.join(here, "_C*.so")) else "is not built"
    raise ImportError(
        f"msa: the compiled module msa._C {what} (in {here}). Build it from the repository root with "
        f"`pip install --no-build-isolation -e .` (README.md). Cause: {e}") from e

ops = torch.ops.msa


def has_cuda_kernel(name: str) -> bool:
    """Whether op `name` has a compiled CUDA kernel in this build."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"msa::{name}", "CUDA")


def _check_cu(cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> None:
    """The CPU twin of csrc/api/checks.h::check_cu_seqlens (values are checked where they are read)."""
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected int32 of shape (S+1,) with S >= 1, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {cu[0]}")
    for s in range(1, len(cu)):
        if cu[s] < cu[s - 1]:
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got {cu[s - 1]} then {cu[s]} at "
                             f"position {s}")
    if cu[-1] != total:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] == T = {total}, got {cu[-1]}")
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    if max_seqlen < longest:
        raise ValueError(f"max_seqlen: expected >= the longest sequence ({longest}), got {max_seqlen}")


# ----------------------------------------------------------------------------------------------
# CPU kernels
# ----------------------------------------------------------------------------------------------
@torch.library.register_kernel("msa::select_blocks", "cpu")
def _select_blocks_cpu(q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, index_scale):
    _check_cu(cu_seqlens, q_idx.shape[0], max_seqlen)
    return ref.select_blocks(q_idx, k_idx, cu_seqlens, topk, block_size, index_scale)


@torch.library.register_kernel("msa::sparse_fwd", "cpu")
def _sparse_fwd_cpu(q, k, v, indices, cu_seqlens, max_seqlen, block_size, softmax_scale):
    _check_cu(cu_seqlens, q.shape[0], max_seqlen)
    return ref.sparse_fwd(q, k, v, indices, cu_seqlens, block_size, softmax_scale)


@torch.library.register_kernel("msa::sparse_bwd", "cpu")
def _sparse_bwd_cpu(dout, q, k, v, out, lse, indices, cu_seqlens, max_seqlen, block_size, softmax_scale):
    _check_cu(cu_seqlens, q.shape[0], max_seqlen)
    return ref.sparse_bwd(dout, q, k, v, lse, indices, cu_seqlens, block_size, softmax_scale)


@torch.library.register_kernel("msa::msa_fwd", "cpu")
def _msa_fwd_cpu(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, softmax_scale, index_scale,
                 warmup, return_indices, index_grad):
    _check_cu(cu_seqlens, q.shape[0], max_seqlen)
    out, kl, indices, lse, lse_idx = ref.msa_fwd(q, k, v, q_idx, k_idx, cu_seqlens, topk, block_size, softmax_scale,
                                                 index_scale, warmup, return_indices)
    acc = ref.acc_dtype(q.dtype)
    if index_grad:  # d kl / d (q_idx, k_idx) for d_kl = 1 (SPEC 4), in the accumulation dtype
        attend = None if warmup else indices
        g_q, g_k = ref.index_kl_bwd(torch.ones((), dtype=acc), q, k, lse, q_idx, k_idx, lse_idx, attend, cu_seqlens,
                                    block_size, softmax_scale, index_scale, out_dtype=acc)
    else:
        g_q, g_k = torch.empty(0, dtype=acc), torch.empty(0, dtype=acc)
    return out, kl, indices, lse, lse_idx, g_q, g_k


@torch.library.register_kernel("msa::msa_bwd", "cpu")
def _msa_bwd_cpu(dout, dkl, q, k, v, out, lse, q_idx, k_idx, lse_idx, indices, kl_dq_idx, kl_dk_idx, cu_seqlens,
                 max_seqlen, block_size, softmax_scale, index_scale, warmup):
    _check_cu(cu_seqlens, q.shape[0], max_seqlen)
    attend = None if warmup else indices
    if dout is None:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    else:
        dq, dk, dv = ref.sparse_bwd(dout, q, k, v, lse, attend, cu_seqlens, block_size, softmax_scale)
    if dkl is None:
        dq_idx, dk_idx = torch.zeros_like(q_idx), torch.zeros_like(k_idx)
    elif kl_dq_idx.shape == q_idx.shape and kl_dk_idx.shape == k_idx.shape:
        s = dkl.to(kl_dq_idx.dtype)
        dq_idx, dk_idx = (kl_dq_idx * s).to(q_idx.dtype), (kl_dk_idx * s).to(k_idx.dtype)
    else:
        dq_idx, dk_idx = ref.index_kl_bwd(dkl, q, k, lse, q_idx, k_idx, lse_idx, attend, cu_seqlens, block_size,
                                          softmax_scale, index_scale)
    return dq, dk, dv, dq_idx, dk_idx


@torch.library.register_kernel("msa::reverse_index", "cpu")
def _reverse_index_cpu(indices, cu_seqlens, max_seqlen, block_size):
    _check_cu(cu_seqlens, indices.shape[1], max_seqlen)
    return ref.reverse_index(indices, cu_seqlens, block_size)


# ----------------------------------------------------------------------------------------------
# Fake kernels (shapes only) for torch.compile / meta tensors
# ----------------------------------------------------------------------------------------------
@torch.library.register_fake("msa::select_blocks")
def _select_blocks_fake(q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, index_scale):
    return q_idx.new_empty(q_idx.shape[1], q_idx.shape[0], topk, dtype=torch.int32)


def _lse_like(x, heads):
    return x.new_empty(heads, x.shape[0], dtype=ref.acc_dtype(x.dtype))


@torch.library.register_fake("msa::sparse_fwd")
def _sparse_fwd_fake(q, k, v, indices, cu_seqlens, max_seqlen, block_size, softmax_scale):
    return torch.empty_like(q), _lse_like(q, q.shape[1])


@torch.library.register_fake("msa::sparse_bwd")
def _sparse_bwd_fake(dout, q, k, v, out, lse, indices, cu_seqlens, max_seqlen, block_size, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake("msa::msa_fwd")
def _msa_fwd_fake(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, softmax_scale, index_scale,
                  warmup, return_indices, index_grad):
    T, Hi = q_idx.shape[0], q_idx.shape[1]
    slots = 0 if (warmup and not return_indices) else topk
    acc = ref.acc_dtype(q.dtype)
    g_q = q_idx.new_empty(q_idx.shape if index_grad else (0,), dtype=acc)
    g_k = k_idx.new_empty(k_idx.shape if index_grad else (0,), dtype=acc)
    return (torch.empty_like(q), q.new_empty((), dtype=acc), q.new_empty(Hi, T, slots, dtype=torch.int32),
            _lse_like(q, q.shape[1]), _lse_like(q, Hi), g_q, g_k)


@torch.library.register_fake("msa::msa_bwd")
def _msa_bwd_fake(dout, dkl, q, k, v, out, lse, q_idx, k_idx, lse_idx, indices, kl_dq_idx, kl_dk_idx, cu_seqlens,
                  max_seqlen, block_size, softmax_scale, index_scale, warmup):
    return tuple(torch.empty_like(x) for x in (q, k, v, q_idx, k_idx))


@torch.library.register_fake("msa::reverse_index")
def _reverse_index_fake(indices, cu_seqlens, max_seqlen, block_size):
    Hi, T, k = indices.shape
    S = cu_seqlens.shape[0] - 1
    return (indices.new_empty(Hi * (T // block_size + S) + 1), indices.new_empty(Hi * T * k),
            indices.new_empty(S + 1))


# ----------------------------------------------------------------------------------------------
# Autograd (SPEC 4): out -> q, k, v only; kl -> q_idx, k_idx only, the teacher P detached
# ----------------------------------------------------------------------------------------------
def _msa_setup(ctx, inputs, output):
    q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, scale, iscale, warmup, _, _ = inputs
    out, kl, indices, lse, lse_idx, kl_dq_idx, kl_dk_idx = output
    ctx.save_for_backward(q, k, v, out, lse, q_idx, k_idx, lse_idx, indices, kl_dq_idx, kl_dk_idx, cu_seqlens)
    ctx.args = (max_seqlen, block_size, scale, iscale, warmup)
    ctx.mark_non_differentiable(indices, lse, lse_idx, kl_dq_idx, kl_dk_idx)
    ctx.set_materialize_grads(False)


def _msa_backward(ctx, dout, dkl, _dindices, _dlse, _dlse_idx, _dg_q, _dg_k):
    q, k, v, out, lse, q_idx, k_idx, lse_idx, indices, kl_dq_idx, kl_dk_idx, cu_seqlens = ctx.saved_tensors
    max_seqlen, block_size, scale, iscale, warmup = ctx.args
    need = ctx.needs_input_grad
    if not any(need[:3]):
        dout = None
    if not any(need[3:5]):
        dkl = None
    if dout is None and dkl is None:
        return (None,) * 14
    dq, dk, dv, dq_idx, dk_idx = ops.msa_bwd(
        dout, dkl, q, k, v, out, lse, q_idx, k_idx, lse_idx, indices, kl_dq_idx, kl_dk_idx, cu_seqlens, max_seqlen,
        block_size, scale, iscale, warmup)
    main = (dq, dk, dv) if dout is not None else (None, None, None)
    index = (dq_idx, dk_idx) if dkl is not None else (None, None)
    return (*main, *index) + (None,) * 9


torch.library.register_autograd("msa::msa_fwd", _msa_backward, setup_context=_msa_setup)


def _sparse_setup(ctx, inputs, output):
    q, k, v, indices, cu_seqlens, max_seqlen, block_size, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, indices, cu_seqlens)
    ctx.args = (max_seqlen, block_size, scale)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _sparse_backward(ctx, dout, _dlse):
    q, k, v, out, lse, indices, cu_seqlens = ctx.saved_tensors
    if dout is None:
        return (None,) * 8
    max_seqlen, block_size, scale = ctx.args
    dq, dk, dv = ops.sparse_bwd(dout, q, k, v, out, lse, indices, cu_seqlens, max_seqlen, block_size, scale)
    return (dq, dk, dv) + (None,) * 5


torch.library.register_autograd("msa::sparse_fwd", _sparse_backward, setup_context=_sparse_setup)
