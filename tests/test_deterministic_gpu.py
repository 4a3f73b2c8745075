"""deterministic=True (and torch.use_deterministic_algorithms): all five gradients bitwise identical between
runs on the same inputs, on both kernel paths and every shape class, and as accurate as the default mode.

The runs differ in the order the work items launch (MSA_ITEM_ORDER=0: key order instead of largest first),
which reorders every cross-CTA sum: in the default mode that changes the fp32 atomics' rounding (checked
below, so the comparison can see a difference), in the deterministic mode it must change nothing."""
import math

import pytest
import torch

import msa
from attention_check import assert_grads_close
from helpers import HEADS, make_inputs, make_packed, sm90_kernels_run

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_choice")]


def _run(fn, xs, seed, monkeypatch, key_order):
    if key_order:
        monkeypatch.setenv("MSA_ITEM_ORDER", "0")
    else:
        monkeypatch.delenv("MSA_ITEM_ORDER", raising=False)
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    res = fn(*leaves)
    outs = list(res[:2]) if isinstance(res, tuple) else [res]
    g = torch.Generator(device="cpu").manual_seed(seed)
    ups = [torch.randn(outs[0].shape, generator=g).to(outs[0]), torch.tensor(0.7, device="cuda")][:len(outs)]
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, ups))


def _assert_bitwise(fn, xs, seed, monkeypatch):
    a = _run(fn, xs, seed, monkeypatch, key_order=False)
    b = _run(fn, xs, seed, monkeypatch, key_order=True)
    c = _run(fn, xs, seed, monkeypatch, key_order=False)
    names = ["out", "kl", "dq", "dk", "dv", "dq_idx", "dk_idx"] if len(a) == 7 else ["out", "dq", "dk", "dv"]
    for name, x, y, z in zip(names, a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z), f"{name} differs between runs"
    return a


CASES = [  # (B, N, heads, D, Di, block_size, topk, dtype)
    (2, 1, HEADS[0], 64, 64, 128, 16, torch.bfloat16), (2, 100, HEADS[1], 128, 64, 64, 3, torch.float16),
    (1, 700, HEADS[2], 64, 128, 64, 5, torch.bfloat16), (2, 1000, HEADS[3], 128, 128, 128, 4, torch.float16),
    (1, 3000, (16, 2, 4, 1), 128, 128, 128, 16, torch.bfloat16), (1, 900, (12, 4, 4, 1), 64, 64, 64, 8,
                                                                 torch.bfloat16),
]


@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_msa_attention_deterministic(case, warmup, monkeypatch):
    B, N, heads, D, Di, bs, topk, dtype = CASES[case]
    xs = make_inputs(B, N, heads, D, Di, dtype=dtype, device="cuda", seed=case)

    def fn(*x):
        return msa.msa_attention(*x, topk=topk, block_size=bs, warmup=warmup, deterministic=True)
    _assert_bitwise(fn, xs, case, monkeypatch)


@pytest.mark.parametrize("bwd", ["default", "general"])
@pytest.mark.parametrize("heads", HEADS + [(8, 8, 2, 1)])
def test_varlen_and_sparse_attention_deterministic(heads, bwd, kernel_choice, monkeypatch):
    """bwd = general: the general Hopper backward (MSA_BWD_WS=0; the default is the warp-specialized one), whose
    deterministic writer is another code path."""
    if bwd == "general":
        if kernel_choice == "portable" or not sm90_kernels_run():
            pytest.skip("MSA_BWD_WS chooses between the two sm_90a backward kernels")
        monkeypatch.setenv("MSA_BWD_WS", "0")
    else:
        monkeypatch.delenv("MSA_BWD_WS", raising=False)
    q, k, v, qi, ki, cu, mx = make_packed([1000, 1, 129, 0, 2500], heads, 128, 64, dtype=torch.bfloat16,
                                          device="cuda", seed=sum(heads))

    def varlen(*x):
        return msa.msa_attention_varlen(*x, cu, mx, topk=5, block_size=128, deterministic=True)
    _assert_bitwise(varlen, (q, k, v, qi, ki), 1, monkeypatch)
    idx = msa.select_blocks(qi, ki, topk=5, block_size=128, cu_seqlens=cu, max_seqlen=mx)

    def sparse(*x):
        return msa.sparse_attention(*x, idx, block_size=128, cu_seqlens=cu, max_seqlen=mx, deterministic=True)
    _assert_bitwise(sparse, (q, k, v), 2, monkeypatch)


def test_deterministic_is_accurate_and_the_default_is_not_bitwise(monkeypatch):
    """The deterministic gradients pass the same accuracy check as the default ones; and in this case
    the default mode's do change with the launch order (so the bitwise checks above can fail)."""
    xs = make_inputs(1, 4096, (16, 2, 4, 1), 128, 128, dtype=torch.bfloat16, device="cuda", seed=3)

    def det(*x):
        return msa.msa_attention(*x, topk=16, block_size=128, return_indices=True, deterministic=True)
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    out, kl, idx = det(*leaves)
    g = torch.Generator(device="cpu").manual_seed(3)
    dout, dkl = torch.randn(out.shape, generator=g).to(out), torch.tensor(0.7, device="cuda")
    grads = torch.autograd.grad((out, kl), leaves, (dout, dkl))
    flat = [x.reshape(4096, *x.shape[2:]) for x in xs]
    cu = torch.tensor([0, 4096], dtype=torch.int32, device="cuda")
    packed_idx = idx.permute(1, 0, 2, 3).reshape(4, 4096, 16)
    assert_grads_close([x.reshape(4096, *x.shape[2:]) for x in grads], dout.reshape(4096, 16, 128), dkl, *flat,
                       packed_idx, cu, 128, 1 / math.sqrt(128), 1 / math.sqrt(128))

    def default(*x):
        return msa.msa_attention(*x, topk=16, block_size=128, deterministic=False)
    a = _run(default, xs, 3, monkeypatch, key_order=False)
    b = _run(default, xs, 3, monkeypatch, key_order=True)
    assert any(not torch.equal(x, y) for x, y in zip(a[2:], b[2:])), "the default mode never differed"


def test_use_deterministic_algorithms_turns_it_on(monkeypatch):
    xs = make_inputs(2, 700, (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=4)

    def fn(*x):
        return msa.msa_attention(*x, topk=4, block_size=64)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _assert_bitwise(fn, xs, 4, monkeypatch)
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("scales", [(-1.0, 1.0), (1.0, -1.5), (-0.5, -2.0)])
def test_deterministic_negative_scales(scales, monkeypatch):
    """A negative softmax or index scale: the deterministic summation grid is sized by the scale's magnitude
    (a negative bound once made every deterministic dq_idx element NaN), so the gradients are finite, bitwise
    repeatable and as accurate as the reference demands."""
    N, heads, dtype = 1500, (8, 2, 4, 1), torch.bfloat16
    xs = make_inputs(1, N, heads, 128, 64, dtype=dtype, device="cuda", seed=11)
    scale, iscale = scales[0] / math.sqrt(128), scales[1] / math.sqrt(64)

    def fn(*x):
        return msa.msa_attention(*x, topk=6, block_size=64, softmax_scale=scale, index_scale=iscale,
                                 deterministic=True)
    a = _assert_bitwise(fn, xs, 11, monkeypatch)
    assert all(torch.isfinite(x).all() for x in a), "non-finite outputs or gradients"
    idx = msa.select_blocks(xs[3][0], xs[4][0], topk=6, block_size=64, index_scale=iscale,
                            cu_seqlens=torch.tensor([0, N], dtype=torch.int32, device="cuda"), max_seqlen=N)
    g = torch.Generator(device="cpu").manual_seed(11)  # _run's upstream gradients
    dout, dkl = torch.randn(a[0].shape, generator=g).to(a[0]), torch.tensor(0.7, device="cuda")
    cu = torch.tensor([0, N], dtype=torch.int32, device="cuda")
    assert_grads_close([x[0] for x in a[2:]], dout[0], dkl, *[x[0] for x in xs], idx, cu, 64, scale, iscale)
