"""The public API (docs/SPEC.md section 6): argument checks with clear errors, defaults, layouts.

Batched tensors (B, N, H, D) are the equal-length case of the packed layout (T = B*N, H, D): they are
viewed as packed with cu_seqlens = [0, N, 2N, ...] and the ops see one layout only.

Queries may be a suffix of the keys (docs/semantics.md): q-side tensors (q, q_idx) of N_q (or T_q) rows,
k-side ones (k, v, k_idx) of N_k >= N_q (or T_k, split by cu_seqlens_k); each sequence's queries are its
last len_q positions, causal aligned bottom-right as in flash-attn. The ops then take the key layout as
(cu_seqlens_k, max_seqlen_k); where it is the queries' layout they take none, as before.
"""
from __future__ import annotations

import math
import numbers
import re
import sys

import torch

from ._op_checks import MAX_TOPK, _fail, check_heads as _check_heads, is_int
from ._ops import MsaFunction, eager_autograd_applies, has_cuda_kernel, ops

HEAD_DIMS = (64, 128)
BLOCK_SIZES = (64, 128)
GPU_DTYPES = (torch.bfloat16, torch.float16)
# The CPU path also takes fp32/fp64 (debugging, gradcheck); the CUDA kernels take bf16/fp16.
CPU_DTYPES = GPU_DTYPES + (torch.float32, torch.float64)


def _check_tensor(name, x, rank, layout):
    if not isinstance(x, torch.Tensor):
        _fail(name, "a torch.Tensor", type(x).__name__, TypeError)
    if x.dim() != rank:
        _fail(name, f"a {rank}-dim tensor {layout}", f"shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        _fail(name, "a contiguous last dim (stride(-1) == 1)", f"stride {x.stride()}")


def _check_common(named, rank, layout):
    """Rank, last-dim contiguity, one device (CPU or CUDA), one dtype out of the supported ones. Under
    torch.autocast on the tensors' device (CUDA or CPU) the ops cast every floating input to the autocast dtype
    (msa/_ops.py), so there any floating dtype, mixed, is accepted, as torch's attention accepts it."""
    for name, x in named:
        _check_tensor(name, x, rank, layout)
    name0, x0 = named[0]
    if x0.device.type not in ("cpu", "cuda"):
        _fail(name0, "a CPU or CUDA tensor", x0.device)
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


def _int(name, value, expected):
    """value as a Python int: an int, or another integral number (a NumPy integer); not a bool. An int comes back
    as it is (under torch.compile it may be a SymInt, which int() would specialise)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if is_int(value):
        return int(value)
    _fail(name, expected, repr(value), TypeError)


def _flag(name, value, expected="a bool"):
    """A bool option (a NumPy bool too): a string or a tensor here is a mistake, not a truth value.
    NumPy scalars (here and in _int, _scale) are taken in eager mode; torch.compile traces them as arrays,
    so compiled code passes Python numbers."""
    if isinstance(value, bool):
        return value
    np = sys.modules.get("numpy")  # a NumPy bool can only come from a loaded NumPy
    if np is not None and isinstance(value, np.bool_):
        return bool(value)
    _fail(name, expected, repr(value), TypeError)


def _check_option(name, value, allowed):
    value = _int(name, value, f"an int in {allowed}")
    if value not in allowed:
        _fail(name, f"one of {tuple(allowed)}", value)
    return value


def _check_dim(name, d):
    if d not in HEAD_DIMS:
        _fail(name, f"head dim in {HEAD_DIMS}", d)


def _scale(name, value, d):
    if value is None:
        return 1.0 / math.sqrt(d)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        _fail(name, "a finite float or None", repr(value), TypeError)
    return float(value)


def _require_kernel(op, x, name="q"):
    if x.device.type == "cuda" and not has_cuda_kernel(op):
        raise NotImplementedError(
            f"msa: this build has no CUDA kernel for msa::{op} (built without CUDA, or the kernel is not "
            f"written yet: see the support matrix in README.md). Tensors on the CPU use the reference path.")
    if x.device.type not in ("cpu", "cuda"):
        _fail(name, "a CPU or CUDA tensor", x.device)


def _deterministic(value):
    """deterministic=None follows torch.use_deterministic_algorithms."""
    if value is None:
        return torch.are_deterministic_algorithms_enabled()
    return _flag("deterministic", value, "a bool or None")


def _flat(x):
    """(B, N, H, D) -> (B * N, H, D): a view where the strides allow it (slices of a fused QKV projection
    keep theirs), else one copy (e.g. a transposed (B, H, N, D) tensor seen as (B, N, H, D))."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _check_lead(q, k, rank, others, names=("q", "k")):
    """Leading dims: the q-side and k-side tensors each agree among themselves; batched, k has q's batch and
    N_k >= N_q (the queries are the last N_q positions); packed, T_k is checked against cu_seqlens_k.
    names: what the caller calls q and k (select_blocks: q_idx, k_idx)."""
    lead, lead_k = q.shape[:-2], k.shape[:-2]
    if any(s < 1 for s in lead):
        _fail(names[0], "at least one token" + (" and batch >= 1" if rank == 4 else ""), f"shape {tuple(q.shape)}")
    if any(s < 1 for s in lead_k):
        _fail(names[1], "at least one token" + (" and batch >= 1" if rank == 4 else ""), f"shape {tuple(k.shape)}")
    if rank == 4 and (lead_k[0] != lead[0] or lead_k[1] < lead[1]):
        _fail(names[1], f"leading dims (B, N_k) with B = {lead[0]} and N_k >= N_q = {lead[1]} (those of {names[0]}: "
                        f"the queries are the last N_q positions)", f"shape {tuple(k.shape)}")
    for name, x, side in others:
        want, whose = (lead, "q") if side == "q" else (lead_k, "k")
        if x.shape[:-2] != want:
            _fail(name, f"leading dims {tuple(want)} (those of {whose})", f"shape {tuple(x.shape)}")


def _check_msa_inputs(q, k, v, q_idx, k_idx, rank, topk, block_size):
    layout = "(B, N, H, D)" if rank == 4 else "(T, H, D)"
    _check_common([("q", q), ("k", k), ("v", v), ("q_idx", q_idx), ("k_idx", k_idx)], rank, layout)
    _check_lead(q, k, rank, (("v", v, "k"), ("q_idx", q_idx, "q"), ("k_idx", k_idx, "k")))
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
    block_size = _check_option("block_size", block_size, BLOCK_SIZES)
    return _check_option("topk", topk, range(1, MAX_TOPK + 1)), block_size


def _check_varlen(cu_seqlens, max_seqlen, x, total=None, side=""):
    """cu_seqlens' type, dtype, shape and device and max_seqlen >= 1 (returned as an int); on CUDA the values
    too, through the compiled module, where total (the tensors' T) is given."""
    _check_cu_seqlens(cu_seqlens, x.device, "cu_seqlens" + side)
    max_seqlen = _int("max_seqlen" + side, max_seqlen, "an int")
    if max_seqlen < 1 or max_seqlen >= 2 ** 31:  # the kernels take it as an int (offsets are int32 anyway)
        _fail("max_seqlen" + side, "an int in [1, 2^31)", max_seqlen)
    if total is not None and cu_seqlens.is_cuda and not torch.compiler.is_compiling():
        _check_values_cuda(cu_seqlens, max_seqlen, total)
    return max_seqlen


def _check_batched(max_seqlen, name0):
    """The batched layout takes N from the tensors: a max_seqlen without cu_seqlens is a mistake."""
    if max_seqlen is not None:
        _fail("max_seqlen", f"None in the batched layout (N is {name0}.shape[1]; packed tensors take cu_seqlens)",
              repr(max_seqlen), TypeError)


_VALUE_ERROR = re.compile(r"(cu_seqlens|max_seqlen)(_k)?: expected")


def _check_values_cuda(cu_seqlens, max_seqlen, total):
    """The values of a CUDA cu_seqlens are checked by the compiled op (csrc/api/cu_seqlens.cpp), which
    remembers them per tensor version, so the ops that follow read nothing back. A check in the compiled
    module can only raise RuntimeError (it is built on PyTorch's stable ABI); here the ones about the
    values become the ValueError of SPEC 7. (Under torch.compile the ops' own RuntimeError is raised.)"""
    _require_kernel("validate_cu_seqlens", cu_seqlens, "cu_seqlens")
    _value_errors(ops.validate_cu_seqlens, cu_seqlens, total, max_seqlen)


def _value_errors(op, *args):
    """op(*args), its RuntimeError about cu_seqlens / max_seqlen values raised as SPEC 7's ValueError."""
    try:
        return op(*args)
    except RuntimeError as e:
        m = _VALUE_ERROR.search(str(e))
        if m is None:
            raise
        raise ValueError(str(e)[m.start():]) from None


def _values_checked(op, *args):
    """op(*args) for ops given a key layout: the compiled module checks cu_seqlens_k's values against the
    queries' (same S, len_k >= len_q) where it reads them; in eager mode its RuntimeError about those values
    becomes SPEC 7's ValueError, as in _check_values_cuda."""
    return op(*args) if torch.compiler.is_compiling() else _value_errors(op, *args)


def _check_cu_seqlens(cu_seqlens, device, name="cu_seqlens"):
    """Type, dtype, shape and device of a cu_seqlens (its values are checked by the ops)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail(name, "an int32 tensor", type(cu_seqlens).__name__, TypeError)
    if cu_seqlens.dtype != torch.int32:
        _fail(name, "dtype torch.int32", cu_seqlens.dtype, TypeError)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        _fail(name, "shape (S+1,) with S >= 1", tuple(cu_seqlens.shape))
    if cu_seqlens.device != device:
        _fail(name, f"device {device} (that of q)", cu_seqlens.device)


def _key_layout(q, k, cu_seqlens, cu_seqlens_k, max_seqlen_k, names=("q", "k")):
    """The ops' trailing (cu_seqlens_k, max_seqlen_k): () where the keys have the queries' layout, else the
    key layout (batched: None and N_k)."""
    if cu_seqlens is None:  # batched (B, N, H, D): N_k >= N_q checked by _check_lead
        for name, value in (("cu_seqlens_k", cu_seqlens_k), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                _fail(name, f"None in the batched layout (N_k is {names[1]}.shape[1])", "a value", TypeError)
        layout = () if k.shape[1] == q.shape[1] else (None, k.shape[1])
    elif cu_seqlens_k is None:
        if max_seqlen_k is not None:
            _fail("max_seqlen_k", "None without cu_seqlens_k", repr(max_seqlen_k), TypeError)
        if k.shape[0] != q.shape[0]:
            _fail(names[1], f"T = {q.shape[0]} rows (those of {names[0]}; keys of another layout need cu_seqlens_k)",
                  f"shape {tuple(k.shape)}")
        layout = ()
    else:
        if max_seqlen_k is None:
            _fail("max_seqlen_k", "an int with cu_seqlens_k", "None", TypeError)
        max_seqlen_k = _check_varlen(cu_seqlens_k, max_seqlen_k, k, side="_k")
        # Equal offsets in another tensor: the ops find that themselves (csrc/api/cu_seqlens.cpp takes the square
        # path), so nothing is read back here.
        layout = () if cu_seqlens_k is cu_seqlens and k.shape[0] == q.shape[0] else (cu_seqlens_k, max_seqlen_k)
    return layout


INDEX_DTYPES = (None, torch.float8_e4m3fn)


def _index_dtype(value):
    if value not in INDEX_DTYPES:  # torch dtypes compare by identity; anything else is not one of them
        _fail("index_dtype", "None or torch.float8_e4m3fn", repr(value), TypeError if not isinstance(
            value, torch.dtype) else ValueError)
    return value


def fp8_index_copies(q_idx, k_idx, cu_seqlens_k=None):
    """The e4m3 copies of (q_idx, k_idx) that the selection scores with index_dtype=torch.float8_e4m3fn (SPEC 2):
    each value times a power of two, rounded to nearest. The scale of a q_idx (token, head) row is the largest power
    of two that keeps the row's largest |value| within 16 (so that a Di <= 128 dot product of two copies stays within
    f16's range: the Hopper FP8 top-k accumulates in f16); that of k_idx is the same per (sequence, head):
    (B, N, H, Di) per batch element, packed (T, H, Di) per sequence of `cu_seqlens_k`, (T, H, Di) without it as one
    sequence. A row's order of blocks depends on neither scale (the keys it compares share one), and rounding
    commutes with them: each value keeps e4m3's 4 significant bits, rounded to nearest, whatever the power of two,
    except those that scale below e4m3's normal range (2^-6; about 2^-10 of their row's / head's largest: subnormal,
    about 2^-14: zero). So one sequence's copies do not depend on the others of the batch; an outlier key does
    coarsen its own sequence's small keys. Zero rows stay zero. One opaque op (msa::fp8_index_copies), no host
    synchronisation."""
    _check_tensor("q_idx", q_idx, q_idx.dim(), "(..., H, Di)")
    _check_tensor("k_idx", k_idx, k_idx.dim(), "(..., H, Di)")
    return ops.fp8_index_copies(q_idx.detach(), k_idx.detach(), cu_seqlens_k)


def _fp8_selection(q_idx, k_idx, cu_seqlens, max_seqlen, key_layout):
    """fp8_index_copies of the ops' flat (T, H, Di) index tensors, k per sequence: the key layout's cu_seqlens_k,
    else the queries' cu_seqlens, else (batched) T / max_seqlen sequences of equal length."""
    if cu_seqlens is not None:
        return fp8_index_copies(q_idx, k_idx, key_layout[0] if key_layout else cu_seqlens)
    B = q_idx.shape[0] // max_seqlen
    q8, k8 = fp8_index_copies(q_idx, k_idx.view(B, k_idx.shape[0] // B, *k_idx.shape[1:]))
    return q8, k8.view(k_idx.shape)


def _msa(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, softmax_scale, index_scale, warmup,
         return_indices, deterministic, key_layout=(), index_dtype=None):
    _require_kernel("msa_fwd", q)
    scale = _scale("softmax_scale", softmax_scale, q.shape[-1])
    iscale = _scale("index_scale", index_scale, q_idx.shape[-1])
    warmup = _flag("warmup", warmup)
    return_indices = _flag("return_indices", return_indices)
    # The KL's index gradient is computed with the KL itself when autograd will ask for it (SPEC 4).
    index_grad = torch.is_grad_enabled() and (q_idx.requires_grad or k_idx.requires_grad)
    # The selection's own e4m3 inputs (index_dtype), where a selection runs; after the key layout's two slots.
    sel = ()
    if _index_dtype(index_dtype) is not None and (return_indices or not warmup):
        sel = (*(tuple(key_layout) or (None, None)),
               *_fp8_selection(q_idx, k_idx, cu_seqlens, max_seqlen, key_layout))
    args = (q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, scale, iscale, warmup,
            return_indices, index_grad, _deterministic(deterministic), *(sel or key_layout))
    if eager_autograd_applies((q, k, v, q_idx, k_idx)):
        return _value_errors(MsaFunction.apply, *args)
    return _values_checked(ops.msa_fwd, *args)


def msa_attention(q, k, v, q_idx, k_idx, *, topk=16, block_size=128, softmax_scale=None, index_scale=None,
                  warmup=False, return_indices=False, deterministic=None, index_dtype=None):
    """MiniMax Sparse Attention, causal, batched layout.

    Args:
        q: (B, N, Hq, D) main queries; k, v: (B, N, Hkv, D) main keys/values (GQA).
        q_idx: (B, N, Hi, Di) index queries, one head per index group; k_idx: (B, N, Hki, Di) index keys.
            The key side (k, v, k_idx) may hold N_k > N queries' rows: the queries are then the last N
            positions (causal aligned bottom-right, as flash-attn; chunked prefill, context parallelism).
        topk: blocks selected per (token, index group), the token's own block included (1..32).
        block_size: tokens per kv block (64 or 128).
        softmax_scale, index_scale: default 1/sqrt(D) and 1/sqrt(Di).
        warmup: dense causal main attention, KL over the full causal set (SPEC 5).
        return_indices: also return the selection, int32 (B, Hi, N, topk), ascending, -1 padded.
        deterministic: bitwise reproducible gradients (None: torch.are_deterministic_algorithms_enabled()).
        index_dtype: None, or torch.float8_e4m3fn: the selection scores e4m3 copies of q_idx / k_idx
            (`fp8_index_copies`): the FP8 tensor cores on Hopper at Di = 128 (whose accumulation keeps fewer bits
            than fp32), elsewhere the same values widened to bf16 (fp32 sums). The KL, its lse_idx and the index
            gradients stay exact in the inputs' dtype (docs/semantics.md).

    Returns:
        (out, kl) or (out, kl, indices). out: (B, N, Hq, D) in the input dtype, differentiable in q, k, v.
        kl: fp32 0-dim tensor, the exact KL(P || Pidx) averaged over B*N*Hi rows, differentiable in
        q_idx, k_idx only (the teacher P is detached).
    """
    topk, block_size = _check_msa_inputs(q, k, v, q_idx, k_idx, 4, topk, block_size)
    B, N = q.shape[:2]
    layout = _key_layout(q, k, None, None, None)
    flat = [_flat(x) for x in (q, k, v, q_idx, k_idx)]
    out, kl, indices = _msa(*flat, None, N, topk, block_size, softmax_scale, index_scale, warmup, return_indices,
                            deterministic, layout, index_dtype)[:3]
    out = out.view(B, N, *out.shape[1:])
    if not return_indices:
        return out, kl
    Hi = q_idx.shape[2]
    return out, kl, indices.view(Hi, B, N, topk).permute(1, 0, 2, 3).contiguous()


def msa_attention_varlen(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, *, cu_seqlens_k=None, max_seqlen_k=None,
                         topk=16, block_size=128, softmax_scale=None, index_scale=None, warmup=False,
                         return_indices=False, deterministic=None, index_dtype=None):
    """MiniMax Sparse Attention on packed sequences (flash-attn's thd layout).

    Same as `msa_attention` with tensors (T, H, D) and `cu_seqlens` int32 (S+1,) giving each sequence's
    first token (cu_seqlens[0] = 0, cu_seqlens[-1] = T, non-decreasing; empty sequences are allowed).
    Every sequence is independent and its blocks start at its own first token. `max_seqlen` must be
    >= the longest sequence. indices, when returned, are (Hi, T, topk); kl averages over T*Hi rows.

    `cu_seqlens` / `max_seqlen` describe the queries (flash-attn's cu_seqlens_q / max_seqlen_q). Keys of
    another layout (T_k rows of k, v, k_idx) take `cu_seqlens_k` / `max_seqlen_k`: the same number of
    sequences, len_k >= len_q in each, whose queries are its last len_q positions (causal aligned
    bottom-right); dk, dv, dk_idx cover all T_k rows. None: the keys have the queries' layout.
    """
    topk, block_size = _check_msa_inputs(q, k, v, q_idx, k_idx, 3, topk, block_size)
    max_seqlen = _check_varlen(cu_seqlens, max_seqlen, q, q.shape[0])
    layout = _key_layout(q, k, cu_seqlens, cu_seqlens_k, max_seqlen_k)
    out, kl, indices = _msa(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, softmax_scale,
                            index_scale, warmup, return_indices, deterministic, layout, index_dtype)[:3]
    return (out, kl, indices) if return_indices else (out, kl)


def select_blocks(q_idx, k_idx, *, topk=16, block_size=128, index_scale=None, cu_seqlens=None, max_seqlen=None,
                  cu_seqlens_k=None, max_seqlen_k=None, index_dtype=None):
    """The index branch alone (SPEC 2): int32 selected blocks, ascending, -1 padded.

    Batched (B, N, Hi, Di) / (B, N, Hki, Di) inputs give (B, Hi, N, topk). Packed (T, H, Di) inputs with
    `cu_seqlens` and `max_seqlen` give (Hi, T, topk). Not differentiable. k_idx may cover more positions
    than q_idx (N_k > N, or `cu_seqlens_k` / `max_seqlen_k`): the queries are then the last positions,
    as in `msa_attention_varlen`. index_dtype: as in `msa_attention`.
    """
    rank = 3 if cu_seqlens is not None else 4
    layout = "(B, N, H, Di)" if rank == 4 else "(T, H, Di)"
    _check_common([("q_idx", q_idx), ("k_idx", k_idx)], rank, layout)
    _check_lead(q_idx, k_idx, rank, (), ("q_idx", "k_idx"))
    Di = q_idx.shape[-1]
    _check_dim("q_idx", Di)
    if k_idx.shape[-1] != Di:
        _fail("k_idx", f"head dim Di={Di} (that of q_idx)", k_idx.shape[-1])
    if q_idx.shape[-2] % k_idx.shape[-2]:
        _fail("k_idx", f"an index-key head count dividing Hi={q_idx.shape[-2]}", k_idx.shape[-2])
    block_size = _check_option("block_size", block_size, BLOCK_SIZES)
    topk = _check_option("topk", topk, range(1, MAX_TOPK + 1))
    _require_kernel("select_blocks", q_idx)
    iscale = _scale("index_scale", index_scale, Di)
    fp8 = _index_dtype(index_dtype) is not None
    if rank == 3:
        max_seqlen = _check_varlen(cu_seqlens, max_seqlen, q_idx, q_idx.shape[0])
        key = _key_layout(q_idx, k_idx, cu_seqlens, cu_seqlens_k, max_seqlen_k, ("q_idx", "k_idx"))
        if fp8:
            q_idx, k_idx = _fp8_selection(q_idx, k_idx, cu_seqlens, max_seqlen, key)
        return _values_checked(ops.select_blocks, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, iscale, *key)
    _check_batched(max_seqlen, "q_idx")
    B, N, Hi = q_idx.shape[:3]
    key = _key_layout(q_idx, k_idx, None, cu_seqlens_k, max_seqlen_k, ("q_idx", "k_idx"))
    q_idx, k_idx = _flat(q_idx), _flat(k_idx)
    if fp8:
        q_idx, k_idx = _fp8_selection(q_idx, k_idx, None, N, key)
    idx = ops.select_blocks(q_idx, k_idx, None, N, topk, block_size, iscale, *key)
    return idx.view(Hi, B, N, topk).permute(1, 0, 2, 3).contiguous()


def sparse_attention(q, k, v, indices, *, block_size=128, softmax_scale=None, return_lse=False, cu_seqlens=None,
                     max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None, deterministic=None):
    """The main branch alone (SPEC 3): causal attention over the tokens of the given blocks.

    Batched: q (B, N, Hq, D), k/v (B, N, Hkv, D), indices int32 (B, Hi, N, topk) as `select_blocks`
    returns them (query head h uses index group h // (Hq/Hi)); lse is (B, Hq, N). Packed: (T, H, D)
    tensors, indices (Hi, T, topk), `cu_seqlens`/`max_seqlen` as in `msa_attention_varlen`; lse (Hq, T).
    Entries < 0 or beyond the token's own block select nothing; repeats count once. A row that attends
    to nothing gets out = 0 and lse = -inf. Differentiable in q, k, v; `deterministic` as in
    `msa_attention`. k, v may cover more positions than q (N_k > N, or `cu_seqlens_k` / `max_seqlen_k`):
    the queries are then the last positions, as in `msa_attention_varlen`.
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
    _check_lead(q, k, rank, (("v", v, "k"),))
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
    block_size = _check_option("block_size", block_size, BLOCK_SIZES)
    return_lse = _flag("return_lse", return_lse)
    _require_kernel("sparse_fwd", q)
    scale = _scale("softmax_scale", softmax_scale, D)
    det = _deterministic(deterministic)
    if rank == 3:
        max_seqlen = _check_varlen(cu_seqlens, max_seqlen, q, q.shape[0])
        key = _key_layout(q, k, cu_seqlens, cu_seqlens_k, max_seqlen_k)
        out, lse = _values_checked(ops.sparse_fwd, q, k, v, indices.contiguous(), cu_seqlens, max_seqlen, block_size,
                                   scale, det, *key)
        return (out, lse) if return_lse else out
    _check_batched(max_seqlen, "q")
    B, N = lead
    key = _key_layout(q, k, None, cu_seqlens_k, max_seqlen_k)
    flat = [_flat(x) for x in (q, k, v)]
    idx = indices.permute(1, 0, 2, 3).reshape(hi, B * N, indices.shape[-1])
    out, lse = ops.sparse_fwd(*flat, idx, None, N, block_size, scale, det, *key)
    out = out.view(B, N, *out.shape[1:])
    return (out, lse.view(-1, B, N).permute(1, 0, 2)) if return_lse else out


def validate_cu_seqlens(cu_seqlens, max_seqlen, total_tokens):
    """Check `cu_seqlens` as the varlen ops do (SPEC 7) and, on CUDA, remember the values read.

    The CUDA ops read cu_seqlens on the host to check it; the values are remembered per tensor version,
    so later calls on the same unchanged tensor read nothing back. That read cannot happen while a CUDA
    graph is being captured: call this on the tensor you will capture with (or run the step once
    eagerly) before `torch.cuda.graph`. Values written into it afterwards are not checked on replay. With
    keys of another layout, validate `cu_seqlens_k` the same way (with `max_seqlen_k` and T_k).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail("cu_seqlens", "an int32 tensor", type(cu_seqlens).__name__, TypeError)
    max_seqlen = _check_varlen(cu_seqlens, max_seqlen, cu_seqlens)
    total_tokens = _int("total_tokens", total_tokens, "an int >= 0")
    if total_tokens < 0:
        _fail("total_tokens", "an int >= 0", total_tokens)
    if cu_seqlens.is_cuda:
        _check_values_cuda(cu_seqlens, max_seqlen, total_tokens)
    else:
        _require_kernel("validate_cu_seqlens", cu_seqlens, "cu_seqlens")
        ops.validate_cu_seqlens(cu_seqlens, total_tokens, max_seqlen)
