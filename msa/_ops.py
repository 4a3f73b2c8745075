"""torch.ops.msa: CPU kernels (the reference), fake kernels and autograd for the C++ schemas.

The schemas live in csrc/torch_bindings.cpp; CUDA kernels register in csrc/api. Everything here is
registered once, at import.
"""
from __future__ import annotations


from typing import Optional

import torch

from . import _op_checks as chk
from . import reference as ref
from ._op_checks import FP8_DTYPES

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


# The ops with a compiled CUDA kernel, read once: the kernels register when _C loads, and a lookup in
# a set is traceable by torch.compile (the dispatcher query itself is not).
_CUDA_OPS = frozenset(name for name in ("select_blocks", "sparse_fwd", "sparse_bwd", "msa_fwd", "msa_bwd",
                                        "reverse_index", "validate_cu_seqlens", "device_config", "_fp8_copies_cuda")
                      if torch._C._dispatch_has_kernel_for_dispatch_key(f"msa::{name}", "CUDA"))


def has_cuda_kernel(name: str) -> bool:
    """Whether op `name` has a compiled CUDA kernel in this build."""
    return name in _CUDA_OPS


def _seqs(cu_seqlens, total: int, max_seqlen: int, side: str = "") -> torch.Tensor:
    """The CPU twin of csrc/api/cu_seqlens.cpp::seq_map: a checked cu_seqlens, or for None (the batched
    layout) the offsets of T / max_seqlen sequences of max_seqlen tokens. side "_k": the keys' arguments
    (cu_seqlens_k, max_seqlen_k, T_k), as the messages name them."""
    cu_name, mx_name, t_name = f"cu_seqlens{side}", f"max_seqlen{side}", f"T{side}"
    if cu_seqlens is None:
        if max_seqlen < 1 or total % max_seqlen:
            raise ValueError(f"{mx_name}: without {cu_name} (the batched layout) expected a divisor of {t_name} = "
                             f"{total}, got {max_seqlen}")
        return torch.arange(0, total + 1, max_seqlen, dtype=torch.int32)
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{cu_name}: expected int32 of shape (S+1,) with S >= 1, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"{cu_name}: expected {cu_name}[0] == 0, got {cu[0]}")
    for s in range(1, len(cu)):
        if cu[s] < cu[s - 1]:
            raise ValueError(f"{cu_name}: expected non-decreasing offsets, got {cu[s - 1]} then {cu[s]} at "
                             f"position {s}")
    if cu[-1] != total:
        raise ValueError(f"{cu_name}: expected {cu_name}[-1] == {t_name} = {total}, got {cu[-1]}")
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    if max_seqlen < longest:
        raise ValueError(f"{mx_name}: expected >= the longest sequence ({longest}), got {max_seqlen}")
    return cu_seqlens


def _seqs_k(cu_q, cu_seqlens_k, total_k: int, max_seqlen_k) -> torch.Tensor | None:
    """The key-side sequences (None: the query layout, which then must cover the same T). With a key
    layout: as many sequences as the queries', each with len_q <= len_k (the queries are the last len_q
    positions of their sequence, docs/semantics.md)."""
    if cu_seqlens_k is None and max_seqlen_k is None:
        if total_k != int(cu_q[-1]):
            raise ValueError(f"k: expected T = {int(cu_q[-1])} rows (those of q; cu_seqlens_k gives keys of "
                             f"another layout), got {total_k}")
        return None
    if max_seqlen_k is None:
        raise ValueError("max_seqlen_k: expected an int with cu_seqlens_k, got None")
    cu_k = _seqs(cu_seqlens_k, total_k, max_seqlen_k, side="_k")
    lq, lk = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    if len(lq) != len(lk):
        raise ValueError(f"cu_seqlens_k: expected {len(lq)} sequences (those of the queries), got {len(lk)}")
    for s, (a, b) in enumerate(zip(lq, lk)):
        if a > b:
            raise ValueError(f"cu_seqlens_k: expected len_k >= len_q in every sequence (the queries are the last "
                             f"len_q of its positions), got len_q = {a} > len_k = {b} in sequence {s}")
    return cu_k


def _check_msa(q, k, v, q_idx, k_idx):
    """msa_fwd / msa_bwd's five inputs: the main and index branches' shapes and dtypes, and their head groups."""
    chk.qkv(q, k, v)
    if q_idx.dtype != q.dtype:
        chk._fail("q_idx", f"dtype {q.dtype} (that of q)", q_idx.dtype)
    chk.index_qk(q_idx, k_idx, q.shape[0], k.shape[0])
    chk.check_heads(q.shape[1], k.shape[1], q_idx.shape[1], None)


# ----------------------------------------------------------------------------------------------
# CPU kernels
# ----------------------------------------------------------------------------------------------
def _no_autocast(fn):
    """The CPU kernels are PyTorch code: its fp32/fp64 accumulation must not be autocast itself (a
    backward called inside an autocast region runs them there)."""
    import functools

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)
    return run


@torch.library.register_kernel("msa::select_blocks", "cpu")
@_no_autocast
def _select_blocks_cpu(q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, index_scale, cu_seqlens_k=None,
                       max_seqlen_k=None):
    chk.index_qk(q_idx, k_idx, q_idx.shape[0], k_idx.shape[0])
    chk.topk(topk)
    chk.block_size(block_size)
    cu = _seqs(cu_seqlens, q_idx.shape[0], max_seqlen)
    cu_k = _seqs_k(cu, cu_seqlens_k, k_idx.shape[0], max_seqlen_k)
    return ref.select_blocks(q_idx, k_idx, cu, topk, block_size, index_scale, cu_k)


def fp8_copies_torch(q_idx, k_idx, cu_seqlens_k=None):
    """The e4m3 copies of (q_idx, k_idx) (msa.fp8_index_copies has the rule) in PyTorch ops: q_idx (..., H, Di) per
    row; k_idx (B, N, H, Di) per (batch element, head), (T, H, Di) per (sequence of cu_seqlens_k, head), or per head
    without cu_seqlens_k. No host synchronisation (CUDA-graph safe)."""
    tiny = torch.finfo(torch.float32).tiny

    def pow2_scale(amax):  # 2^s, the largest with amax 2^s <= 16 = 0.5 * 2^5 (frexp: exact on every device)
        m, e = torch.frexp(amax.float().clamp_min(tiny))
        s = torch.where(m <= 0.5, 5 - e, 4 - e).clamp(-126, 126)
        return torch.ldexp(torch.ones_like(m), s)

    def rounded(x, scale):  # x * 2^s is exact in bf16 / fp32 / fp64 (fp16's range is too small: fp32 then)
        work = x.dtype if x.dtype in (torch.bfloat16, torch.float32, torch.float64) else torch.float32
        return (x.to(work) * scale.to(work)).to(torch.float8_e4m3fn).contiguous()

    q, k = q_idx.detach(), k_idx.detach()
    lo, hi = torch.aminmax(q, dim=-1, keepdim=True)
    q8 = rounded(q, pow2_scale(torch.maximum(hi, -lo)))
    row_max = k.abs().amax(-1)  # (..., H)
    if cu_seqlens_k is not None and k.dim() == 3:
        T, H = row_max.shape
        seq = torch.searchsorted(cu_seqlens_k[1:].long(), torch.arange(T, device=k.device), right=True)
        per_seq = torch.zeros(cu_seqlens_k.shape[0] - 1, H, dtype=row_max.dtype, device=k.device)
        per_seq = per_seq.scatter_reduce(0, seq[:, None].expand(T, H), row_max, "amax")
        amax = per_seq[seq]  # (T, H): each token's sequence's maximum
    else:  # 4 dims: per batch element; 3 dims: one sequence
        amax = row_max.amax(dim=tuple(range(1 if k.dim() == 4 else 0, k.dim() - 2)), keepdim=True)
    return q8, rounded(k, pow2_scale(amax)[..., None])


# One opaque op (not traced into): Inductor would otherwise lower its float8 cast to Triton, which GPUs below sm_89
# refuse; and a fused CUDA kernel can replace its CUDA implementation without changing callers.
@torch.library.custom_op("msa::fp8_index_copies", mutates_args=())
def _fp8_index_copies_op(q_idx: torch.Tensor, k_idx: torch.Tensor,
                         cu_seqlens_k: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    # The fused kernel (two launches; the same bytes for finite inputs) where its checks hold, else the formula, which
    # takes any dtype of cu_seqlens_k and a NaN into the scale as torch's max does (the kernel's fmaxf drops it).
    cu_ok = cu_seqlens_k is None or k_idx.dim() == 4 or (
        cu_seqlens_k.device == q_idx.device and cu_seqlens_k.dtype == torch.int32 and cu_seqlens_k.dim() == 1
        and cu_seqlens_k.is_contiguous())
    if (q_idx.is_cuda and k_idx.device == q_idx.device and q_idx.dtype in (torch.bfloat16, torch.float16)
            and k_idx.dtype == q_idx.dtype and q_idx.dim() >= 2 and q_idx.shape[-1] in (64, 128)
            and k_idx.shape[-1] == q_idx.shape[-1] and k_idx.dim() in (3, 4) and cu_ok
            and has_cuda_kernel("_fp8_copies_cuda")):
        q, k = q_idx.reshape(-1, *q_idx.shape[-2:]), k_idx.reshape(-1, *k_idx.shape[-2:])
        seq_len = k_idx.shape[1] if k_idx.dim() == 4 else k.shape[0]  # batched: per batch element
        q8, k8 = ops._fp8_copies_cuda(q, k, cu_seqlens_k if k_idx.dim() == 3 else None, max(seq_len, 1))
        return q8.view(q_idx.shape), k8.view(k_idx.shape)
    with torch.autocast(q_idx.device.type, enabled=False):
        return fp8_copies_torch(q_idx, k_idx, cu_seqlens_k)


@_fp8_index_copies_op.register_fake
def _fp8_index_copies_fake(q_idx, k_idx, cu_seqlens_k=None):
    chk.one_device(q_idx, k_idx, cu_seqlens_k)
    return (q_idx.new_empty(q_idx.shape, dtype=torch.float8_e4m3fn),
            k_idx.new_empty(k_idx.shape, dtype=torch.float8_e4m3fn))


@torch.library.register_kernel("msa::sparse_fwd", "cpu")
@_no_autocast
def _sparse_fwd_cpu(q, k, v, indices, cu_seqlens, max_seqlen, block_size, softmax_scale, deterministic=False,
                    cu_seqlens_k=None, max_seqlen_k=None):
    chk.qkv(q, k, v)
    chk.indices(indices, q.shape[0], q.shape[1], k.shape[1])
    chk.block_size(block_size)
    cu = _seqs(cu_seqlens, q.shape[0], max_seqlen)
    cu_k = _seqs_k(cu, cu_seqlens_k, k.shape[0], max_seqlen_k)
    return ref.sparse_fwd(q, k, v, indices, cu, block_size, softmax_scale, cu_k)


@torch.library.register_kernel("msa::sparse_bwd", "cpu")
@_no_autocast
def _sparse_bwd_cpu(dout, q, k, v, out, lse, indices, cu_seqlens, max_seqlen, block_size, softmax_scale,
                    deterministic=False, cu_seqlens_k=None, max_seqlen_k=None):
    chk.qkv(q, k, v)
    chk.like("dout", dout, q)
    chk.like("out", out, q)
    chk.lse("lse", lse, q.shape[1], q.shape[0], q.dtype)
    chk.indices(indices, q.shape[0], q.shape[1], k.shape[1])
    chk.block_size(block_size)
    cu = _seqs(cu_seqlens, q.shape[0], max_seqlen)
    cu_k = _seqs_k(cu, cu_seqlens_k, k.shape[0], max_seqlen_k)
    return ref.sparse_bwd(dout, q, k, v, lse, indices, cu, block_size, softmax_scale, cu_k)


@torch.library.register_kernel("msa::msa_fwd", "cpu")
@_no_autocast
def _msa_fwd_cpu(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, softmax_scale, index_scale,
                 warmup, return_indices, index_grad, deterministic=False, cu_seqlens_k=None, max_seqlen_k=None,
                 sel_q_idx=None, sel_k_idx=None):
    _check_msa(q, k, v, q_idx, k_idx)
    sel = chk.sel_inputs(q_idx, k_idx, sel_q_idx, sel_k_idx)
    chk.topk(topk)
    chk.block_size(block_size)
    cu = _seqs(cu_seqlens, q.shape[0], max_seqlen)
    cu_k = _seqs_k(cu, cu_seqlens_k, k.shape[0], max_seqlen_k)
    out, kl, indices, lse, lse_idx, kl_rows = ref.msa_fwd(q, k, v, q_idx, k_idx, cu, topk, block_size, softmax_scale,
                                                          index_scale, warmup, return_indices, cu_k, sel)
    acc = ref.acc_dtype(q.dtype)
    if index_grad:  # d kl / d (q_idx, k_idx) for d_kl = 1 (SPEC 4), in the accumulation dtype
        attend = None if warmup else indices
        g_q, g_k = ref.index_kl_bwd(torch.ones((), dtype=acc), q, k, lse, q_idx, k_idx, lse_idx, attend, cu,
                                    block_size, softmax_scale, index_scale, out_dtype=acc, cu_seqlens_k=cu_k)
    else:
        g_q, g_k = torch.empty(0, dtype=acc), torch.empty(0, dtype=acc)
    return out, kl, indices, lse, lse_idx, g_q, g_k, kl_rows


@torch.library.register_kernel("msa::msa_bwd", "cpu")
@_no_autocast
def _msa_bwd_cpu(dout, dkl, q, k, v, out, lse, q_idx, k_idx, lse_idx, indices, kl_dq_idx, kl_dk_idx, cu_seqlens,
                 max_seqlen, block_size, softmax_scale, index_scale, warmup, deterministic=False, cu_seqlens_k=None,
                 max_seqlen_k=None):
    _check_msa(q, k, v, q_idx, k_idx)
    chk.block_size(block_size)
    T, Hq, Hi = q.shape[0], q.shape[1], q_idx.shape[1]
    # The index gradients: the forward's (for d_kl = 1) scaled where it computed them, else recomputed here.
    recompute = dkl is not None and not (kl_dq_idx.shape == q_idx.shape and kl_dk_idx.shape == k_idx.shape)
    if dout is not None:
        chk.like("dout", dout, q)
        chk.like("out", out, q)
    if dout is not None or recompute:
        chk.lse("lse", lse, Hq, T, q.dtype)
    if recompute:
        chk.lse("lse_idx", lse_idx, Hi, T, q.dtype)
    if not warmup:
        chk.indices(indices, T, Hq, k.shape[1])
    if dkl is not None:
        chk.d_kl(dkl)
        dkl = dkl.reshape(())
    cu = _seqs(cu_seqlens, q.shape[0], max_seqlen)
    cu_k = _seqs_k(cu, cu_seqlens_k, k.shape[0], max_seqlen_k)
    attend = None if warmup else indices
    if dout is None:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    else:
        dq, dk, dv = ref.sparse_bwd(dout, q, k, v, lse, attend, cu, block_size, softmax_scale, cu_k)
    if dkl is None:
        dq_idx, dk_idx = torch.zeros_like(q_idx), torch.zeros_like(k_idx)
    elif not recompute:
        s = dkl.to(kl_dq_idx.dtype)
        dq_idx, dk_idx = (kl_dq_idx * s).to(q_idx.dtype), (kl_dk_idx * s).to(k_idx.dtype)
    else:
        dq_idx, dk_idx = ref.index_kl_bwd(dkl, q, k, lse, q_idx, k_idx, lse_idx, attend, cu, block_size,
                                          softmax_scale, index_scale, cu_seqlens_k=cu_k)
    return dq, dk, dv, dq_idx, dk_idx


@torch.library.register_kernel("msa::reverse_index", "cpu")
@_no_autocast
def _reverse_index_cpu(indices, cu_seqlens, max_seqlen, block_size):
    chk.indices(indices)
    chk.block_size(block_size)
    cu = _seqs(cu_seqlens, indices.shape[1], max_seqlen)
    return ref.reverse_index(indices, cu, block_size)


@torch.library.register_kernel("msa::validate_cu_seqlens", "cpu")
@_no_autocast
def _validate_cu_seqlens_cpu(cu_seqlens, total_tokens, max_seqlen):
    _seqs(cu_seqlens, total_tokens, max_seqlen)


# ----------------------------------------------------------------------------------------------
# PyTorch's dense attention for the CUDA warmup path (csrc/torch_bindings.cpp: msa::_dense_fwd and
# msa::_dense_bwd): the dense main branch, and the index branch's lse_idx (its output unused). The CUDA
# msa_fwd / msa_bwd call these through the dispatcher: the aten schemas change between torch releases
# (keywords absorb that here), and the flash backward's determinism is PyTorch's global flag, which the
# compiled module (stable ABI) cannot set.
#
# Backend: cuDNN where it applies (every sequence the same length, deterministic=False, cuDNN SDPA
# enabled in torch.backends.cuda), PyTorch's flash kernel otherwise. On the H200 cuDNN's fwd+bwd is
# 1.6-1.7x faster than flash (scripts/probe_dense_backends.py), but its backward is not bitwise
# repeatable and torch 2.11's packed (ragged) cuDNN path returns wrong values, so those cases take
# flash. MSA_DENSE_BACKEND=flash (or cudnn) overrides the choice (tests, A/B runs; never under
# deterministic=True). Both return lse (H, T), the natural-log logsumexp of the scaled logits, and
# either backward takes either forward's.
# cuDNN rejects sequences of one token (s_q = s_kv = 1): those take flash too.
# A negative scale (any finite scale is allowed) gives both an infinite lse (found by tests/test_warmup_gpu.py):
# the sign folds into q, exactly ((-q) . k |scale| = q . k scale; dq = -d(-q)).
# A key layout (cu_seqlens_k, max_seqlen_k: queries that are a suffix of the keys) takes flash: its causal
# mask is aligned bottom-right where a sequence has more keys than queries (flash-attn >= 2.1), our
# convention; that of cuDNN's for s_q < s_kv is not established. The C++ callers pass a key layout only
# where it differs from the queries' (the square path's calls are unchanged).
# ----------------------------------------------------------------------------------------------
_CUDNN_FAILED: set = set()  # shapes whose cuDNN call raised: flash for them from then on (warned once)


def _shape_key(q, k, seq_len):
    return (q.device, q.dtype, seq_len, tuple(q.shape[1:]), tuple(k.shape[1:]))


def _dense_backend(q, k, seq_len, uniform, deterministic):
    """seq_len: the tokens of every sequence when uniform."""
    import os
    forced = os.environ.get("MSA_DENSE_BACKEND", "")
    if forced not in ("", "flash", "cudnn"):
        raise ValueError(f"MSA_DENSE_BACKEND: expected 'flash' or 'cudnn', got {forced!r}")
    # deterministic first: no override may trade away a repeatable backward
    if forced == "flash" or deterministic or not uniform or seq_len < 2 or _shape_key(q, k, seq_len) in _CUDNN_FAILED:
        return "flash"
    if forced == "cudnn":
        return "cudnn"
    usable = (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()
              and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"))
    return "cudnn" if usable else "flash"


def _cudnn_failed(q, k, seq_len, err):
    import warnings
    _CUDNN_FAILED.add(_shape_key(q, k, seq_len))
    warnings.warn(f"msa: cuDNN attention failed on {q.device} for q {tuple(q.shape)}, k {tuple(k.shape)} ({err}); "
                  f"the warmup path uses PyTorch's flash kernel for this shape from now on", RuntimeWarning,
                  stacklevel=4)


def _try_cudnn(call, q, k, seq_len):
    """call()'s result, or None after a cuDNN RuntimeError (warned; flash for this shape from then on). Out
    of memory is not a cuDNN limitation: it propagates, with no lasting switch to flash."""
    try:
        return call()
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:
        _cudnn_failed(q, k, seq_len, e)
        return None


def _bhnd(x, batch):
    """(T, H, D) packed rows of `batch` equal sequences as the (B, H, N, D) view cuDNN takes."""
    return x.view(batch, x.shape[0] // batch, x.shape[1], x.shape[2]).transpose(1, 2)


def _thd(x):
    """The inverse of _bhnd (a view when x is (B, N, H, D) in memory, as cuDNN returns it)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


# lse_only (the index branch's lse_idx): cuDNN takes V's first _LSE_ONLY_DV columns. The lse does not depend on
# V, and the P V product shrinks: 1.80 -> 1.56 ms at 32K, 0.21 -> 0.17 at 8K on the H200, the lse bitwise
# the same (scripts/probe_lse_idx.py). Flash needs V as wide as Q, so it keeps all of V.
_LSE_ONLY_DV = 16


@torch.library.register_kernel("msa::_dense_fwd", "cuda")
def _dense_fwd_cuda(q, k, v, cu_seqlens, max_seqlen, softmax_scale, uniform=False, deterministic=False,
                    lse_only=False, cu_seqlens_k=None, max_seqlen_k=None):
    if softmax_scale < 0:
        q, softmax_scale = -q, -softmax_scale
    T, H = q.shape[0], q.shape[1]
    batch = cu_seqlens.shape[0] - 1  # sequences, all of T / batch tokens when uniform
    suffix = cu_seqlens_k is not None  # a key layout: flash (not uniform)
    cu_k, max_k = (cu_seqlens_k, max_seqlen_k) if suffix else (cu_seqlens, max_seqlen)
    if _dense_backend(q, k, T // max(batch, 1), uniform and not suffix, deterministic) == "cudnn":
        vc = v[..., :_LSE_ONLY_DV] if lse_only and v.shape[-1] > _LSE_ONLY_DV else v
        r = _try_cudnn(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhnd(q, batch), _bhnd(k, batch), _bhnd(vc, batch), None, True, 0.0, True, False, scale=softmax_scale),
            q, k, T // batch)
        if r is not None:
            out, lse = r[:2]
            # lse (B, H, N[, 1]) -> (H, T): a view for one sequence
            return _thd(out), lse.reshape(batch, H, T // batch).transpose(0, 1).reshape(H, T)
    # With max_seqlen_q = 1 and GQA, flash views q as one row per sequence (its decode path), which a layout
    # with empty query sequences (T < batch: suffix queries with len_q = 0) does not have; 2 is an upper bound
    # too and keeps flash on its general path.
    max_q = 2 if max_seqlen == 1 and T != batch else max_seqlen
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_k, max_q, max_k, 0.0, True, False, scale=softmax_scale)[:2]
    return out, lse.contiguous()


@torch.library.register_kernel("msa::_dense_bwd", "cuda")
def _dense_bwd_cuda(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, deterministic, uniform=False,
                    cu_seqlens_k=None, max_seqlen_k=None):
    args = (cu_seqlens, max_seqlen, deterministic, uniform, cu_seqlens_k, max_seqlen_k)
    if softmax_scale < 0:  # as in _dense_fwd_cuda: the sign on q, and back on dq
        dq, dk, dv = _dense_bwd_positive(dout, -q, k, v, out, lse, -softmax_scale, *args)
        return -dq, dk, dv
    return _dense_bwd_positive(dout, q, k, v, out, lse, softmax_scale, *args)


def _dense_bwd_positive(dout, q, k, v, out, lse, softmax_scale, cu_seqlens, max_seqlen, deterministic, uniform,
                        cu_seqlens_k, max_seqlen_k):
    dout = dout.contiguous()
    T, H = q.shape[0], q.shape[1]
    batch = cu_seqlens.shape[0] - 1
    suffix = cu_seqlens_k is not None  # a key layout: flash (not uniform)
    cu_k, max_k = (cu_seqlens_k, max_seqlen_k) if suffix else (cu_seqlens, max_seqlen)
    if _dense_backend(q, k, T // max(batch, 1), uniform and not suffix, deterministic) == "cudnn":
        zero = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: the philox state is not read
        lse4 = lse.view(H, batch, T // batch).transpose(0, 1).contiguous().unsqueeze(-1)
        grads = _try_cudnn(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhnd(dout, batch), _bhnd(q, batch), _bhnd(k, batch), _bhnd(v, batch), _bhnd(out, batch), lse4,
            zero, zero, None, None, None, T // batch, T // batch, 0.0, True, scale=softmax_scale), q, k, T // batch)
        if grads is not None:
            return tuple(_thd(g) for g in grads)
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)  # no dropout: its rng state is not read
    unused = torch.empty(0, dtype=torch.int64, device=q.device)
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if deterministic:
        torch.use_deterministic_algorithms(True)
    try:
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_seqlens, cu_k, max_seqlen, max_k, 0.0, True, rng,
            unused, scale=softmax_scale)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Fake kernels (shapes only) for torch.compile / meta tensors
# ----------------------------------------------------------------------------------------------
@torch.library.register_fake("msa::select_blocks")
def _select_blocks_fake(q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, index_scale, cu_seqlens_k=None,
                        max_seqlen_k=None):
    chk.one_device(q_idx, k_idx, cu_seqlens, cu_seqlens_k)
    return q_idx.new_empty(q_idx.shape[1], q_idx.shape[0], topk, dtype=torch.int32)


def _lse_like(x, heads):
    return x.new_empty(heads, x.shape[0], dtype=ref.acc_dtype(x.dtype))


@torch.library.register_fake("msa::sparse_fwd")
def _sparse_fwd_fake(q, k, v, indices, cu_seqlens, max_seqlen, block_size, softmax_scale, deterministic=False,
                     cu_seqlens_k=None, max_seqlen_k=None):
    chk.one_device(q, k, v, indices, cu_seqlens, cu_seqlens_k)
    return torch.empty_like(q), _lse_like(q, q.shape[1])


@torch.library.register_fake("msa::sparse_bwd")
def _sparse_bwd_fake(dout, q, k, v, out, lse, indices, cu_seqlens, max_seqlen, block_size, softmax_scale,
                     deterministic=False, cu_seqlens_k=None, max_seqlen_k=None):
    chk.one_device(dout, q, k, v, out, lse, indices, cu_seqlens, cu_seqlens_k)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake("msa::msa_fwd")
def _msa_fwd_fake(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, softmax_scale, index_scale,
                  warmup, return_indices, index_grad, deterministic=False, cu_seqlens_k=None, max_seqlen_k=None,
                  sel_q_idx=None, sel_k_idx=None):
    chk.one_device(q, k, v, q_idx, k_idx, cu_seqlens, cu_seqlens_k, sel_q_idx, sel_k_idx)
    T, Hi = q_idx.shape[0], q_idx.shape[1]
    slots = 0 if (warmup and not return_indices) else topk
    acc = ref.acc_dtype(q.dtype)
    g_q = q_idx.new_empty(q_idx.shape if index_grad else (0,), dtype=acc)
    g_k = k_idx.new_empty(k_idx.shape if index_grad else (0,), dtype=acc)
    return (torch.empty_like(q), q.new_empty((), dtype=acc), q.new_empty(Hi, T, slots, dtype=torch.int32),
            _lse_like(q, q.shape[1]), _lse_like(q, Hi), g_q, g_k, _lse_like(q, Hi))


@torch.library.register_fake("msa::msa_bwd")
def _msa_bwd_fake(dout, dkl, q, k, v, out, lse, q_idx, k_idx, lse_idx, indices, kl_dq_idx, kl_dk_idx, cu_seqlens,
                  max_seqlen, block_size, softmax_scale, index_scale, warmup, deterministic=False, cu_seqlens_k=None,
                  max_seqlen_k=None):
    chk.one_device(dout, q, k, v, out, lse, q_idx, k_idx, lse_idx, indices, cu_seqlens, cu_seqlens_k)
    return tuple(torch.empty_like(x) for x in (q, k, v, q_idx, k_idx))


@torch.library.register_fake("msa::reverse_index")
def _reverse_index_fake(indices, cu_seqlens, max_seqlen, block_size):
    chk.one_device(indices, cu_seqlens)
    Hi, T, k = indices.shape
    S = T // max_seqlen if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (indices.new_empty(Hi * (T // block_size + S) + 1), indices.new_empty(Hi * T * k),
            indices.new_empty(S + 1))


@torch.library.register_fake("msa::_work_list")
def _work_list_fake(indices, cu_seqlens, max_seqlen, block_size, units_per_item):
    Hi, T, k = indices.shape
    S = T // max_seqlen if cu_seqlens is None else cu_seqlens.shape[0] - 1
    keys, entries = Hi * (T // block_size + S), Hi * T * k
    items = entries // units_per_item + min(keys, entries)  # csrc/common/workspace.h: max_work_items
    return (indices.new_empty(keys + 1), indices.new_empty(entries), indices.new_empty(keys + 1),
            indices.new_empty(items, 2), indices.new_empty(items))


@torch.library.register_fake("msa::validate_cu_seqlens")
def _validate_cu_seqlens_fake(cu_seqlens, total_tokens, max_seqlen):
    if cu_seqlens.device.type == "meta":  # a real call's meta tensor: nothing to read, nothing validated
        chk._fail("cu_seqlens", "a CPU or CUDA tensor", cu_seqlens.device)
    return None


# ----------------------------------------------------------------------------------------------
# Autograd (SPEC 4): out -> q, k, v only; kl -> q_idx, k_idx only, the teacher P detached
# ----------------------------------------------------------------------------------------------
def _msa_setup(ctx, inputs, output):
    q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen, topk, block_size, scale, iscale, warmup, _, _, det = inputs[:15]
    cu_k, max_k = (tuple(inputs[15:]) + (None, None))[:2]
    out, kl, indices, lse, lse_idx, kl_dq_idx, kl_dk_idx, kl_rows = output
    ctx.save_for_backward(q, k, v, out, lse, q_idx, k_idx, lse_idx, indices, kl_dq_idx, kl_dk_idx, cu_seqlens, cu_k)
    ctx.args = (max_seqlen, block_size, scale, iscale, warmup, det, max_k)
    ctx.mark_non_differentiable(indices, lse, lse_idx, kl_dq_idx, kl_dk_idx, kl_rows)
    ctx.set_materialize_grads(False)


def _msa_backward(ctx, dout, dkl, _dindices, _dlse, _dlse_idx, _dg_q, _dg_k, _dkl_rows):
    q, k, v, out, lse, q_idx, k_idx, lse_idx, indices, kl_dq_idx, kl_dk_idx, cu_seqlens, cu_k = ctx.saved_tensors
    max_seqlen, block_size, scale, iscale, warmup, det, max_k = ctx.args
    need = ctx.needs_input_grad
    if not any(need[:3]):
        dout = None
    if not any(need[3:5]):
        dkl = None
    if dout is None and dkl is None:
        return (None,) * len(need)
    dq, dk, dv, dq_idx, dk_idx = ops.msa_bwd(
        dout, dkl, q, k, v, out, lse, q_idx, k_idx, lse_idx, indices, kl_dq_idx, kl_dk_idx, cu_seqlens, max_seqlen,
        block_size, scale, iscale, warmup, det, *_key_args(cu_k, max_k))
    main = (dq, dk, dv) if dout is not None else (None, None, None)
    index = (dq_idx, dk_idx) if dkl is not None else (None, None)
    return (*main, *index) + (None,) * (len(need) - 5)


def _key_args(cu_k, max_k):
    """The trailing (cu_seqlens_k, max_seqlen_k) of a backward call: none where the forward had none (the
    square call's schema defaults, as before the key layout)."""
    return () if cu_k is None and max_k is None else (cu_k, max_k)


torch.library.register_autograd("msa::msa_fwd", _msa_backward, setup_context=_msa_setup)


class MsaFunction(torch.autograd.Function):
    """msa_fwd with the autograd above (_msa_setup / _msa_backward) as a plain autograd.Function, for eager calls
    (msa.interface._msa takes it where eager_autograd_applies). The op runs below the autograd key, so the
    registered Python autograd kernel (torch.library's wrapper: a boxed hop into Python, its metadata and a
    fill_defaults of the 17-argument schema per call) is not on the host's path before the launches. The same
    math and saved tensors as the registered path, which torch.compile, autocast and tensor subclasses keep."""

    @staticmethod
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = ops.msa_fwd.default(*args)
        _msa_setup(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return _msa_backward(ctx, *grads)


def eager_autograd_applies(tensors) -> bool:
    """Whether an eager msa_fwd call may take MsaFunction: grad mode on and an input needing it, plain tensors (no
    subclass or torch-function mode, which dispatch through the registered op), no autocast on their device, and
    not traced by torch.compile or torch.jit.trace."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False  # traced graphs (torch.jit.trace, TorchScript export) record the op, not a Python function
    if not any(t.requires_grad for t in tensors) or any(type(t) is not torch.Tensor for t in tensors):
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    return not torch.is_autocast_enabled(tensors[0].device.type)


def _sparse_setup(ctx, inputs, output):
    q, k, v, indices, cu_seqlens, max_seqlen, block_size, scale, det = inputs[:9]
    cu_k, max_k = (tuple(inputs[9:]) + (None, None))[:2]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, indices, cu_seqlens, cu_k)
    ctx.args = (max_seqlen, block_size, scale, det, max_k)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _sparse_backward(ctx, dout, _dlse):
    q, k, v, out, lse, indices, cu_seqlens, cu_k = ctx.saved_tensors
    n = len(ctx.needs_input_grad)
    if dout is None:
        return (None,) * n
    max_seqlen, block_size, scale, det, max_k = ctx.args
    dq, dk, dv = ops.sparse_bwd(dout, q, k, v, out, lse, indices, cu_seqlens, max_seqlen, block_size, scale, det,
                                *_key_args(cu_k, max_k))
    return (dq, dk, dv) + (None,) * (n - 3)


torch.library.register_autograd("msa::sparse_fwd", _sparse_backward, setup_context=_sparse_setup)


# ----------------------------------------------------------------------------------------------
# Autocast: under torch.autocast the forward ops take their floating inputs in the autocast dtype, as
# PyTorch's own attention does (torch.library.register_autocast casts to one fixed dtype; this follows
# the context's).
# ----------------------------------------------------------------------------------------------
def _register_autocast(name: str, device_type: str = "cuda") -> None:
    op = getattr(ops, name).default
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))

    def cast(x, dtype):  # FP8 selection inputs (index_dtype) stay as they are
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == device_type \
            and x.dtype not in FP8_DTYPES else x

    @op.py_impl(key)
    def _autocast(*args):
        dtype = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*(cast(a, dtype) for a in args))

    _LIB.impl(name, lambda _keyset, *args: _autocast(*args), key.name, with_keyset=True)


_LIB = torch.library.Library("msa", "IMPL")
for _name in ("select_blocks", "sparse_fwd", "msa_fwd"):
    _register_autocast(_name, "cuda")
    _register_autocast(_name, "cpu")
