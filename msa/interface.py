"""The public API (SPEC.md section 6): argument checks with clear errors, defaults, layouts.

Batched tensors (B, N, H, D) are the equal-length case of the packed layout (T = B*N, H, D): they are
viewed as packed with cu_seqlens = [0, N, 2N, ...] and the ops see one layout only.
"""
from __future__ import annotations

import math
import re

import torch

from ._ops import has_cuda_kernel, ops

HEAD_DIMS = (64, 128)
BLOCK_SIZES = (64, 128)
MAX_TOPK = 32
GPU_DTYPES = (torch.bfloat16, torch.float16)
# The CPU path also takes fp32/fp64 (debugging, gradcheck); the CUDA kernels take bf16/fp16.
CPU_DTYPES = GPU_DTYPES + (torch.float32, torch.float64)


def _fail(name, expected, got, exc=ValueError):
    raise exc(f"{name}: expected {expected}, got {got}")


def _check_tensor(name, x, rank, layout):
    if not isinstance(x, torch.Tensor):
        _fail(name, "a torch.Tensor", type(x).__name__, TypeError)
    if x.dim() != rank:
        _fail(name, f"a {rank}-dim tensor {layout}", f"shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        _fail(name, "a contiguous last dim (stride(-1) == 1)", f"stride {x.stride()}")


def _check_common(named, rank, layout):
    """Rank, last-dim contiguity, one device, one dtype out of the supported ones. Under torch.autocast on
    the tensors' device (CUDA or CPU) the ops cast every floating input to the autocast dtype (msa/_ops.py), so there
    any floating dtype, mixed, is accepted, as torch's attention accepts it."""
    for name, x in named:
        _check_tensor(name, x, rank, layout)
    name0, x0 = named[0]
    for name, x in named[1:]:
        if x.device != x0.device:
            _fail(name, f"device {x0.device} (the device of {name0})", x.device)
    if x0.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x0.device.type):
        for name, x in named:
            if not x.is_floating_point():
                _fail(name, "a floating-point tensor", x.dtype, TypeError)
        return
    allowed = CPU_DTYPES if x0.device.type == "cpu" else GPU_DTYPES
    if x0.dtype not in allowed:
        _fail(name0, f"dtype in {[str(d) for d in allowed]} on {x0.device.type}", x0.dtype, TypeError)
    for name, x in named[1:]:
        if x.dtype != x0.dtype:
            _fail(name, f"dtype {x0.dtype} (the dtype of {name0})", x.dtype, TypeError)


def _check_option(name, value, allowed):
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, f"an int in {allowed}", repr(value), TypeError)
    if value not in allowed:
        _fail(name, f"one of {tuple(allowed)}", value)


def _check_heads(hq, hkv, hi, hki, hi_name="q_idx"):
    if hq % hkv:
        _fail("k", f"a kv head count dividing Hq={hq}", hkv)
    if hi is None:
        return
    if hq % hi:
        _fail(hi_name, f"an index head count dividing Hq={hq}", hi)
    if hki is not None and hi % hki:
        _fail("k_idx", f"an index-key head count dividing Hi={hi}", hki)
    if hi % hkv and hkv % hi:
        _fail(hi_name, f"Hi and Hkv={hkv} such that one divides the other", f"Hi={hi}")


def _check_dim(name, d):
    if d not in HEAD_DIMS:
        _fail(name, f"head dim in {HEAD_DIMS}", d)


def _scale(name, value, d):
    if value is None:
        return 1.0 / math.sqrt(d)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(name, "a finite float or None", repr(value), TypeError)
    return float(value)


def _require_kernel(op, x):
    if x.device.type == "cuda" and not has_cuda_kernel(op):
        raise NotImplementedError(
            f"msa: this build has no CUDA kernel for msa::{op} (built without CUDA, or the kernel is not "
            f"written yet: see the support matrix in README.md). Tensors on the CPU use the reference path.")
    if x.device.type not in ("cpu", "cuda"):
        _fail("q", "a CPU or CUDA tensor", x.device)


def _deterministic(value):
    """deterministic=None follows torch.use_deterministic_algorithms."""
    if value is None:
        return torch.are_deterministic_algorithms_enabled()
    if not isinstance(value, bool):
        _fail("deterministic", "a bool or None", repr(value), TypeError)
    return value


def _flat(x):
    """(B, N, H, D) -> (B * N, H, D): a view where the strides allow it (slices of a fused QKV projection
    keep theirs), else one copy (e.g. a transposed (B, H, N, D) tensor seen as (B, N, H, D))."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _check_msa_inputs(q, k, v, q_idx, k_idx, rank, topk, block_size):
    layout = "(B, N, H, D)" if rank == 4 else "(T, H, D)"
    _check_common([("q", q), ("k", k), ("v", v), ("q_idx", q_idx), ("k_idx", k_idx)], rank, layout)
    lead = q.shape[:-2]
    if any(s < 1 for s in lead):
        _fail("q", "at least one token" + (" and batch >= 1" if rank == 4 else ""), f"shape {tuple(q.shape)}")
    for name, x in (("k", k), ("v", v), ("q_idx", q_idx), ("k_idx", k_idx)):
        if x.shape[:-2] != lead:
            _fail(name, f"leading dims {tuple(lead)} (those of q)", f"shape {tuple(x.shape)}")
    D, Di = q.shape[-1], q_idx.shape[-1]
    _check_dim("q", D)
    _check_dim("q_idx", Di)
    if k.shape[-1] != D:
        _fail("k", f"head dim D={D} (that of q)", k.shape[-1])
    if k.shape != v.shape:
        _fail("v", f"the shape of k {tuple(k.shape)}", f"shape {tuple(v.shape)}")
    if k_idx.shape[-1] != Di:
        _fail("k_idx", f"head dim Di={Di} (that of q_idx)", k_idx.shape[-1])
    _check_heads(q.shape[-2], k.shape[-2], q_idx.shape[-2], k_idx.shape[-2])
    _check_option("block_size", block_size, BLOCK_SIZES)
    _check_option("topk", topk, range(1, MAX_TOPK + 1))


def _check_varlen(cu_seqlens, max_seqlen, x, total=None):
    _check_cu_seqlens(cu_seqlens, x.device)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        _fail("max_seqlen", "an int", repr(max_seqlen), TypeError)
    if max_seqlen < 1:
        _fail("max_seqlen", "an int >= 1", max_seqlen)
    if total is not None and cu_seqlens.is_cuda and not torch.compiler.is_compiling():
        _check_values_cuda(cu_seqlens, max_seqlen, total)


_VALUE_ERROR = re.compile(r"(cu_seqlens|max_seqlen): expected")


def _check_values_cuda(cu_seqlens, max_seqlen, total):
    """The values of a CUDA cu_seqlens are checked by the compiled op (csrc/api/cu_seqlens.cpp), which
    remembers them per tensor version, so the ops that follow read nothing back. A check in the compiled
    module can only raise RuntimeError (it is built on PyTorch's stable ABI); here the ones about the
    values become the ValueError of SPEC 7. (Under torch.compile the ops' own RuntimeError is raised.)"""
    _require_kernel("validate_cu_seqlens", cu_seqlens)
    try:
        ops.validate_cu_seqlens(cu_seqlens, total, max_seqlen)
    except RuntimeError as e:
        m = _VALUE_ERROR.search(str(e))
        if m is None:
            raise
        raise ValueError(str(e)[m.start():]) from None


def _check_cu_seqlens(cu_seqlens, device):
    """Type, dtype, shape and device of a cu_seqlens (its values are checked by the ops)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail("cu_seqlens", "an int32 tensor", type(cu_seqlens).__name__, TypeError)
    if cu_seqlens.dtype != torch.int32:
        _fail("cu_seqlens", "dtype torch.int32", cu_seqlens.dtype, TypeError)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        _fail("cu_seqlens", "shape (S+1,) with S >= 1", tuple(cu_seqlens.shape))
    if cu_seqlens.device != device:
        _fail("cu_seqlens", f"device {device} (that of q)", cu_seqlens.device)


def _msa(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, softmax_scale, index_scale, warmup,
         return_indices, deterministic):
    _require_kernel("msa_fwd", q)
    scale = _scale("softmax_scale", softmax_scale, q.shape[-1])
    iscale = _scale("index_scale", index_scale, q_idx.shape[-1])
    # The KL's index gradient is computed with the KL itself when autograd will ask for it (SPEC 4).
    index_grad = torch.is_grad_enabled() and (q_idx.requires_grad or k_idx.requires_grad)
    return ops.msa_fwd(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, scale, iscale,
                       bool(warmup), bool(return_indices), index_grad, _deterministic(deterministic))


def msa_attention(q, k, v, q_idx, k_idx, *, topk=16, block_size=128, softmax_scale=None, index_scale=None,
                  warmup=False, return_indices=False, deterministic=None):
    """MiniMax Sparse Attention, causal, batched layout.

    Args:
        q: (B, N, Hq, D) main queries; k, v: (B, N, Hkv, D) main keys/values (GQA).
        q_idx: (B, N, Hi, Di) index queries, one head per index group; k_idx: (B, N, Hki, Di) index keys.
        topk: blocks selected per (token, index group), the token's own block included (1..32).
        block_size: tokens per kv block (64 or 128).
        softmax_scale, index_scale: default 1/sqrt(D) and 1/sqrt(Di).
        warmup: dense causal main attention, KL over the full causal set (SPEC 5).
        return_indices: also return the selection, int32 (B, Hi, N, topk), ascending, -1 padded.
        deterministic: bitwise reproducible gradients (None: torch.are_deterministic_algorithms_enabled()).

    Returns:
        (out, kl) or (out, kl, indices). out: (B, N, Hq, D) in the input dtype, differentiable in q, k, v.
        kl: fp32 0-dim tensor, the exact KL(P || Pidx) averaged over B*N*Hi rows, differentiable in
        q_idx, k_idx only (the teacher P is detached).
    """
    _check_msa_inputs(q, k, v, q_idx, k_idx, 4, topk, block_size)
    B, N = q.shape[:2]
    flat = [_flat(x) for x in (q, k, v, q_idx, k_idx)]
    out, kl, indices = _msa(*flat, None, N, topk, block_size, softmax_scale, index_scale, warmup, return_indices,
                            deterministic)[:3]
    out = out.view(B, N, *out.shape[1:])
    if not return_indices:
        return out, kl
    Hi = q_idx.shape[2]
    return out, kl, indices.view(Hi, B, N, topk).permute(1, 0, 2, 3).contiguous()


def msa_attention_varlen(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, *, topk=16, block_size=128,
                         softmax_scale=None, index_scale=None, warmup=False, return_indices=False, deterministic=None):
    """MiniMax Sparse Attention on packed sequences (flash-attn's thd layout).

    Same as `msa_attention` with tensors (T, H, D) and `cu_seqlens` int32 (S+1,) giving each sequence's
    first token (cu_seqlens[0] = 0, cu_seqlens[-1] = T, non-decreasing; empty sequences are allowed).
    Every sequence is independent and its blocks start at its own first token. `max_seqlen` must be
    >= the longest sequence. indices, when returned, are (Hi, T, topk); kl averages over T*Hi rows.
    """
    _check_msa_inputs(q, k, v, q_idx, k_idx, 3, topk, block_size)
    _check_varlen(cu_seqlens, max_seqlen, q, q.shape[0])
    out, kl, indices = _msa(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, softmax_scale,
                            index_scale, warmup, return_indices, deterministic)[:3]
    return (out, kl, indices) if return_indices else (out, kl)


def select_blocks(q_idx, k_idx, *, topk=16, block_size=128, index_scale=None, cu_seqlens=None, max_seqlen=None):
    """The index branch alone (SPEC 2): int32 selected blocks, ascending, -1 padded.

    Batched (B, N, Hi, Di) / (B, N, Hki, Di) inputs give (B, Hi, N, topk). Packed (T, H, Di) inputs with
    `cu_seqlens` and `max_seqlen` give (Hi, T, topk). Not differentiable.
    """
    rank = 3 if cu_seqlens is not None else 4
    layout = "(B, N, H, Di)" if rank == 4 else "(T, H, Di)"
    _check_common([("q_idx", q_idx), ("k_idx", k_idx)], rank, layout)
    if q_idx.shape[:-2] != k_idx.shape[:-2] or any(s < 1 for s in q_idx.shape[:-2]):
        _fail("k_idx", f"leading dims {tuple(q_idx.shape[:-2])} (those of q_idx, each >= 1)",
              f"shape {tuple(k_idx.shape)}")
    Di = q_idx.shape[-1]
    _check_dim("q_idx", Di)
    if k_idx.shape[-1] != Di:
        _fail("k_idx", f"head dim Di={Di} (that of q_idx)", k_idx.shape[-1])
    if q_idx.shape[-2] % k_idx.shape[-2]:
        _fail("k_idx", f"an index-key head count dividing Hi={q_idx.shape[-2]}", k_idx.shape[-2])
    _check_option("block_size", block_size, BLOCK_SIZES)
    _check_option("topk", topk, range(1, MAX_TOPK + 1))
    _require_kernel("select_blocks", q_idx)
    iscale = _scale("index_scale", index_scale, Di)
    if rank == 3:
        _check_varlen(cu_seqlens, max_seqlen, q_idx, q_idx.shape[0])
        return ops.select_blocks(q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, iscale)
    B, N, Hi = q_idx.shape[:3]
    idx = ops.select_blocks(_flat(q_idx), _flat(k_idx), None, N, topk, block_size, iscale)
    return idx.view(Hi, B, N, topk).permute(1, 0, 2, 3).contiguous()


def sparse_attention(q, k, v, indices, *, block_size=128, softmax_scale=None, return_lse=False, cu_seqlens=None,
                     max_seqlen=None, deterministic=None):
    """The main branch alone (SPEC 3): causal attention over the tokens of the given blocks.

    Batched: q (B, N, Hq, D), k/v (B, N, Hkv, D), indices int32 (B, Hi, N, topk) as `select_blocks`
    returns them (query head h uses index group h // (Hq/Hi)); lse is (B, Hq, N). Packed: (T, H, D)
    tensors, indices (Hi, T, topk), `cu_seqlens`/`max_seqlen` as in `msa_attention_varlen`; lse (Hq, T).
    Entries < 0 or beyond the token's own block select nothing; repeats count once. A row that attends
    to nothing gets out = 0 and lse = -inf. Differentiable in q, k, v; `deterministic` as in
    `msa_attention`.
    """
    rank = 3 if cu_seqlens is not None else 4
    layout = "(B, N, H, D)" if rank == 4 else "(T, H, D)"
    _check_common([("q", q), ("k", k), ("v", v)], rank, layout)
    if not isinstance(indices, torch.Tensor):
        _fail("indices", "an int32 tensor", type(indices).__name__, TypeError)
    if indices.dtype != torch.int32:
        _fail("indices", "dtype torch.int32", indices.dtype, TypeError)
    if indices.device != q.device:
        _fail("indices", f"device {q.device} (that of q)", indices.device)
    lead = q.shape[:-2]
    if any(s < 1 for s in lead):
        _fail("q", "at least one token", f"shape {tuple(q.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.shape[:-2] != lead:
            _fail(name, f"leading dims {tuple(lead)} (those of q)", f"shape {tuple(x.shape)}")
    D = q.shape[-1]
    _check_dim("q", D)
    if k.shape != v.shape or k.shape[-1] != D:
        _fail("k", f"k and v of one shape with head dim {D}", f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if indices.dim() != rank or indices.shape[-1] < 1 or indices.shape[-1] > MAX_TOPK:
        _fail("indices", f"a {rank}-dim tensor with 1..{MAX_TOPK} slots", f"shape {tuple(indices.shape)}")
    hi = indices.shape[1] if rank == 4 else indices.shape[0]
    tok = (indices.shape[0], indices.shape[2]) if rank == 4 else (indices.shape[1],)
    if tok != tuple(lead):
        _fail("indices", f"token dims {tuple(lead)} (those of q)", f"shape {tuple(indices.shape)}")
    _check_heads(q.shape[-2], k.shape[-2], hi, None, "indices")
    _check_option("block_size", block_size, BLOCK_SIZES)
    _require_kernel("sparse_fwd", q)
    scale = _scale("softmax_scale", softmax_scale, D)
    det = _deterministic(deterministic)
    if rank == 3:
        _check_varlen(cu_seqlens, max_seqlen, q, q.shape[0])
        out, lse = ops.sparse_fwd(q, k, v, indices.contiguous(), cu_seqlens, max_seqlen, block_size, scale, det)
        return (out, lse) if return_lse else out
    B, N = lead
    flat = [_flat(x) for x in (q, k, v)]
    idx = indices.permute(1, 0, 2, 3).reshape(hi, B * N, indices.shape[-1])
    out, lse = ops.sparse_fwd(*flat, idx, None, N, block_size, scale, det)
    out = out.view(B, N, *out.shape[1:])
    return (out, lse.view(-1, B, N).permute(1, 0, 2)) if return_lse else out


def validate_cu_seqlens(cu_seqlens, max_seqlen, total_tokens):
    """Check `cu_seqlens` as the varlen ops do (SPEC 7) and, on CUDA, remember the values read.

    The CUDA ops read cu_seqlens on the host to check it; the values are remembered per tensor version,
    so later calls on the same unchanged tensor read nothing back. That read cannot happen while a CUDA
    graph is being captured: call this on the tensor you will capture with (or run the step once
    eagerly) before `torch.cuda.graph`. Values written into it afterwards are not checked on replay.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail("cu_seqlens", "an int32 tensor", type(cu_seqlens).__name__, TypeError)
    _check_varlen(cu_seqlens, max_seqlen, cu_seqlens)
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 0:
        _fail("total_tokens", "an int >= 0", repr(total_tokens), TypeError)
    if cu_seqlens.is_cuda:
        _check_values_cuda(cu_seqlens, max_seqlen, total_tokens)
    else:
        _require_kernel("validate_cu_seqlens", cu_seqlens)
        ops.validate_cu_seqlens(cu_seqlens, total_tokens, max_seqlen)
