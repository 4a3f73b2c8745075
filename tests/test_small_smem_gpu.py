"""The small-smem configuration of the portable sparse kernels: what GPUs with 99 KB of shared memory per
block (sm_86, sm_89, sm_120) run. Its stats pass takes 64-row tiles whose warp pairs split the keys, its
output pass stages the kv block in two 64-key halves, and its backward takes 32-row tiles of a single
stage (csrc/smxx/sparse_fwd/sparse_fwd_body.cuh, csrc/sm80/sparse_bwd/sparse_bwd_kernel.cuh).
MSA_SMALL_SMEM=1 forces it, so it is checked here on any GPU: out, lse, kl, lse_idx and all five
gradients against the float64 reference (the oracles of the other GPU tests), against the default
portable configuration, and the deterministic mode's bitwise reproducibility."""
import math

import pytest
import torch

import msa
from attention_check import assert_close_style, assert_grads_close, assert_lse_close, low_precision, run_ref
from helpers import HEADS, make_inputs, make_packed, poison_allocator
from msa import reference as ref
from test_deterministic_gpu import _assert_bitwise
from test_sparse_bwd_gpu import _check_grads, _check_sparse_backward
from test_sparse_fwd_gpu import _fwd_case, _random_indices
from test_warmup_gpu import _check as _check_warmup

pytestmark = pytest.mark.gpu
ops = torch.ops.msa


@pytest.fixture
def small(monkeypatch):
    """The portable kernels in the small-smem configuration (read at every call)."""
    monkeypatch.setenv("MSA_PORTABLE_KERNELS", "1")
    monkeypatch.setenv("MSA_SMALL_SMEM", "1")
    monkeypatch.delenv("MSA_FWD_ROWS", raising=False)
    return monkeypatch


# (Hq, Hkv, Hi, Hki): heads per (unit, kv head) Gu = 1, 2, 4 on the register KL path; Gu = 8 (the
# per-unit KL loop in this configuration), 3 and 16 off it; kv heads split over an index group (J = 2, 4).
SMALL_HEADS = [(4, 4, 4, 1), (8, 2, 4, 1), (16, 2, 4, 1), (16, 2, 2, 1), (12, 4, 4, 1), (16, 1, 1, 1),
               (8, 4, 2, 1), (8, 8, 2, 1)]

# (B, N, D, Di, block_size, topk): D and Di 64 / 128, blocks of 64 and 128, short last blocks, N < one block.
CASES = [
    (2, 1, 64, 64, 128, 16), (2, 100, 128, 64, 64, 3), (1, 129, 128, 128, 64, 16), (1, 300, 64, 128, 128, 4),
    (2, 700, 128, 128, 128, 3), (1, 1000, 64, 64, 64, 8), (2, 2048, 128, 128, 128, 16), (1, 2100, 128, 64, 128, 7),
]


def _flat(B, N, heads, D, Di, dtype, seed):
    x = make_inputs(B, N, heads, D, Di, dtype=dtype, device="cuda", seed=seed)
    flat = [t.reshape(B * N, *t.shape[2:]) for t in x]
    cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device="cuda")
    return flat, cu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_against_reference(small, case, dtype):
    """out, lse, lse_idx and kl of both passes against the float64 reference; two runs bitwise equal."""
    B, N, D, Di, bs, topk = CASES[case]
    flat, cu = _flat(B, N, HEADS[case % len(HEADS)], D, Di, dtype, seed=case)
    _fwd_case(*flat, cu, N, topk, bs)


@pytest.mark.parametrize("heads", SMALL_HEADS)
@pytest.mark.parametrize("dims", [(128, 128, 128), (64, 128, 64), (128, 64, 128)])
def test_forward_varlen_heads(small, heads, dims):
    """Every head class (both KL paths, J > 1) over packed sequences of odd lengths."""
    D, Di, bs = dims
    q, k, v, qi, ki, cu, mx = make_packed([1000, 1, 129, 0, 2500, 64], heads, D, Di, dtype=torch.bfloat16,
                                          device="cuda", seed=sum(heads) + D + Di)
    _fwd_case(q, k, v, qi, ki, cu, mx, 5, bs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gradients_against_reference(small, case, dtype):
    """dq, dk, dv, dq_idx, dk_idx through msa_attention_varlen against the float64 reference."""
    B, N, D, Di, bs, topk = CASES[case]
    flat, cu = _flat(B, N, HEADS[case % len(HEADS)], D, Di, dtype, seed=case)
    _check_grads(*flat, cu, N, topk, bs, seed=case)


@pytest.mark.parametrize("heads", SMALL_HEADS + [(64, 1, 1, 1), (48, 1, 1, 1)])
def test_gradients_varlen_heads(small, heads):
    """Every head class; 64 and 48 heads per unit make the backward's 32-row tiles cut through units."""
    q, k, v, qi, ki, cu, mx = make_packed([700, 1, 129, 0, 1300], heads, 128, 128, dtype=torch.bfloat16,
                                          device="cuda", seed=sum(heads))
    _check_grads(q, k, v, qi, ki, cu, mx, 4, 128, seed=sum(heads))


@pytest.mark.parametrize("per_item", ["7", "64"])
def test_split_items(small, per_item):
    """Small work items (a kv block's units over several CTAs in both directions): the forward's halves
    meet per item (its KL sums, its partial outputs), the backward's dK / dV per CTA."""
    small.setenv("MSA_FWD_UNITS_PER_ITEM", per_item)
    small.setenv("MSA_BWD_UNITS_PER_ITEM", per_item)
    q, k, v, qi, ki, cu, mx = make_packed([1500, 300, 1], (8, 2, 4, 1), 128, 128, dtype=torch.bfloat16,
                                          device="cuda", seed=21)
    _check_grads(q, k, v, qi, ki, cu, mx, 6, 128, seed=5)
    _fwd_case(q, k, v, qi, ki, cu, mx, 6, 128)


@pytest.mark.parametrize("bs", [64, 128])
@pytest.mark.parametrize("heads", HEADS)
def test_sparse_attention(small, heads, bs):
    """sparse_attention (no index branch): hand-made selections with repeats, -1 gaps and blocks past the
    token's own, forward and backward against the reference; every token also selects block 0 (a hot
    key split over several backward items)."""
    lengths = [700, 64, 1, 333]
    q, k, v, qi, _, cu, mx = make_packed(lengths, heads, 128, 64, dtype=torch.bfloat16, device="cuda", seed=7)
    idx = _random_indices(heads[2], lengths, 4, bs, seed=sum(heads) + bs)
    idx[..., 2] = 0
    scale = 1 / math.sqrt(q.shape[-1])
    poison_allocator()
    out, lse = msa.sparse_attention(q, k, v, idx, block_size=bs, return_lse=True, cu_seqlens=cu, max_seqlen=mx)
    exact_out, exact_lse = run_ref(ref.sparse_fwd, q, k, v, idx, cu, bs, scale)
    with low_precision():
        lowp_out, _ = run_ref(ref.sparse_fwd, q, k, v, idx, cu, bs, scale, dtype=q.dtype)
    assert_close_style("out", out, exact_out, lowp_out, q.dtype)
    assert_lse_close("lse", lse, exact_lse)
    small.setenv("MSA_BWD_UNITS_PER_ITEM", "100")
    _check_sparse_backward(q, k, v, idx, cu, mx, bs)


def _fwd_bwd(q, k, v, qi, ki, cu, mx, topk, bs, seed, deterministic=False):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, qi, ki)]
    poison_allocator()
    out, kl, idx = msa.msa_attention_varlen(*leaves, cu, mx, topk=topk, block_size=bs, return_indices=True,
                                            deterministic=deterministic)
    g = torch.Generator(device="cpu").manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(out)
    dkl = torch.tensor(0.9, device=q.device)
    grads = torch.autograd.grad((out, kl), leaves, (dout, dkl))
    return [out.detach(), kl.detach(), idx] + list(grads)


def _assert_near(name, got, want, rel):
    """max |got - want| <= rel * max |want| (+ a tiny floor for all-zero tensors)."""
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= rel * scale + 1e-30, f"{name}: max difference {err:.3g} > {rel} * {scale:.3g}"


@pytest.mark.parametrize("case", [(16, 2, 4, 1, 128, 128, 128), (8, 8, 2, 1, 64, 64, 64), (8, 1, 1, 1, 128, 64, 64)])
def test_matches_default_configuration(monkeypatch, case):
    """The same math as the default portable configuration: the same selection and lse_idx (the index
    stats are computed the same way), the rest within a few roundings (the small configuration adds a
    key half's bf16 / fp16 partial output to the other's and merges the (max, sum) of key halves, so it is
    not bitwise the default's)."""
    *heads, D, Di, bs = case
    q, k, v, qi, ki, cu, mx = make_packed([1800, 5, 700], tuple(heads), D, Di, dtype=torch.bfloat16,
                                          device="cuda", seed=sum(case))
    scale, iscale = 1 / math.sqrt(D), 1 / math.sqrt(Di)
    args = (q, k, v, qi, ki, cu, mx, 6, bs, scale, iscale, False, True, True)
    monkeypatch.setenv("MSA_PORTABLE_KERNELS", "1")
    monkeypatch.delenv("MSA_FWD_ROWS", raising=False)
    runs = {}
    for config in ("default", "small"):
        if config == "small":
            monkeypatch.setenv("MSA_SMALL_SMEM", "1")
        else:
            monkeypatch.delenv("MSA_SMALL_SMEM", raising=False)
        runs[config] = (ops.msa_fwd(*args), _fwd_bwd(q, k, v, qi, ki, cu, mx, 6, bs, seed=1))
    (fd, gd), (fs, gs) = runs["default"], runs["small"]
    assert torch.equal(fd[2], fs[2]), "the selection differs"
    assert torch.equal(fd[4], fs[4]), "lse_idx differs"
    torch.testing.assert_close(fs[3], fd[3], rtol=1e-5, atol=1e-5, msg="lse")
    _assert_near("out", fs[0], fd[0], 2e-2)
    _assert_near("kl", fs[1], fd[1], 1e-3)
    for name, a, b in zip(("kl_dq_idx", "kl_dk_idx"), fs[5:7], fd[5:7]):
        _assert_near(name, a, b, 1e-2)
    for name, a, b in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"), gs[3:], gd[3:]):
        _assert_near(name, a, b, 2e-2)


CASES_DET = [  # (B, N, heads, D, Di, block_size, topk, dtype)
    (2, 100, HEADS[1], 128, 64, 64, 3, torch.float16), (1, 700, HEADS[2], 64, 128, 64, 5, torch.bfloat16),
    (2, 1000, HEADS[3], 128, 128, 128, 4, torch.float16), (1, 3000, (16, 2, 4, 1), 128, 128, 128, 16, torch.bfloat16),
    (1, 900, (12, 4, 4, 1), 64, 64, 128, 8, torch.bfloat16), (1, 600, (64, 1, 1, 1), 128, 128, 128, 4, torch.bfloat16),
]


@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize("case", range(len(CASES_DET)))
def test_deterministic_bitwise(small, case, warmup):
    """deterministic=True: every output and gradient bitwise equal between runs of different launch orders."""
    B, N, heads, D, Di, bs, topk, dtype = CASES_DET[case]
    xs = make_inputs(B, N, heads, D, Di, dtype=dtype, device="cuda", seed=case)

    def fn(*x):
        return msa.msa_attention(*x, topk=topk, block_size=bs, warmup=warmup, deterministic=True)
    _assert_bitwise(fn, xs, case, small)


def test_deterministic_is_accurate(small):
    """The deterministic mode's gradients in this configuration pass the reference check too."""
    q, k, v, qi, ki, cu, mx = make_packed([2500, 700], (16, 2, 4, 1), 128, 128, dtype=torch.bfloat16,
                                          device="cuda", seed=3)
    res = _fwd_bwd(q, k, v, qi, ki, cu, mx, 8, 128, seed=3, deterministic=True)
    g = torch.Generator(device="cpu").manual_seed(3)
    dout = torch.randn(res[0].shape, generator=g).to(res[0])
    assert_grads_close(res[3:], dout, torch.tensor(0.9, device="cuda"), q, k, v, qi, ki, res[2], cu, 128,
                       1 / math.sqrt(128), 1 / math.sqrt(128))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [(2, 1, 64, 64, 128), (1, 300, 128, 64, 64), (2, 700, 64, 128, 128),
                                  (1, 2048, 128, 128, 128)])
def test_warmup(small, case, dtype):
    """Warmup (dense) mode: the dense KL pass runs the small forward kernels (KL only, no P V)."""
    B, N, D, Di, bs = case
    flat, cu = _flat(B, N, HEADS[N % len(HEADS)], D, Di, dtype, seed=N)
    _check_warmup(*flat, cu, N, 16, bs, seed=N)


@pytest.mark.parametrize("heads", [(8, 2, 4, 1), (8, 4, 2, 1), (16, 1, 1, 1)])
def test_warmup_varlen(small, heads):
    q, k, v, qi, ki, cu, mx = make_packed([900, 1, 129, 0, 1500], heads, 128, 128, dtype=torch.bfloat16,
                                          device="cuda", seed=sum(heads))
    _check_warmup(q, k, v, qi, ki, cu, mx, 16, 128, seed=3)


def test_long_sequence(small):
    """The bench's head layout over 8K tokens: items of hundreds of units, many tiles per kv block."""
    q, k, v, qi, ki, cu, mx = make_packed([8192], (16, 2, 4, 1), 128, 128, dtype=torch.bfloat16, device="cuda",
                                          seed=8)
    _fwd_case(q, k, v, qi, ki, cu, mx, 16, 128)
    _check_grads(q, k, v, qi, ki, cu, mx, 16, 128, seed=8)


def test_configuration_is_taken(monkeypatch):
    """The tests above run the 99 KB kernels: the host's choice (torch.ops.msa.device_config, the same
    functions the ops decide with) follows MSA_SMALL_SMEM on the portable path, and the Hopper path has
    its own tiles."""
    x = torch.empty(0, device="cuda")
    monkeypatch.setenv("MSA_PORTABLE_KERNELS", "1")
    monkeypatch.setenv("MSA_SMALL_SMEM", "1")
    assert ops.device_config(x)[3].item() == 1
    monkeypatch.delenv("MSA_SMALL_SMEM")
    optin = ops.device_config(x)[4].item()
    assert ops.device_config(x)[3].item() == int(optin < 150 * 1024)
    if torch.cuda.get_device_capability() == (9, 0) and ops.device_config(x)[0].item():
        monkeypatch.delenv("MSA_PORTABLE_KERNELS")
        monkeypatch.setenv("MSA_SMALL_SMEM", "1")
        assert ops.device_config(x)[1].item() == 1 and ops.device_config(x)[3].item() == 0
