"""The CUDA index top-k (select_blocks) against SPEC 2 and the CPU reference."""
import math
import os

import pytest
import torch

import msa
from helpers import HEADS, make_inputs, make_packed, poison_allocator, sm90_kernels_run
from topk_check import assert_valid_topk

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_choice")]


def _check(q_idx, k_idx, cu, mx, topk, bs, ref_compare=True, scale=None):
    scale = 1 / math.sqrt(q_idx.shape[-1]) if scale is None else scale
    kw = dict(topk=topk, block_size=bs, index_scale=scale, max_seqlen=mx)
    poison_allocator()
    got = msa.select_blocks(q_idx, k_idx, cu_seqlens=cu, **kw)
    assert got.is_cuda and got.dtype == torch.int32 and got.shape == (q_idx.shape[1], q_idx.shape[0], topk)
    assert_valid_topk(got, q_idx, k_idx, cu, topk, bs, scale)
    again = msa.select_blocks(q_idx, k_idx, cu_seqlens=cu, **kw)
    assert torch.equal(got, again), "selection differs between two runs"
    if ref_compare:  # same inputs on the CPU reference: equal up to near-ties
        want = msa.select_blocks(q_idx.cpu(), k_idx.cpu(), cu_seqlens=cu.cpu(), **kw)
        rows_differ = (got.cpu() != want).any(-1).float().mean().item()
        assert rows_differ < 1e-3, f"{rows_differ:.2%} rows differ from the reference"
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N", [1, 5, 127, 128, 129, 300, 700, 2048])
@pytest.mark.parametrize("heads", HEADS + [(8, 8, 8, 1), (16, 2, 16, 16)])
def test_select_blocks_shapes(dtype, N, heads):
    i = N + sum(heads)
    Di, bs, topk = [64, 128][i % 2], [64, 128][(i // 2) % 2], [1, 3, 16, 32][(i // 3) % 4]
    _, _, _, qi, ki = make_inputs(2, N, heads, 64, Di, dtype=dtype, device="cuda", seed=i)
    B = 2
    cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device="cuda")
    _check(qi.reshape(B * N, *qi.shape[2:]), ki.reshape(B * N, *ki.shape[2:]), cu, N, topk, bs)


@pytest.mark.parametrize("bs,topk", [(128, 16), (64, 16), (128, 32)])
def test_select_blocks_long(bs, topk):
    _, _, _, qi, ki, cu, mx = make_packed([8192, 3001, 1], (16, 2, 4, 1), 64, 128, dtype=torch.bfloat16,
                                          device="cuda", seed=bs + topk)
    _check(qi, ki, cu, mx, topk, bs, ref_compare=(bs == 128 and topk == 16))


@pytest.mark.parametrize("scale", [-0.125, 0.0])
def test_select_blocks_negative_and_zero_scale(scale):
    """A negative index scale ranks blocks by the min of <q, k> (the Hopper kernel folds the sign into
    Q); a zero scale makes every block tie, so the lowest blocks win."""
    _, _, _, qi, ki, cu, mx = make_packed([2000, 517], (8, 2, 4, 1), 64, 128, dtype=torch.bfloat16,
                                          device="cuda", seed=17)
    _check(qi, ki, cu, mx, 16, 64, scale=scale)


def test_select_blocks_batched_api_and_ties():
    """Batched layout round trip, and exact ties resolve to the lower block as on the CPU."""
    _, _, _, qi, ki = make_inputs(2, 1000, (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=3)
    got = msa.select_blocks(qi, ki, topk=5, block_size=64)
    want = msa.select_blocks(qi.cpu(), ki.cpu(), topk=5, block_size=64)
    assert got.shape == want.shape == (2, 4, 1000, 5)
    assert (got.cpu() != want).any(-1).float().mean() < 1e-3
    ones = torch.ones_like(ki)
    tie = msa.select_blocks(qi, ones, topk=3, block_size=64)
    torch.testing.assert_close(tie.cpu(), msa.select_blocks(qi.cpu(), ones.cpu(), topk=3, block_size=64),
                               rtol=0, atol=0)


def test_select_blocks_strided_inputs():
    """Non-contiguous (but last-dim contiguous) inputs give the same selection."""
    _, _, _, qi, ki = make_inputs(1, 900, (8, 2, 4, 1), 64, 128, dtype=torch.bfloat16, device="cuda", seed=4)
    base = msa.select_blocks(qi, ki, topk=4, block_size=128)
    qs = torch.empty(1, 900, 4, 256, dtype=qi.dtype, device="cuda")[..., :128]
    qs.copy_(qi)
    torch.testing.assert_close(msa.select_blocks(qs, ki, topk=4, block_size=128), base, rtol=0, atol=0)


def test_select_blocks_many_sequences():
    """A grid large enough for the 128-row tiles (>= one wave of 2 CTAs per SM on an H200: 48 sequences
    x 32 tiles); the smaller cases above run the 64-row tiles."""
    lengths = [1024 + 37 * (i % 5) for i in range(48)]
    _, _, _, qi, ki, cu, mx = make_packed(lengths, (16, 2, 4, 1), 64, 128, dtype=torch.bfloat16, device="cuda",
                                          seed=21)
    _check(qi, ki, cu, mx, 16, 128)


@pytest.mark.parametrize("bs", [128, 64])
@pytest.mark.parametrize("lengths,heads", [([8192], (16, 2, 4, 1)), ([3000, 1, 700], (8, 2, 8, 1)),
                                           ([2500], (16, 2, 16, 16)), ([900, 1300], (64, 1, 64, 1))])
def test_select_blocks_warpgroup_count(monkeypatch, lengths, heads, bs):
    """The Hopper kernel's 2- and 4-warpgroup CTAs (MSA_TOPK_WG; by default 2 where the 4-warpgroup grid fits in
    one wave) give the same selection bit for bit: a row's scores do not depend on how rows are tiled. Both block
    sizes (a 128-key sub-tile is one block or two; each has its own path through the register lists, s68)."""
    if os.environ.get("MSA_PORTABLE_KERNELS") == "1" or not sm90_kernels_run():
        pytest.skip("the warpgroup count is the sm_90a kernel's")
    _, _, _, qi, ki, cu, mx = make_packed(lengths, heads, 64, 128, dtype=torch.bfloat16, device="cuda", seed=31)
    got = {}
    for wg in ("2", "4"):
        monkeypatch.setenv("MSA_TOPK_WG", wg)
        got[wg] = _check(qi, ki, cu, mx, 16, bs, ref_compare=wg == "2")
    assert torch.equal(got["2"], got["4"])
