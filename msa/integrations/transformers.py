"""msa for Hugging Face transformers (the optional extra `msa-attention[hf]`).

`import msa.integrations.transformers` registers the attention implementation `"msa"`:

* **MiniMax-M3** (`MiniMaxM3VLForCausalLM`, `models/minimax_m3_vl`): a model built or loaded with
  `attn_implementation="msa"` (or switched with `model.set_attn_implementation("msa")`) runs its sparse
  layers' lightning indexer and block-sparse attention through msa: no `[B, H, S, S]` mask and no
  `[B, H_idx, S, S]` index scores, so it trains and runs prefill at long context. The indexer keeps its
  projections, q/k norm and RoPE (they run here); its scores have no scale (index_scale = 1), as in the
  model. Its full-attention layers run torch SDPA. In training the sparse layers also compute the KL of
  the index branch (SPEC 4, from the indexer's projections of the detached hidden states); collect it
  with `msa.nn.kl_loss(model)`, and use `msa.nn.warmup(model)` for the dense warmup mode.
* **GQA models** (Llama, Qwen2, Qwen3 causal LMs): `convert(model, index_heads=..., index_head_dim=...)`
  adds an index branch to every self-attention and routes it through msa, for continued pretraining.

Prefill and training (the query covers the whole key range) run msa's kernels (CUDA) or its exact CPU
path. Decode steps with a KV cache (fewer queries than keys) run an exact PyTorch path over the blocks
selected for each new token (the index scores of the new tokens against every cached index key, then
attention over the selected blocks); there are no msa decode kernels yet.

Not supported, each with a clear error: padded batches (an attention mask with zeros), packed sequences
through `position_ids`, image/video tokens of the VL model (their bidirectional overlay), attention
dropout in training, M3's `index_local_blocks != 1` (msa always forces exactly the token's own block),
index/main head dims other than 64 or 128, blocks other than 64 or 128, top-k above 32, sliding-window
layers in `convert`, and caches other than a DynamicCache of full-attention layers on converted models.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.utils.import_utils import is_torchdynamo_compiling

from .. import nn as msa_nn
from ..interface import BLOCK_SIZES, HEAD_DIMS, MAX_TOPK, fp8_index_copies, msa_attention

__all__ = ["NAME", "convert", "IndexBranch", "layer_kl", "msa_attention_forward"]

NAME = "msa"

try:  # MiniMax-M3 ships in transformers >= 5.17
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as _m3
except ImportError:  # pragma: no cover - older transformers
    _m3 = None


# ----------------------------------------------------------------------------------------------------
# Shared pieces: prefill through the kernels, decode in exact PyTorch


def _to_kernel_dtype(tensors):
    """The kernels take bf16/fp16 on CUDA: float32 models outside autocast run them in bf16."""
    x = tensors[0]
    if x.is_cuda and not torch.is_autocast_enabled("cuda") and x.dtype not in (torch.bfloat16, torch.float16):
        return [t.to(torch.bfloat16) for t in tensors]
    return list(tensors)


def _prefill(module, query, key, value, q_idx, k_idx, topk, block_size, scaling, index_scale):
    """query (B, H, N, D), key/value (B, Hkv, N, D), q_idx (B, N, Hi, Di), k_idx (B, N, Hki, Di)."""
    dtype = query.dtype
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q, k, v, qi, ki = _to_kernel_dtype([q, k, v, q_idx, k_idx])
    out, kl = msa_attention(q, k, v, qi, ki, topk=topk, block_size=block_size, softmax_scale=scaling,
                            index_scale=index_scale, warmup=bool(getattr(module, "warmup", False)),
                            index_dtype=getattr(module, "index_dtype", None))
    return out.to(dtype), kl


def _decode(query, key, value, q_idx, k_idx, positions, topk, block_size, scaling, index_scale, warmup=False,
            index_dtype=None):
    """Exact attention of Sq new tokens over the blocks the index branch selects for them (SPEC 2-3), or over
    every earlier token in warmup mode (SPEC 5: dense, as the warmup prefill).

    query (B, H, Sq, D), key/value (B, Hkv, Sk, D), q_idx (B, Sq, Hi, Di), k_idx (B, Sk, Hki, Di), positions
    (B, Sq): the new tokens' positions among the Sk keys. Memory O(Sq * Sk): meant for decode steps. index_dtype
    (torch.float8_e4m3fn): the scores of the e4m3 copies, as the prefill selects (msa.fp8_index_copies).
    """
    B, H, Sq, _ = query.shape
    Sk = key.shape[2]
    Hi, Hki = q_idx.shape[2], k_idx.shape[2]
    visible = torch.arange(Sk, device=query.device)[None, None, :] <= positions[:, :, None]   # B, Sq, Sk
    if warmup:
        return _attend(query, key, value, visible[:, None].expand(B, H, Sq, Sk), scaling)
    if index_dtype is not None:
        q_idx, k_idx = fp8_index_copies(q_idx, k_idx)
    qi = q_idx.float().transpose(1, 2)
    ki = k_idx.float().transpose(1, 2).repeat_interleave(Hi // Hki, dim=1)
    scores = index_scale * (qi @ ki.transpose(-1, -2))                                  # B, Hi, Sq, Sk
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    nb = -(-Sk // block_size)
    scores = nn.functional.pad(scores, (0, nb * block_size - Sk), value=float("-inf"))
    blocks = scores.view(B, Hi, Sq, nb, block_size).amax(-1)
    own = (positions // block_size)[:, None, :, None].expand(B, Hi, Sq, 1)
    blocks = blocks.scatter(-1, own, float("inf"))
    top, idx = blocks.topk(min(topk, nb), dim=-1)
    idx = torch.where(top > float("-inf"), idx, nb)                                     # nb: a dropped slot
    sel = torch.zeros(B, Hi, Sq, nb + 1, dtype=torch.bool, device=query.device).scatter(-1, idx, True)
    keep = sel[..., :nb].repeat_interleave(block_size, dim=-1)[..., :Sk] & visible[:, None]
    keep = keep.repeat_interleave(H // Hi, dim=1)                                       # B, H, Sq, Sk
    return _attend(query, key, value, keep, scaling)


def _attend(query, key, value, keep, scaling):
    """Softmax attention in fp32 over the keys where keep (B, H, Sq, Sk) is true -> (B, Sq, H, D)."""
    H, Hkv = query.shape[1], key.shape[1]
    k = key.float().repeat_interleave(H // Hkv, dim=1)
    v = value.float().repeat_interleave(H // Hkv, dim=1)
    logits = (scaling * (query.float() @ k.transpose(-1, -2))).masked_fill(~keep, float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v
    return out.transpose(1, 2).to(query.dtype)                                         # B, Sq, H, D


def _positions(kwargs, B, Sq, Sk, device):
    pos = kwargs.get("position_ids")
    if pos is None:
        return torch.arange(Sk - Sq, Sk, device=device).expand(B, Sq)
    pos = pos if pos.dim() > 1 else pos.unsqueeze(0)
    return pos.to(device).expand(B, Sq)


def _check_positions(pos, Sq, Sk):
    """The kernels number tokens by their place in the sequence: packed sequences given by resets in
    position_ids would silently mix sequences."""
    if is_torchdynamo_compiling():
        return
    want = torch.arange(Sk - Sq, Sk, device=pos.device)
    if not bool((pos == want).all()):
        raise NotImplementedError(
            "msa: position_ids other than 0..N-1 (packed sequences, left padding) are not supported by the "
            "msa attention implementation; pass unpadded sequences (batch them by length), or use "
            "msa.nn.MSAAttention with cu_seqlens for packed training")


def _sparse_layer(module, query, key, value, attention_mask, scaling, dropout, q_idx, k_idx, spec, kwargs):
    if dropout and module.training:
        raise NotImplementedError("msa: attention dropout is not supported; set attention_dropout=0")
    B, _, Sq, _ = query.shape
    Sk = key.shape[2]
    pos = _positions(kwargs, B, Sq, Sk, query.device)
    topk, block_size, index_scale = spec
    if Sq == Sk:
        if attention_mask is not None:
            raise NotImplementedError(
                "msa: the sparse layers take plain causal attention only; got an attention mask (padding, "
                "packed sequences or an image/video overlay)")
        _check_positions(pos, Sq, Sk)
        out, kl = _prefill(module, query, key, value, q_idx, k_idx, topk, block_size, scaling, index_scale)
        module.msa_kl = kl
        return out, None
    module.msa_kl = None
    return _decode(query, key, value, q_idx, k_idx, pos, topk, block_size, scaling, index_scale,
                   bool(getattr(module, "warmup", False)), getattr(module, "index_dtype", None)), None


def msa_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The `"msa"` attention implementation (transformers' AttentionInterface signature).

    MiniMax-M3 sparse layers pass their index projections as `block_indices` (see `_m3_indexer_forward`);
    converted layers carry an `msa_index` branch; every other layer runs torch SDPA.
    """
    block_indices = kwargs.pop("block_indices", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if getattr(module, "indexer", None) is not None and _m3 is not None:
        if not isinstance(block_indices, tuple):
            raise RuntimeError("msa: a MiniMax-M3 sparse layer reached the msa attention without its index "
                               "projections (was the model's attn_implementation switched mid-forward?)")
        ix = module.indexer
        if not getattr(module, "_msa_checked", False):  # the main heads too (the indexer checked its own)
            _check_m3(ix, module)
            module._msa_checked = True
        q_idx, k_idx = (t.transpose(1, 2) for t in block_indices)
        return _sparse_layer(module, query, key, value, attention_mask, scaling, dropout, q_idx, k_idx,
                             (ix.topk_blocks, ix.block_size, 1.0), kwargs)
    branch = getattr(module, "msa_index", None)
    if branch is not None:
        q_idx, k_idx = branch.inputs(module, query.shape[2], key.shape[2], kwargs)
        return _sparse_layer(module, query, key, value, attention_mask, scaling, dropout, q_idx, k_idx,
                             (branch.topk, branch.block_size, branch.index_scale), kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _msa_mask(*args, mask_function=causal_mask_function, attention_mask=None, **kwargs):
    """Masks for the msa implementation: the SDPA mask (None for plain causal prefill and decode), after
    refusing what the sparse layers cannot honour, before an O(N^2) mask is built."""
    if mask_function is not causal_mask_function:
        raise NotImplementedError(
            "msa: only plain causal attention is supported (no packed-sequence, sliding-window or image/video "
            "overlay masks)")
    compiling = is_torchdynamo_compiling()
    if attention_mask is not None:
        if compiling:  # no host read while tracing: a runtime assertion inside the graph
            torch._check_tensor_all(attention_mask.bool())
        elif not bool(attention_mask.all()):
            raise NotImplementedError(
                "msa: padded batches are not supported (the attention mask has zeros); batch sequences of one "
                "length, or use msa.nn.MSAAttention with cu_seqlens for packed training")
    if compiling and kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0 \
            and kwargs.get("q_length") == kwargs.get("kv_length") \
            and (attention_mask is None or attention_mask.shape[-1] == kwargs.get("kv_length")):
        # Plain causal prefill: sdpa_mask skips the mask (is_causal) only outside tracing; under torch.compile
        # it would build the O(N^2) mask, which the sparse layers refuse.
        return None
    return sdpa_mask(*args, mask_function=mask_function, attention_mask=attention_mask, **kwargs)


def layer_kl(model: nn.Module):
    """The per-layer KL terms of the last forward (None for layers that ran a decode step)."""
    return [getattr(m, "msa_kl", None) for m in msa_nn._msa_modules(model)]


# ----------------------------------------------------------------------------------------------------
# MiniMax-M3


def _check_m3(ix, attn):
    """Options of the M3 indexer that msa cannot honour: a clear error before any kernel runs."""
    c = ix.config
    problems = []
    if ix.local_blocks != 1:
        problems.append(f"index_local_blocks={ix.local_blocks} (msa forces exactly the token's own block: 1)")
    if ix.block_size not in BLOCK_SIZES:
        problems.append(f"index_block_size={ix.block_size} (supported: {BLOCK_SIZES})")
    if not 1 <= ix.topk_blocks <= MAX_TOPK:
        problems.append(f"index_topk_blocks={ix.topk_blocks} (supported: 1..{MAX_TOPK})")
    if ix.head_dim not in HEAD_DIMS:
        problems.append(f"index_head_dim={ix.head_dim} (supported: {HEAD_DIMS})")
    if attn is not None and attn.head_dim not in HEAD_DIMS:
        problems.append(f"head_dim={attn.head_dim} (supported: {HEAD_DIMS})")
    if c.num_attention_heads % ix.num_heads:
        problems.append(f"index_n_heads={ix.num_heads} must divide num_attention_heads={c.num_attention_heads}")
    elif ix.num_heads % c.num_key_value_heads and c.num_key_value_heads % ix.num_heads:
        problems.append(f"index_n_heads={ix.num_heads} and num_key_value_heads={c.num_key_value_heads}: one must "
                        f"divide the other")
    if problems:
        raise NotImplementedError("msa: this MiniMax-M3 configuration is not supported by the msa attention "
                                  "implementation: " + "; ".join(problems))


def _m3_indexer_forward(self, hidden_states, position_embeddings, past_key_values=None, position_ids=None,
                        **kwargs):
    """MiniMaxM3VLIndexer.forward under attn_implementation="msa": the index projections only.

    Returns (idx_q (B, H_idx, S, Di), idx_k (B, 1, S_k, Di)) instead of block indices: the selection runs
    inside msa's kernels (prefill) or its decode path. The projections read the detached hidden states
    (SPEC 4): the KL trains the indexer; the language loss never reached it (its top-k has no gradient).
    """
    cache = kwargs.pop("cache", past_key_values)
    if self.config._attn_implementation != NAME:
        return _M3_INDEXER_FORWARD(self, hidden_states, position_embeddings, cache, position_ids, **kwargs)
    if not getattr(self, "_msa_checked", False):
        _check_m3(self, None)
        self._msa_checked = True
    x = hidden_states.detach()
    B, S, _ = x.shape
    iq = self.q_norm(self.q_proj(x).view(B, S, -1, self.head_dim)).transpose(1, 2)
    ik = self.k_norm(self.k_proj(x).view(B, S, 1, self.head_dim)).transpose(1, 2)
    cos, sin = position_embeddings
    iq, ik = _m3.apply_rotary_pos_emb(iq, ik, cos[..., : self.head_dim], sin[..., : self.head_dim])
    if cache is not None:
        ik = cache.layers[self.layer_idx].update_index(ik)
    return iq, ik


def _is_m3_sparse(m) -> bool:
    return _m3 is not None and isinstance(m, _m3.MiniMaxM3VLAttention) and m.indexer is not None


if _m3 is not None:
    _M3_INDEXER_FORWARD = _m3.MiniMaxM3VLIndexer.forward
    if getattr(_M3_INDEXER_FORWARD, "__msa__", False):  # a re-import: keep the original
        _M3_INDEXER_FORWARD = _M3_INDEXER_FORWARD.__wrapped__
    _m3_indexer_forward.__msa__ = True
    _m3_indexer_forward.__wrapped__ = _M3_INDEXER_FORWARD
    _m3.MiniMaxM3VLIndexer.forward = _m3_indexer_forward
    msa_nn.register_msa_module(_is_m3_sparse)


# ----------------------------------------------------------------------------------------------------
# Conversion of GQA models (Llama, Qwen2, Qwen3)


class IndexBranch(nn.Module):
    """The index branch added to a converted attention: Hi query heads and Hki key heads of Di, optional
    per-head RMSNorm and RoPE, fed with the detached hidden states; keeps its keys in the KV cache."""

    def __init__(self, hidden, index_heads, index_head_dim, index_key_heads, topk, block_size, qk_norm, rope,
                 rope_theta, index_scale, eps, init_std, device, dtype):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.index_heads, self.index_head_dim, self.index_key_heads = index_heads, index_head_dim, index_key_heads
        self.topk, self.block_size = topk, block_size
        self.index_scale = 1.0 / math.sqrt(index_head_dim) if index_scale is None else float(index_scale)
        self.q_proj = nn.Linear(hidden, index_heads * index_head_dim, bias=False, **f)
        self.k_proj = nn.Linear(hidden, index_key_heads * index_head_dim, bias=False, **f)
        for lin in (self.q_proj, self.k_proj):
            nn.init.normal_(lin.weight, std=init_std)
        self.q_norm = nn.RMSNorm(index_head_dim, eps=eps, **f) if qk_norm else None
        self.k_norm = nn.RMSNorm(index_head_dim, eps=eps, **f) if qk_norm else None
        self.rotary = msa_nn.RotaryEmbedding(index_head_dim, rope_theta, device) if rope else None
        self._x = self._cache = None

    def extra_repr(self):
        return (f"index_heads={self.index_heads}, index_key_heads={self.index_key_heads}, "
                f"index_head_dim={self.index_head_dim}, topk={self.topk}, block_size={self.block_size}")

    def _heads(self, proj, norm, x, n, cos_sin):
        y = proj(x).unflatten(-1, (n, self.index_head_dim))
        if norm is not None:
            y = norm(y)
        return msa_nn.apply_rotary(y, *cos_sin) if cos_sin is not None else y

    def inputs(self, attn, Sq, Sk, kwargs):
        """(q_idx (B, Sq, Hi, Di), k_idx (B, Sk, Hki, Di)) from the hidden states the pre-hook kept."""
        x, cache = self._x, self._cache
        self._x = self._cache = None
        if x is None:
            raise RuntimeError("msa: a converted attention ran without its hidden states (its forward "
                               "pre-hook did not run)")
        x = x.detach()
        B = x.shape[0]
        pos = _positions(kwargs, B, Sq, Sk, x.device)
        cs = self.rotary(pos) if self.rotary is not None else None
        qi = self._heads(self.q_proj, self.q_norm, x, self.index_heads, cs)
        ki = self._heads(self.k_proj, self.k_norm, x, self.index_key_heads, cs)
        if cache is not None:
            layer = _index_cache_layer(cache, attn.layer_idx)
            past = layer.__dict__.get(_INDEX_KEYS)
            seen = 0 if past is None else past.shape[1]
            if seen != Sk - Sq:
                raise NotImplementedError(
                    f"msa: the converted layer's index-key cache holds {seen} tokens where the KV cache holds "
                    f"{Sk - Sq} (was the cache edited outside its own methods?)")
            ki = ki if past is None else torch.cat([past, ki], dim=1)
            setattr(layer, _INDEX_KEYS, ki)
        return qi, ki


# The index keys of a converted attention live on its DynamicLayer (`msa_index_keys`, (B, S, Hki, Di)) and follow
# the cache edits of generation: beam search reordering, batch expansion/selection, cropping. DynamicLayer's own
# methods are wrapped (not the layer's class swapped: torch.compile cannot trace a __class__ assignment).
_INDEX_KEYS = "msa_index_keys"


def _index_keys_follow(name, edit):
    orig = getattr(DynamicLayer, name)
    orig = getattr(orig, "__wrapped__", orig) if getattr(orig, "__msa__", False) else orig

    def method(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        keys = self.__dict__.get(_INDEX_KEYS)
        if keys is not None:
            self.__dict__[_INDEX_KEYS] = edit(self, keys, *args, **kwargs)
        return out

    method.__name__, method.__doc__, method.__msa__, method.__wrapped__ = name, orig.__doc__, True, orig
    setattr(DynamicLayer, name, method)


_index_keys_follow("reorder_cache", lambda layer, k, beam_idx: k.index_select(0, beam_idx.to(k.device)))
_index_keys_follow("batch_repeat_interleave", lambda layer, k, repeats: k.repeat_interleave(repeats, dim=0))
_index_keys_follow("batch_select_indices", lambda layer, k, indices: k[indices, ...])
_index_keys_follow("crop", lambda layer, k, *a, **kw: k[:, : layer.get_seq_length()])
_index_keys_follow("reset", lambda layer, k: k.zero_())


def _index_cache_layer(cache, layer_idx):
    """The DynamicLayer that keeps a converted attention's index keys."""
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if not isinstance(layer, DynamicLayer) or getattr(layer, "is_sliding", False):
        raise NotImplementedError(
            f"msa: a converted model caches with a DynamicCache of full-attention layers only; got "
            f"{type(cache).__name__} with a {type(layer).__name__} at layer {layer_idx} (static and sliding-window "
            f"caches are not supported)")
    return layer


def _keep_hidden(module, args, kwargs):
    """Forward pre-hook of a converted attention: the index branch reads the layer's input."""
    module.msa_index._x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    module.msa_index._cache = kwargs.get("past_key_values", args[3] if len(args) > 3 else None)


def _attention_modules(model):
    mods = [m for m in model.modules()
            if all(hasattr(m, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx", "head_dim"))]
    return [m for m in mods if type(m).__name__.endswith("Attention")]


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def convert(model: nn.Module, *, index_heads: int | None = None, index_head_dim: int = 64,
            index_key_heads: int = 1, topk: int = 16, block_size: int = 128, index_qk_norm: bool = True,
            index_rope: bool = True, index_scale: float | None = None, warmup: bool = True) -> nn.Module:
    """Add an msa index branch to every self-attention of a Llama / Qwen2 / Qwen3 causal LM, in place,
    and route its attention through msa (attn_implementation "msa"). Returns the model.

    index_heads defaults to the model's num_key_value_heads (the paper's Hi = Hkv); the index key heads
    are shared (index_key_heads=1). The converted model starts in warmup mode (dense main branch, equal
    to the unconverted model) so the new index branch can learn from the KL before the main branch goes
    sparse: `msa.nn.set_warmup(model, False)` then. The per-layer KL of each forward:
    `msa.nn.kl_loss(model)` (summed) or `layer_kl(model)`.
    """
    cfg = model.config
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(f"convert: model_type {mtype!r} is not supported (supported: "
                                  f"{SUPPORTED_MODEL_TYPES}); MiniMax-M3 runs with attn_implementation='msa'")
    attns = _attention_modules(model)
    if not attns:
        raise ValueError("convert: found no self-attention modules with q/k/v/o projections")
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    Hi = Hkv if index_heads is None else index_heads
    problems = []
    if attns[0].head_dim not in HEAD_DIMS:
        problems.append(f"head_dim={attns[0].head_dim} (msa's kernels take {HEAD_DIMS})")
    if index_head_dim not in HEAD_DIMS:
        problems.append(f"index_head_dim={index_head_dim} (supported: {HEAD_DIMS})")
    if H % Hi or (Hi % Hkv and Hkv % Hi) or Hi % index_key_heads:
        problems.append(f"index_heads={Hi}, index_key_heads={index_key_heads} with {H} heads and {Hkv} kv "
                        f"heads (need Hi | Hq, Hki | Hi, and one of Hi, Hkv dividing the other)")
    if block_size not in BLOCK_SIZES or not 1 <= topk <= MAX_TOPK:
        problems.append(f"block_size={block_size}, topk={topk} (supported: {BLOCK_SIZES}, 1..{MAX_TOPK})")
    if any(getattr(m, "sliding_window", None) for m in attns):
        problems.append("sliding-window layers")
    if problems:
        raise ValueError("convert: " + "; ".join(problems))
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    for m in attns:
        w = m.q_proj.weight
        m.msa_index = IndexBranch(cfg.hidden_size, Hi, index_head_dim, index_key_heads, topk, block_size,
                                  index_qk_norm, index_rope, theta, index_scale, getattr(cfg, "rms_norm_eps", 1e-6),
                                  getattr(cfg, "initializer_range", 0.02), w.device, w.dtype)
        m.warmup = bool(warmup)
        m.msa_kl = None
        if not getattr(m, "_msa_hooked", False):
            m.register_forward_pre_hook(_keep_hidden, with_kwargs=True)
            m._msa_hooked = True
    model.set_attn_implementation(NAME)
    return model


def _is_converted(m) -> bool:
    return isinstance(getattr(m, "msa_index", None), IndexBranch)


msa_nn.register_msa_module(_is_converted)
AttentionInterface.register(NAME, msa_attention_forward)
AttentionMaskInterface.register(NAME, _msa_mask)
