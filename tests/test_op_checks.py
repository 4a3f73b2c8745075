"""Direct torch.ops.msa calls on the CPU: the structural checks the CUDA host code makes (csrc/api) refuse a bad
argument with a ValueError naming it, instead of broadcasting it into a wrong answer (msa/_op_checks.py)."""
import pytest
import torch

from helpers import make_packed
from msa._ops import ops

HEADS = (8, 2, 4, 1)
BS, TOPK, SCALE = 64, 2, 0.125


def _case():
    q, k, v, qi, ki, cu, mx = make_packed([150, 40], HEADS, 64, 64, dtype=torch.float32, seed=2)
    out, kl, idx, lse, lse_idx, g_q, g_k, _ = ops.msa_fwd(q, k, v, qi, ki, cu, mx, TOPK, BS, SCALE, SCALE, False, True,
                                                          True)
    return dict(q=q, k=k, v=v, qi=qi, ki=ki, cu=cu, mx=mx, out=out, idx=idx, lse=lse, lse_idx=lse_idx, g_q=g_q,
                g_k=g_k, dout=torch.randn_like(out), dkl=torch.tensor(1.0))


def _sparse_bwd(c):
    return ops.sparse_bwd(c["dout"], c["q"], c["k"], c["v"], c["out"], c["lse"], c["idx"], c["cu"], c["mx"], BS, SCALE)


def _msa_bwd(c, **kw):
    c = {**c, **kw}
    return ops.msa_bwd(c["dout"], c["dkl"], c["q"], c["k"], c["v"], c["out"], c["lse"], c["qi"], c["ki"], c["lse_idx"],
                       c["idx"], c["g_q"], c["g_k"], c["cu"], c["mx"], BS, SCALE, SCALE, False)


def _msa_fwd(c, topk=TOPK):
    return ops.msa_fwd(c["q"], c["k"], c["v"], c["qi"], c["ki"], c["cu"], c["mx"], topk, BS, SCALE, SCALE, False,
                       False, False)


def _sparse_fwd(c):
    return ops.sparse_fwd(c["q"], c["k"], c["v"], c["idx"], c["cu"], c["mx"], BS, SCALE)


BAD = [  # (argument named in the error, the change, the call)
    ("lse", dict(lse=lambda c: c["lse"][:1]), _sparse_bwd),  # (1, T) would broadcast
    ("lse", dict(lse=lambda c: c["lse"][:1]), _msa_bwd),
    ("lse", dict(lse=lambda c: c["lse"].double()), _sparse_bwd),
    ("indices", dict(idx=lambda c: c["idx"][:, :-1]), _sparse_fwd),  # one token short
    ("indices", dict(idx=lambda c: c["idx"][:, :-1]), _sparse_bwd),
    ("indices", dict(idx=lambda c: c["idx"][:, :-1]), _msa_bwd),
    ("indices", dict(idx=lambda c: c["idx"].long()), _sparse_fwd),
    ("indices", dict(idx=lambda c: c["idx"] > 0), _sparse_fwd),  # bool: would mean blocks 0 and 1
    ("indices", dict(idx=lambda c: c["idx"][:3]), _sparse_fwd),  # Hi = 3 does not divide Hq = 8
    ("v", dict(v=lambda c: c["v"][:, :1]), _sparse_fwd),  # Hkv of v != that of k
    ("v", dict(v=lambda c: c["v"][:, :1]), _msa_fwd),
    ("k", dict(k=lambda c: c["k"].bfloat16(), v=lambda c: c["v"].bfloat16()), _sparse_fwd),
    ("q", dict(q=lambda c: c["q"].int()), _sparse_fwd),
    ("q_idx", dict(qi=lambda c: c["qi"].double()), _msa_fwd),
    ("k_idx", dict(ki=lambda c: c["ki"][:-1]), _msa_fwd),
    ("dout", dict(dout=lambda c: c["dout"].double()), _sparse_bwd),
    ("out", dict(out=lambda c: c["out"][:1]), _sparse_bwd),
    ("d_kl", dict(dkl=lambda c: torch.ones(2)), _msa_bwd),
    ("q", dict(q=lambda c: c["q"][:, :, 0]), _sparse_fwd),  # rank 2
]


@pytest.mark.parametrize("name, change, call", BAD, ids=[f"{b[2].__name__}-{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_direct_op_call_refuses(name, change, call):
    c = _case()
    c.update({key: make(c) for key, make in change.items()})
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        call(c)


@pytest.mark.parametrize("topk", [0, 33])
def test_topk_range(topk):
    with pytest.raises(ValueError, match="^topk: expected"):
        _msa_fwd(_case(), topk=topk)
    c = _case()
    with pytest.raises(ValueError, match="^topk: expected"):
        ops.select_blocks(c["qi"], c["ki"], c["cu"], c["mx"], topk, BS, SCALE)


def test_d_kl_shape_one_value():
    """A d_kl of one value in any shape acts as the scalar (the index gradients keep q_idx's shape)."""
    c = _case()
    want = _msa_bwd(c)
    got = _msa_bwd(c, dkl=torch.ones(1, 1, 1))
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)


def test_meta_cu_seqlens_refused():
    """CPU tensors with a meta cu_seqlens dispatch to the fake kernels: they refuse the mix."""
    c = _case()
    with pytest.raises(ValueError, match="one device"):
        ops.sparse_fwd(c["q"], c["k"], c["v"], c["idx"], c["cu"].to("meta"), c["mx"], BS, SCALE)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.validate_cu_seqlens(c["cu"].to("meta"), 190, 150)
