"""index_dtype=torch.float8_e4m3fn on the CPU path (runs in CI): msa.fp8_index_copies, the selection it makes,
msa_attention with it, the ops' checks of their selection inputs, opcheck (torch.compile: tests/test_ops.py).
The CUDA kernels' side: tests/test_index_fp8_gpu.py."""
import math

import pytest
import torch

import msa
import msa.nn
from msa import reference as ref
from helpers import make_inputs, make_packed
from topk_check import assert_valid_topk

FP8 = torch.float8_e4m3fn
ops = torch.ops.msa


def _pow2_rounded(x, amax):
    """The rule, computed here independently (float64 log2: exact enough for the fp32 maxima of 16-bit inputs): x
    times 2^s, s the largest with amax 2^s <= 16, rounded to e4m3 (amax: broadcast to x)."""
    amax = amax.double().clamp_min(2.0 ** -126)
    s = torch.floor(torch.log2(16.0 / amax)).clamp(-126, 126)
    return (x.double() * torch.pow(2.0, s.double())).to(FP8)


def test_fp8_index_copies():
    """Each q_idx row's scale is its own, each k_idx head's its batch element's (batched) or sequence's (packed):
    the bytes equal the rule computed independently; a zero row stays zero; nothing is NaN; no grad; sequences
    of very different magnitudes get the same copies packed together as alone."""
    _, _, _, qi, ki = make_inputs(2, 300, (8, 2, 4, 2), 64, 128, dtype=torch.bfloat16, seed=3, requires_grad=True)
    with torch.no_grad():
        qi[0, 5, 1] = 0
        ki[1] *= 1e4  # batch element 1's keys 10^4 times element 0's
    q8, k8 = msa.fp8_index_copies(qi, ki)
    assert q8.dtype == k8.dtype == FP8 and q8.shape == qi.shape and k8.shape == ki.shape
    assert not q8.requires_grad and not k8.requires_grad
    q, k = qi.detach(), ki.detach()
    assert torch.equal(q8.view(torch.uint8), _pow2_rounded(q, q.abs().amax(-1, keepdim=True)).view(torch.uint8))
    assert torch.equal(k8.view(torch.uint8), _pow2_rounded(k, k.abs().amax(dim=(1, 3), keepdim=True)).view(torch.uint8))
    assert (q8.float()[0, 5, 1] == 0).all() and not q8.float().isnan().any() and not k8.float().isnan().any()
    # Packed: the same two sequences with cu_seqlens_k, and each alone.
    flat_q, flat_k = q.reshape(600, 4, 128), k.reshape(600, 2, 128)
    cu = torch.tensor([0, 300, 600], dtype=torch.int32)
    p8, pk8 = msa.fp8_index_copies(flat_q, flat_k, cu)
    assert torch.equal(pk8.view(torch.uint8), k8.reshape(600, 2, 128).view(torch.uint8))
    alone = msa.fp8_index_copies(flat_q[:300], flat_k[:300])[1]
    assert torch.equal(pk8[:300].view(torch.uint8), alone.view(torch.uint8))
    one = msa.fp8_index_copies(flat_q, flat_k)[1]  # no cu_seqlens_k: one sequence, sequence 0 coarsened
    assert not torch.equal(one[:300].view(torch.uint8), alone.view(torch.uint8))
    # Powers of two in the inputs change nothing.
    q8b, k8b = msa.fp8_index_copies(q * 32, k / 8)
    assert torch.equal(q8b.view(torch.uint8), q8.view(torch.uint8)) and torch.equal(k8b.view(torch.uint8),
                                                                                    k8.view(torch.uint8))


@pytest.mark.parametrize("Di,bs,topk,heads", [(128, 128, 4, (8, 2, 4, 1)), (64, 64, 3, (8, 2, 4, 2))])
def test_select_blocks_fp8_cpu(Di, bs, topk, heads):
    """The selection with index_dtype is SPEC 2 on the copies (k scaled per sequence): valid against their fp32 block
    scores, and equal to the op given the copies; it differs from the bf16 selection somewhere (topk below the
    blocks: the copies rank); the batched and packed layouts agree."""
    _, _, _, qi, ki, cu, mx = make_packed([1500, 0, 1, 900], heads, 64, Di, dtype=torch.bfloat16, seed=Di)
    scale = 1 / math.sqrt(Di)
    got = msa.select_blocks(qi, ki, topk=topk, block_size=bs, cu_seqlens=cu, max_seqlen=mx, index_dtype=FP8)
    q8, k8 = msa.fp8_index_copies(qi, ki, cu)
    assert torch.equal(got, ops.select_blocks(q8, k8, cu, mx, topk, bs, scale))
    assert_valid_topk(got, q8, k8, cu, topk, bs, scale)
    bf16 = msa.select_blocks(qi, ki, topk=topk, block_size=bs, cu_seqlens=cu, max_seqlen=mx)
    assert not torch.equal(got, bf16)
    _, _, _, qb, kb = make_inputs(2, 400, (8, 2, 4, 1), 64, Di, dtype=torch.bfloat16, seed=1)
    batched = msa.select_blocks(qb, kb, topk=topk, block_size=bs, index_dtype=FP8)
    cu2 = torch.tensor([0, 400, 800], dtype=torch.int32)
    flat = msa.select_blocks(qb.reshape(800, *qb.shape[2:]), kb.reshape(800, *kb.shape[2:]), topk=topk, block_size=bs,
                             cu_seqlens=cu2, max_seqlen=400, index_dtype=FP8)
    # k's scale per (batch element, head) batched, per (sequence, head) packed: the same copies, the same selection.
    assert torch.equal(batched, flat.view(4, 2, 400, topk).permute(1, 0, 2, 3))


def test_msa_attention_fp8_cpu():
    """msa_attention with index_dtype selects what select_blocks does with it, attends over exactly that selection
    (out equals sparse_attention's over those indices), and its KL and index gradients use q_idx / k_idx
    themselves; warmup takes it too (its selection only where indices are returned)."""
    q, k, v, qi, ki = make_inputs(2, 300, (8, 2, 4, 1), 64, 64, dtype=torch.float32, seed=4, requires_grad=True)
    out, kl, idx = msa.msa_attention(q, k, v, qi, ki, topk=3, block_size=64, return_indices=True, index_dtype=FP8)
    assert torch.equal(idx, msa.select_blocks(qi, ki, topk=3, block_size=64, index_dtype=FP8))
    torch.testing.assert_close(out, msa.sparse_attention(q, k, v, idx, block_size=64), rtol=0, atol=0)
    dq_idx, dk_idx = torch.autograd.grad(kl, (qi, ki))
    assert dq_idx.dtype == qi.dtype and torch.isfinite(dq_idx).all() and dq_idx.abs().sum() > 0
    out_w, kl_w, idx_w = msa.msa_attention(q, k, v, qi, ki, topk=3, block_size=64, warmup=True, return_indices=True,
                                           index_dtype=FP8)
    assert torch.equal(idx_w, idx)
    out_d, kl_d = msa.msa_attention(q, k, v, qi, ki, topk=3, block_size=64, warmup=True)
    torch.testing.assert_close(out_w, out_d, rtol=0, atol=0)
    torch.testing.assert_close(kl_w, kl_d, rtol=0, atol=0)


def test_msa_attention_varlen_fp8_cpu():
    q, k, v, qi, ki, cu, mx = make_packed([200, 1, 150], (8, 2, 4, 1), 64, 128, dtype=torch.float32, seed=6)
    out, kl, idx = msa.msa_attention_varlen(q, k, v, qi, ki, cu, mx, topk=2, block_size=64, return_indices=True,
                                            index_dtype=FP8)
    want = msa.select_blocks(qi, ki, topk=2, block_size=64, cu_seqlens=cu, max_seqlen=mx, index_dtype=FP8)
    assert torch.equal(idx, want)


@pytest.mark.parametrize("bad,err", [(torch.bfloat16, ValueError), (torch.float8_e5m2, ValueError),
                                     ("fp8", TypeError), (8, TypeError)])
def test_index_dtype_errors(bad, err):
    q, k, v, qi, ki = make_inputs(1, 64, (4, 4, 4, 1), 64, 64, dtype=torch.float32, seed=1)
    with pytest.raises(err, match="index_dtype"):
        msa.msa_attention(q, k, v, qi, ki, topk=1, block_size=64, index_dtype=bad)
    with pytest.raises(err, match="index_dtype"):
        msa.select_blocks(qi, ki, topk=1, block_size=64, index_dtype=bad)


def test_msa_fwd_selection_inputs_checked():
    """The op's sel_q_idx / sel_k_idx: both or neither, each of its index tensor's shape, FP8 or that dtype."""
    q, k, v, qi, ki, cu, mx = make_packed([100], (8, 2, 4, 1), 64, 64, dtype=torch.float32, seed=2)
    q8, k8 = msa.fp8_index_copies(qi, ki)
    args = (q, k, v, qi, ki, cu, mx, 2, 64, 0.125, 0.125, False, True, False, False, None, None)
    with pytest.raises(ValueError, match="both or neither"):
        ops.msa_fwd(*args, q8, None)
    with pytest.raises(ValueError, match="sel_k_idx"):
        ops.msa_fwd(*args, q8, k8[:50])
    with pytest.raises(ValueError, match="sel_q_idx"):
        ops.msa_fwd(*args, q8.to(torch.float16), k8)
    same = ops.msa_fwd(*args, qi, ki)  # the index tensors' own dtype: the selection of no copies
    assert torch.equal(same[2], ops.msa_fwd(*args)[2])


@pytest.mark.parametrize("warmup,ret", [(False, False), (True, True)])
def test_opcheck_msa_fwd_fp8(warmup, ret):
    q, k, v, qi, ki, cu, mx = make_packed([70, 30], (8, 2, 4, 1), 64, 64, dtype=torch.float32, seed=1,
                                          requires_grad=True)
    q8, k8 = msa.fp8_index_copies(qi, ki)
    # opcheck's test_schema multiplies the inputs, which torch does not implement for float8 on the CPU.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.msa_fwd, (q, k, v, qi, ki, cu, mx, 2, 64, 0.125, 0.125, warmup, ret, True, False,
                                        None, None, q8, k8), test_utils=utils)
    torch.library.opcheck(ops.select_blocks, (q8, k8, cu, mx, 2, 64, 0.125), test_utils=utils)


def test_layer_index_dtype():
    """msa.nn.MSAAttention passes index_dtype on: the layer's step runs with the FP8 selection (the same as its
    own msa_attention call with it) and its KL is differentiable in the index projections."""
    torch.manual_seed(0)
    layer = msa.nn.MSAAttention(256, 4, 2, 64, 2, 64, topk=2, block_size=64, index_dtype=FP8)
    x = torch.randn(1, 200, 256)
    y, kl = layer(x)
    assert torch.isfinite(y).all() and torch.isfinite(kl)
    kl.backward()
    assert layer.q_idx_proj.weight.grad is not None and layer.q_idx_proj.weight.grad.abs().sum() > 0
    layer.index_dtype = torch.bfloat16
    with pytest.raises(ValueError, match="index_dtype"):
        layer(x)


def test_msa_fwd_selection_follows_sel_and_kl_follows_q_idx():
    """Given selection inputs that differ from q_idx / k_idx (here: the index branch of another seed), the op's
    indices are the selection of those inputs, while out, lse, the KL rows and lse_idx are those of q_idx / k_idx
    over that selection."""
    q, k, v, qi, ki, cu, mx = make_packed([300, 200], (8, 2, 4, 1), 64, 64, dtype=torch.float32, seed=8)
    other = make_packed([300, 200], (8, 2, 4, 1), 64, 64, dtype=torch.float32, seed=9)
    sq, sk = msa.fp8_index_copies(other[3], other[4], cu)
    r = ops.msa_fwd(q, k, v, qi, ki, cu, mx, 2, 64, 0.125, 0.125, False, True, False, False, None, None, sq, sk)
    idx = r[2]
    assert torch.equal(idx, ops.select_blocks(sq, sk, cu, mx, 2, 64, 0.125))
    assert not torch.equal(idx, ops.select_blocks(qi, ki, cu, mx, 2, 64, 0.125))
    out, lse = ops.sparse_fwd(q, k, v, idx, cu, mx, 64, 0.125)
    torch.testing.assert_close(r[0], out, rtol=0, atol=0)
    kl_rows, lse_idx = ref.index_kl_rows(q, k, lse, qi, ki, idx, cu, 64, 0.125, 0.125)
    torch.testing.assert_close(r[7], kl_rows, rtol=0, atol=0)
    torch.testing.assert_close(r[4], lse_idx, rtol=0, atol=0)


def test_fp8_index_under_autocast_cpu():
    """Under torch.autocast the ops cast their floating inputs to the autocast dtype, but not the FP8 copies: the
    selection is that of the copies of the inputs as given."""
    q, k, v, qi, ki = make_inputs(1, 400, (8, 2, 4, 1), 64, 64, dtype=torch.float32, seed=10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, kl, idx = msa.msa_attention(q, k, v, qi, ki, topk=2, block_size=64, return_indices=True,
                                         index_dtype=FP8)
    assert out.dtype == torch.bfloat16
    assert torch.equal(idx, msa.select_blocks(qi, ki, topk=2, block_size=64, index_dtype=FP8))
