"""The portable output pass in 64-row tiles: what GPUs with less than Hopper's 227 KB of shared memory per
block run (the A100 has 163 KB; the 128-row tile needs 215 KB at D = 128). MSA_FWD_ROWS=64 forces it,
so it is checked here on Hopper against the 128-row tile and against the float64 reference."""
import math

import pytest
import torch

from attention_check import assert_forward_close, reference_forward
from helpers import assert_same_forward, make_packed, poison_allocator

pytestmark = pytest.mark.gpu
ops = torch.ops.msa

# (Hq, Hkv, Hi, Hki): heads per (unit, kv head) Gu = 2, 4, 8 on the register KL path, 3 and 16 off it,
# and kv heads split over an index group (J = 2, 4).
ROW_TILE_HEADS = [(8, 2, 4, 1), (16, 2, 4, 1), (16, 2, 2, 1), (12, 4, 4, 1), (16, 1, 1, 1), (8, 4, 2, 1),
                  (8, 8, 2, 1)]


def _run(monkeypatch, rows, args):
    monkeypatch.setenv("MSA_PORTABLE_KERNELS", "1")
    if rows == 64:
        monkeypatch.setenv("MSA_FWD_ROWS", "64")
    else:
        monkeypatch.delenv("MSA_FWD_ROWS", raising=False)
    poison_allocator()
    return ops.msa_fwd(*args)


@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize("heads", ROW_TILE_HEADS)
def test_row_tile_matches_128(monkeypatch, heads, warmup):
    """Each entry is computed the same way in either tile (the same MMAs per row, the KL per unit in
    the same order): out, lse, lse_idx and the KL are bitwise equal; the index gradients (fp32
    atomics) equal up to rounding."""
    q, k, v, qi, ki, cu, mx = make_packed([1500, 700, 1], heads, 128, 128, dtype=torch.bfloat16, device="cuda",
                                          seed=sum(heads) + warmup)
    s = 1 / math.sqrt(128)
    args = (q, k, v, qi, ki, cu, mx, 6, 128, s, s, warmup, False, True)
    big = _run(monkeypatch, 128, args)
    small = _run(monkeypatch, 64, args)
    assert_same_forward(big, small, "the row tile (128 against 64 rows)", written=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [(64, 64, 64), (128, 128, 128)])
def test_row_tile_against_reference(monkeypatch, case, dtype):
    """The 64-row tile on its own against the reference: D = 64 and 128, blocks of 64 and 128."""
    D, Di, bs = case
    q, k, v, qi, ki, cu, mx = make_packed([900, 1, 129, 0, 2100], (16, 2, 4, 1), D, Di, dtype=dtype, device="cuda",
                                          seed=D + bs)
    scale, iscale = 1 / math.sqrt(D), 1 / math.sqrt(Di)
    args = (q, k, v, qi, ki, cu, mx, 5, bs, scale, iscale, False, True, False)  # return the indices
    out, kl, idx, lse, lse_idx = _run(monkeypatch, 64, args)[:5]
    exact, (lowp_out, _) = reference_forward(q, k, v, qi, ki, idx, cu, bs, scale, iscale)
    assert_forward_close(out, kl, lse, lse_idx, exact, lowp_out)
