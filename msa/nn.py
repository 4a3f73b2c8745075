"""msa.nn: an attention layer that trains with MiniMax Sparse Attention, and the helpers around it.

    attn = msa.nn.MSAAttention(hidden=1024, num_heads=16, num_kv_heads=2, head_dim=64,
                               index_heads=4, index_head_dim=64)
    y, kl = attn(x)                                   # x: (B, N, hidden), or (T, hidden) with cu_seqlens
    loss = lm_loss + lam * msa.nn.kl_loss(model)      # the KL of every msa layer of the last forward
    with msa.nn.warmup(model):                        # dense main branch while the indexer learns
        ...

The index branch reads `x.detach()` (SPEC 4): the KL trains the index projections only, the language
loss trains everything else. On CUDA the kernels run in bf16/fp16; a float32 layer outside autocast runs
them in `compute_dtype` (bf16 by default) and returns float32.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .distributed import LAYOUTS, MODES, msa_attention_cp, shard_positions
from .interface import _index_dtype, msa_attention, msa_attention_varlen

__all__ = ["MSAAttention", "RotaryEmbedding", "apply_rotary", "kl_loss", "warmup", "set_warmup", "set_index_dtype",
           "register_msa_module", "positions_from_cu_seqlens"]


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed token inside its own sequence, computed on the device (no host read)."""
    t = torch.arange(total, device=cu_seqlens.device, dtype=torch.int64)
    seq = torch.searchsorted(cu_seqlens[1:].to(torch.int64), t, right=True)
    return t - cu_seqlens.to(torch.int64)[seq]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the rotate-half convention of Llama), over the first `dim` channels.

    `forward(positions)` gives (cos, sin) of shape positions.shape + (dim,) in float32.
    The frequencies are computed in float32 at every call, not kept in a buffer: a buffer would follow
    `model.to(torch.bfloat16)` (angles off by up to ~position/256 rad, cos wrong by > 1 before position
    4096) and would hold garbage after a meta-device init + `to_empty`.
    """

    def __init__(self, dim: int, theta: float = 10000.0, device=None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RotaryEmbedding: expected an even dim, got {dim}")
        self.dim = dim
        self.theta = float(theta)

    def inv_freq_on(self, device=None) -> torch.Tensor:
        """The float32 inverse frequencies theta^(-2i/dim), i < dim/2."""
        return 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim))

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.inv_freq_on()

    def forward(self, positions: torch.Tensor):
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq_on(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., N, H, D) with cos/sin (..., N, R), R <= D: rotates the first R channels, in fp32."""
    r = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xr, xp = x[..., :r].float(), x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    rot = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rot.to(x.dtype), xp), dim=-1) if xp.shape[-1] else rot.to(x.dtype)


def _check_layer_args(hidden, num_heads, num_kv_heads, head_dim, index_heads, index_head_dim, index_key_heads,
                      rope_dim, index_rope_dim, topk, block_size):
    for name, v in (("hidden", hidden), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim), ("index_heads", index_heads), ("index_head_dim", index_head_dim),
                    ("index_key_heads", index_key_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"MSAAttention: {name}: expected a positive int, got {v!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"MSAAttention: num_kv_heads: expected a divisor of num_heads={num_heads}, got {num_kv_heads}")
    if num_heads % index_heads:
        raise ValueError(f"MSAAttention: index_heads: expected a divisor of num_heads={num_heads}, got {index_heads}")
    if index_heads % index_key_heads:
        raise ValueError(f"MSAAttention: index_key_heads: expected a divisor of index_heads={index_heads}, "
                         f"got {index_key_heads}")
    if index_heads % num_kv_heads and num_kv_heads % index_heads:
        raise ValueError(f"MSAAttention: index_heads: expected one of index_heads, num_kv_heads={num_kv_heads} "
                         f"to divide the other, got {index_heads}")
    for name, d in (("head_dim", head_dim), ("index_head_dim", index_head_dim)):
        if d not in (64, 128):
            raise ValueError(f"MSAAttention: {name}: expected 64 or 128 (the kernels' head dims), got {d}")
    for name, r, d in (("rope_dim", rope_dim, head_dim), ("index_rope_dim", index_rope_dim, index_head_dim)):
        if r is not None and (r % 2 or not 0 < r <= d):
            raise ValueError(f"MSAAttention: {name}: expected an even int in 2..{d}, got {r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= 32:
        raise ValueError(f"MSAAttention: topk: expected an int in 1..32, got {topk!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size not in (64, 128):
        raise ValueError(f"MSAAttention: block_size: expected 64 or 128, got {block_size!r}")


class MSAAttention(nn.Module):
    """Causal GQA self-attention with MiniMax Sparse Attention and its index branch (SPEC 1-5).

    Args:
        hidden: model width; num_heads (Hq), num_kv_heads (Hkv), head_dim (D in {64, 128}).
        index_heads (Hi): index query heads, one per index group; index_head_dim (Di in {64, 128});
        index_key_heads (Hki, default 1): shared index key heads.
        topk, block_size: blocks selected per (token, index group), own block included; tokens per block.
        qk_norm / index_qk_norm: RMSNorm over each head of q and k / of q_idx and k_idx (default off / on).
        rope / index_rope: rotary embedding of the main / index branch (default both on), over the first
        rope_dim / index_rope_dim channels (default all), base rope_theta.
        softmax_scale, index_scale: default 1/sqrt(D), 1/sqrt(Di).
        bias: bias in the q/k/v/o projections (the index projections have none).
        compute_dtype: the kernels' dtype for float32 activations on CUDA outside autocast (bf16).
        deterministic: passed to msa_attention (None follows torch.use_deterministic_algorithms).
        index_dtype: passed to msa_attention (torch.float8_e4m3fn: the selection scores e4m3 copies of the index
            branch; None: its own dtype).
        cp_group, cp_layout, cp_mode: context parallelism (msa.distributed, README "Long sequences on several
            GPUs"): with a process group (torch.distributed.group.WORLD for every rank), x is this rank's
            (B, N / P, hidden) shard in cp_layout, the
            rotary positions default to the shard's positions in the whole sequence, and the attention is
            msa_attention_cp over the group (`set_context_parallel` sets them later).

    forward(x, cu_seqlens=None, max_seqlen=None, positions=None) -> (y, kl)
        x (B, N, hidden), or packed (T, hidden) with cu_seqlens int32 (S+1,) and max_seqlen;
        positions (rotary positions: (N,), (1, N) or (B, N); packed (T,)) default to each token's place in its
        sequence.
        kl is the layer's fp32 KL term (0-dim); it is also kept in `self.msa_kl` for `kl_loss(model)`.
    Set `layer.warmup = True` (or use `msa.nn.warmup(model)`) for the dense warmup mode (SPEC 5).
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, index_heads: int,
                 index_head_dim: int, index_key_heads: int = 1, *, topk: int = 16, block_size: int = 128,
                 qk_norm: bool = False, index_qk_norm: bool = True, rope: bool = True, index_rope: bool = True,
                 rope_theta: float = 10000.0, rope_dim: int | None = None, index_rope_dim: int | None = None,
                 softmax_scale: float | None = None, index_scale: float | None = None, bias: bool = False,
                 norm_eps: float = 1e-6, compute_dtype: torch.dtype = torch.bfloat16, deterministic=None,
                 index_dtype: torch.dtype | None = None, cp_group=None, cp_layout: str = "zigzag",
                 cp_mode: str = "auto", device=None, dtype=None):
        super().__init__()
        _check_layer_args(hidden, num_heads, num_kv_heads, head_dim, index_heads, index_head_dim, index_key_heads,
                          rope_dim, index_rope_dim, topk, block_size)
        f = {"device": device, "dtype": dtype}
        self.hidden, self.num_heads, self.num_kv_heads, self.head_dim = hidden, num_heads, num_kv_heads, head_dim
        self.index_heads, self.index_head_dim, self.index_key_heads = index_heads, index_head_dim, index_key_heads
        self.topk, self.block_size = topk, block_size
        self.softmax_scale, self.index_scale = softmax_scale, index_scale
        self.compute_dtype, self.deterministic = compute_dtype, deterministic
        self.index_dtype = _index_dtype(index_dtype)
        self.warmup = False
        self.msa_kl = None
        self.set_context_parallel(cp_group, cp_layout, cp_mode)
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias, **f)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias, **f)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias, **f)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=bias, **f)
        self.q_idx_proj = nn.Linear(hidden, index_heads * index_head_dim, bias=False, **f)
        self.k_idx_proj = nn.Linear(hidden, index_key_heads * index_head_dim, bias=False, **f)
        norm = (lambda d, on: nn.RMSNorm(d, eps=norm_eps, **f) if on else None)
        self.q_norm, self.k_norm = norm(head_dim, qk_norm), norm(head_dim, qk_norm)
        self.q_idx_norm, self.k_idx_norm = norm(index_head_dim, index_qk_norm), norm(index_head_dim, index_qk_norm)
        self.rotary = RotaryEmbedding(rope_dim or head_dim, rope_theta, device) if rope else None
        self.index_rotary = RotaryEmbedding(index_rope_dim or index_head_dim, rope_theta, device) if index_rope else None

    def __getstate__(self):
        # The last forward's KL is a tensor of that forward's graph: not part of a copy.deepcopy (EMA
        # copies, which would raise on it) or a pickle.
        # A process group belongs to this process: a copy runs without context parallelism until
        # set_context_parallel is called on it.
        state = super().__getstate__()
        state["msa_kl"] = None
        state["cp_group"] = None
        return state

    def set_context_parallel(self, group, layout: str = "zigzag", mode: str = "auto"):
        """Shard the sequence over `group` (None: no context parallelism): see the class docstring."""
        if layout not in LAYOUTS or mode not in MODES:
            raise ValueError(f"MSAAttention: cp_layout / cp_mode: expected one of {LAYOUTS} / {MODES}, got "
                             f"{layout!r} / {mode!r}")
        self.cp_group, self.cp_layout, self.cp_mode = group, layout, mode

    def extra_repr(self):
        return (f"heads={self.num_heads}/{self.num_kv_heads}x{self.head_dim}, index={self.index_heads}/"
                f"{self.index_key_heads}x{self.index_head_dim}, topk={self.topk}, block_size={self.block_size}")

    def _heads(self, proj, x, n, norm, rotary, cos_sin):
        y = proj(x).unflatten(-1, (n, -1))
        if norm is not None:
            y = norm(y)
        if rotary is not None:
            y = apply_rotary(y, *cos_sin)
        return y

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                positions: torch.Tensor | None = None):
        packed = cu_seqlens is not None
        if x.dim() != (2 if packed else 3) or x.shape[-1] != self.hidden:
            raise ValueError(f"MSAAttention: x: expected {'(T, hidden)' if packed else '(B, N, hidden)'} with "
                             f"hidden={self.hidden}, got shape {tuple(x.shape)}")
        if packed and max_seqlen is None:
            raise ValueError("MSAAttention: max_seqlen: expected an int with cu_seqlens, got None")
        if packed and self.cp_group is not None:
            raise ValueError("MSAAttention: cu_seqlens: context parallelism takes the batched layout (B, N / P, hidden)")
        if positions is None and self.cp_group is not None:
            positions = shard_positions(x.shape[1], self.cp_group, layout=self.cp_layout, device=x.device)
        elif positions is None:
            positions = (positions_from_cu_seqlens(cu_seqlens, x.shape[0]) if packed
                         else torch.arange(x.shape[1], device=x.device))
        elif (self.rotary is not None or self.index_rotary is not None) and not _positions_fit(positions, x, packed):
            want = "(T,)" if packed else "(N,), (1, N) or (B, N)"
            got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ValueError(f"MSAAttention: positions: expected shape {want} for x of shape {tuple(x.shape)}, got {got}")
        rope = self.rotary(positions) if self.rotary is not None else None
        irope = self.index_rotary(positions) if self.index_rotary is not None else None
        xd = x.detach()  # SPEC 4: the KL trains the index projections, not the trunk
        q = self._heads(self.q_proj, x, self.num_heads, self.q_norm, self.rotary, rope)
        k = self._heads(self.k_proj, x, self.num_kv_heads, self.k_norm, self.rotary, rope)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, -1))
        qi = self._heads(self.q_idx_proj, xd, self.index_heads, self.q_idx_norm, self.index_rotary, irope)
        ki = self._heads(self.k_idx_proj, xd, self.index_key_heads, self.k_idx_norm, self.index_rotary, irope)
        dtype = q.dtype
        if q.is_cuda and not torch.is_autocast_enabled("cuda") and dtype not in (torch.bfloat16, torch.float16):
            q, k, v, qi, ki = (t.to(self.compute_dtype) for t in (q, k, v, qi, ki))
        kw = dict(topk=self.topk, block_size=self.block_size, softmax_scale=self.softmax_scale,
                  index_scale=self.index_scale, warmup=bool(self.warmup), deterministic=self.deterministic,
                  index_dtype=self.index_dtype)
        if self.cp_group is not None:
            out, kl = msa_attention_cp(q, k, v, qi, ki, group=self.cp_group, layout=self.cp_layout, mode=self.cp_mode,
                                       **kw)
        elif packed:
            out, kl = msa_attention_varlen(q, k, v, qi, ki, cu_seqlens, max_seqlen, **kw)
        else:
            out, kl = msa_attention(q, k, v, qi, ki, **kw)
        self.msa_kl = kl
        return self.o_proj(out.flatten(-2).to(dtype)), kl


def _positions_fit(positions, x, packed) -> bool:
    """Rotary positions of x's tokens: (T,) packed; (N,) or (1, N) shared by the batch, or (B, N), batched."""
    if not isinstance(positions, torch.Tensor):
        return False
    if packed:
        return tuple(positions.shape) == (x.shape[0],)
    return tuple(positions.shape) in ((x.shape[1],), (1, x.shape[1]), (x.shape[0], x.shape[1]))


# Predicates of other modules that run msa (registered by msa.integrations: a MiniMax-M3 sparse
# attention, a converted Hugging Face attention). Such a module keeps its KL in `msa_kl` and reads `warmup` and
# `index_dtype`.
_MSA_MODULE_TESTS = []


def register_msa_module(test) -> None:
    """Make `kl_loss` and `warmup` see the modules for which `test(module)` is true."""
    if test not in _MSA_MODULE_TESTS:
        _MSA_MODULE_TESTS.append(test)


def _is_msa(m) -> bool:
    return isinstance(m, MSAAttention) or any(t(m) for t in _MSA_MODULE_TESTS)


def _msa_modules(model: nn.Module):
    """Every module of `model` that runs msa: MSAAttention and the layers msa.integrations route."""
    return [m for m in model.modules() if _is_msa(m)]


def kl_loss(model: nn.Module, reduction: str = "sum") -> torch.Tensor:
    """The KL terms of the msa layers of `model` from its last forward, summed (or `reduction="mean"`).

    Use as `loss = lm_loss + lam * msa.nn.kl_loss(model)`; the KL's gradient reaches the index
    projections only. Raises if no msa layer ran a forward since the model was built.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"kl_loss: reduction: expected 'sum' or 'mean', got {reduction!r}")
    terms = [m.msa_kl for m in _msa_modules(model) if getattr(m, "msa_kl", None) is not None]
    if not terms:
        raise RuntimeError("kl_loss: no msa layer of this model holds a KL: none has run a full-sequence forward since "
                           "the model was built (decode steps with a KV cache keep none)")
    dtype = torch.float32  # at least fp32; a float64 model (the CPU path) keeps float64
    for t in terms:
        dtype = torch.promote_types(dtype, t.dtype)
    total = torch.stack([t.to(dtype) for t in terms]).sum()
    return total / len(terms) if reduction == "mean" else total


@contextlib.contextmanager
def warmup(model: nn.Module, enabled: bool = True):
    """Run every msa layer of `model` in warmup mode (dense main branch, SPEC 5) inside the block."""
    mods = _msa_modules(model)
    if not mods:
        raise ValueError("warmup: this model has no msa layer")
    saved = [getattr(m, "warmup", False) for m in mods]
    for m in mods:
        m.warmup = enabled
    try:
        yield model
    finally:
        for m, s in zip(mods, saved):
            m.warmup = s


def set_warmup(model: nn.Module, enabled: bool) -> int:
    """Set the warmup mode of every msa layer of `model`; returns how many layers were set."""
    mods = _msa_modules(model)
    for m in mods:
        m.warmup = bool(enabled)
    return len(mods)


def set_index_dtype(model: nn.Module, index_dtype) -> int:
    """Set `index_dtype` (None, or torch.float8_e4m3fn: the FP8 selection, msa.msa_attention) of every msa layer of
    `model`, converted Hugging Face layers included (their decode steps select on the same e4m3 copies); returns how
    many layers were set."""
    _index_dtype(index_dtype)
    mods = _msa_modules(model)
    for m in mods:
        m.index_dtype = index_dtype
    return len(mods)

