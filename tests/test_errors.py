"""SPEC 7: every bad-input class raises ValueError/TypeError naming the argument, before any launch."""
import pytest
import torch

import msa
from helpers import make_inputs, make_packed

HEADS = (8, 2, 4, 1)


def good(device="cpu", dtype=torch.bfloat16, N=130):
    return dict(zip(["q", "k", "v", "q_idx", "k_idx"], make_inputs(2, N, HEADS, 64, 64, dtype=dtype, device=device)))


def call(kw, **opts):
    return msa.msa_attention(kw["q"], kw["k"], kw["v"], kw["q_idx"], kw["k_idx"], **opts)


def expect(exc, name, fn):
    with pytest.raises(exc) as info:
        fn()
    assert info.value.args and str(info.value).startswith(name + ":"), str(info.value)
    return str(info.value)


def expect_no_launch(exc, name, fn):
    """expect(), and no kernel ran on the GPU before the error (SPEC 7): the profiler's CUDA activities of
    the call, copies and memsets aside (a host check may read cu_seqlens back)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        msg = expect(exc, name, fn)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    assert not kernels, f"{name}: kernels ran before the error: {kernels}"
    return msg


@pytest.mark.parametrize("name", ["q", "k", "v", "q_idx", "k_idx"])
def test_wrong_rank(name):
    kw = good()
    kw[name] = kw[name][0]
    msg = expect(ValueError, name, lambda: call(kw))
    assert "4-dim" in msg and "got shape" in msg


@pytest.mark.parametrize("name,shape", [("k", (2, 129, 2, 64)), ("v", (2, 130, 4, 64)), ("q_idx", (1, 130, 4, 64)),
                                        ("k_idx", (2, 130, 1, 128)), ("k", (2, 130, 2, 128))])
def test_wrong_shape(name, shape):
    kw = good()
    kw[name] = torch.randn(shape, dtype=torch.bfloat16)
    expect(ValueError, name, lambda: call(kw))


@pytest.mark.parametrize("name,heads", [("k", 3), ("q_idx", 3), ("k_idx", 3), ("q_idx", 8)])
def test_head_divisibility(name, heads):
    kw = good()
    if name == "q_idx" and heads == 8:   # Hi=8 with Hkv=... make Hkv=2 and Hi=8 legal; use Hkv=4, Hi=... instead
        kw = dict(zip(["q", "k", "v", "q_idx", "k_idx"], make_inputs(1, 10, (24, 8, 12, 1), 64, 64,
                                                                    dtype=torch.bfloat16)))
        expect(ValueError, "q_idx", lambda: call(kw))  # neither of Hi=12, Hkv=8 divides the other
        return
    shape = list(kw[name].shape)
    shape[2] = heads
    kw[name] = torch.randn(shape, dtype=torch.bfloat16)
    if name == "k":
        kw["v"] = torch.randn(shape, dtype=torch.bfloat16)
    expect(ValueError, name, lambda: call(kw))


@pytest.mark.parametrize("name", ["k", "v", "q_idx", "k_idx"])
def test_dtype_mix(name):
    kw = good()
    kw[name] = kw[name].half()
    expect(TypeError, name, lambda: call(kw))


def test_unsupported_dtype():
    kw = {n: x.to(torch.int32) for n, x in good().items()}
    expect(TypeError, "q", lambda: call(kw))


@pytest.mark.parametrize("name", ["k", "v", "q_idx", "k_idx"])
def test_device_mix(name):
    kw = good()
    kw[name] = kw[name].to("meta")
    expect(ValueError, name, lambda: call(kw))


@pytest.mark.parametrize("name,dim", [("q", 96), ("q_idx", 32), ("q_idx", 256)])
def test_unsupported_head_dim(name, dim):
    kw = good()
    if name == "q":
        for n in ("q", "k", "v"):
            kw[n] = torch.randn(*kw[n].shape[:3], dim, dtype=torch.bfloat16)
    else:
        for n in ("q_idx", "k_idx"):
            kw[n] = torch.randn(*kw[n].shape[:3], dim, dtype=torch.bfloat16)
    msg = expect(ValueError, name, lambda: call(kw))
    assert str(dim) in msg


@pytest.mark.parametrize("opt,value,exc", [("block_size", 32, ValueError), ("block_size", 256, ValueError),
                                           ("block_size", 64.0, TypeError), ("topk", 0, ValueError),
                                           ("topk", 33, ValueError), ("topk", True, TypeError)])
def test_unsupported_options(opt, value, exc):
    msg = expect(exc, opt, lambda: call(good(), **{opt: value}))
    assert msg.endswith(f"got {value!r}"), msg


@pytest.mark.parametrize("name", ["q", "k", "v", "q_idx", "k_idx"])
def test_noncontiguous_last_dim(name):
    kw = good()
    x = kw[name]
    kw[name] = torch.stack([x, x], dim=-1)[..., 0]  # same values, stride(-1) == 2
    msg = expect(ValueError, name, lambda: call(kw))
    assert "stride" in msg


def test_other_strides_are_fine():
    """Strides other than the last dimension's are accepted (the CPU twin of test_harness_gpu's
    test_strided_layouts): the same out and KL as the contiguous call."""
    kw = good()
    ref_out, ref_kl = call(kw, topk=2, block_size=64)
    kw["q"] = kw["q"].transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) view of BHND memory
    out, kl = call(kw, topk=2, block_size=64)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(kl, ref_kl, rtol=0, atol=0)


@pytest.mark.parametrize("cu,mx,name", [([0, 100, 80, 200], 120, "cu_seqlens"),   # decreasing
                                        ([0, 100, 199], 100, "cu_seqlens"),       # last != T
                                        ([1, 100, 200], 100, "cu_seqlens"),       # first != 0
                                        ([0, 100, 200], 99, "max_seqlen")])       # too small
def test_bad_cu_seqlens(cu, mx, name):
    q, k, v, qi, ki, _, _ = make_packed([100, 100], HEADS, 64, 64, dtype=torch.bfloat16)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    expect(ValueError, name, lambda: msa.msa_attention_varlen(q, k, v, qi, ki, cu_t, mx))


def test_cu_seqlens_type():
    q, k, v, qi, ki, cu, mx = make_packed([100, 100], HEADS, 64, 64, dtype=torch.bfloat16)
    expect(TypeError, "cu_seqlens", lambda: msa.msa_attention_varlen(q, k, v, qi, ki, cu.long(), mx))
    expect(TypeError, "cu_seqlens", lambda: msa.msa_attention_varlen(q, k, v, qi, ki, [0, 100, 200], mx))
    expect(ValueError, "cu_seqlens", lambda: msa.msa_attention_varlen(q, k, v, qi, ki, cu.view(1, 3), mx))


def test_max_seqlen_type_and_range():
    q, k, v, qi, ki, cu, mx = make_packed([100, 100], HEADS, 64, 64, dtype=torch.bfloat16)
    expect(TypeError, "max_seqlen", lambda: msa.msa_attention_varlen(q, k, v, qi, ki, cu, 100.0))
    expect(ValueError, "max_seqlen", lambda: msa.msa_attention_varlen(q, k, v, qi, ki, cu, 0))
    expect(ValueError, "max_seqlen", lambda: msa.msa_attention_varlen(q, k, v, qi, ki, cu, 2 ** 31))
    expect(ValueError, "max_seqlen_k", lambda: msa.msa_attention_varlen(q, k, v, qi, ki, cu, mx, cu_seqlens_k=cu,
                                                                        max_seqlen_k=2 ** 32 + 100))


def test_empty_input():
    kw = good(N=1)
    kw = {n: x[:, :0] for n, x in kw.items()}
    expect(ValueError, "q", lambda: call(kw))


def test_select_blocks_and_sparse_attention_errors():
    kw = good()
    expect(ValueError, "topk", lambda: msa.select_blocks(kw["q_idx"], kw["k_idx"], topk=40))
    expect(ValueError, "k_idx", lambda: msa.select_blocks(kw["q_idx"], kw["k_idx"][:, :5]))
    idx = msa.select_blocks(kw["q_idx"], kw["k_idx"], topk=2, block_size=64)
    expect(TypeError, "indices", lambda: msa.sparse_attention(kw["q"], kw["k"], kw["v"], idx.long()))
    expect(ValueError, "indices", lambda: msa.sparse_attention(kw["q"], kw["k"], kw["v"], idx[:, :, :5]))
    expect(ValueError, "indices", lambda: msa.sparse_attention(kw["q"], kw["k"], kw["v"], idx[:, :3]))  # Hq % Hi


@pytest.mark.parametrize("opt,value", [("warmup", "no"), ("warmup", 1), ("warmup", None), ("return_indices", "yes"),
                                       ("return_indices", torch.tensor(True))])
def test_flags_are_bools(opt, value):
    """warmup / return_indices take a bool: a string (truthy whatever it says) or an int is a mistake."""
    msg = expect(TypeError, opt, lambda: call(good(), topk=2, block_size=64, **{opt: value}))
    assert "expected a bool" in msg


def test_numpy_scalars_are_accepted():
    """NumPy integers / floats / bools (a config read by NumPy) act as the Python numbers they hold."""
    np = pytest.importorskip("numpy")
    kw = good()
    out, kl, idx = call(kw, topk=2, block_size=64, softmax_scale=0.125, return_indices=True)
    out2, kl2, idx2 = call(kw, topk=np.int64(2), block_size=np.int32(64), softmax_scale=np.float32(0.125),
                           return_indices=np.bool_(True))
    assert idx2.shape == idx.shape and torch.equal(idx2, idx)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(kl2, kl, rtol=0, atol=0)
    q, k, v, qi, ki, cu, mx = make_packed([100, 100], HEADS, 64, 64, dtype=torch.bfloat16)
    ref = msa.msa_attention_varlen(q, k, v, qi, ki, cu, mx, topk=2, block_size=64)[0]
    got = msa.msa_attention_varlen(q, k, v, qi, ki, cu, np.int64(mx), topk=np.int16(2), block_size=64)[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    msa.validate_cu_seqlens(cu, np.int64(mx), np.int64(q.shape[0]))
    expect(TypeError, "max_seqlen", lambda: msa.msa_attention_varlen(q, k, v, qi, ki, cu, np.float64(mx)))


def test_other_flags_and_totals():
    """deterministic and return_lse are bools too (a NumPy bool is one); validate_cu_seqlens names cu_seqlens for a
    tensor of another device and a negative total_tokens is a ValueError."""
    np = pytest.importorskip("numpy")
    kw = good()
    expect(TypeError, "deterministic", lambda: call(kw, topk=2, block_size=64, deterministic="yes"))
    out = call(kw, topk=2, block_size=64, deterministic=np.bool_(True))[0]
    torch.testing.assert_close(out, call(kw, topk=2, block_size=64, deterministic=True)[0], rtol=0, atol=0)
    idx = msa.select_blocks(kw["q_idx"], kw["k_idx"], topk=2, block_size=64)
    expect(TypeError, "return_lse", lambda: msa.sparse_attention(kw["q"], kw["k"], kw["v"], idx, block_size=64,
                                                                 return_lse="no"))
    cu = torch.tensor([0, 100, 200], dtype=torch.int32)
    expect(ValueError, "cu_seqlens", lambda: msa.validate_cu_seqlens(cu.to("meta"), 100, 200))
    expect(ValueError, "total_tokens", lambda: msa.validate_cu_seqlens(cu, 100, -1))
    expect(TypeError, "total_tokens", lambda: msa.validate_cu_seqlens(cu, 100, 200.0))


def test_max_seqlen_in_batched_layout():
    """The batched layout takes N from the tensors: max_seqlen without cu_seqlens is refused, not ignored."""
    kw = good()
    expect(TypeError, "max_seqlen", lambda: msa.select_blocks(kw["q_idx"], kw["k_idx"], topk=2, block_size=64,
                                                              max_seqlen=10))
    idx = msa.select_blocks(kw["q_idx"], kw["k_idx"], topk=2, block_size=64)
    expect(TypeError, "max_seqlen", lambda: msa.sparse_attention(kw["q"], kw["k"], kw["v"], idx, block_size=64,
                                                                 max_seqlen=130))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_tensors(dtype):
    """Tensors of another device than CPU / CUDA: the device is named, whatever the dtype."""
    kw = {n: x.to("meta") for n, x in good(dtype=dtype).items()}
    msg = expect(ValueError, "q", lambda: call(kw))
    assert "CPU or CUDA" in msg


@pytest.mark.gpu
def test_cuda_bad_inputs_raise_before_launch():
    kw = good("cuda")
    kw32 = {n: x.float() for n, x in kw.items()}
    expect_no_launch(TypeError, "q", lambda: call(kw32))  # fp32 is CPU-only
    mixed = dict(kw, k_idx=kw["k_idx"].cpu())
    expect_no_launch(ValueError, "k_idx", lambda: call(mixed))
    # The raw ops check their arguments in C++ too. Through PyTorch's stable ABI a C++ check can only
    # raise RuntimeError (csrc/api/stable.h), still naming the argument first; msa's Python API raises
    # the ValueError / TypeError of SPEC 7 before it reaches them.
    idx = torch.zeros(4, 260, 2, dtype=torch.int32, device="cuda")
    bad_cu = torch.tensor([0, 200, 100, 260], dtype=torch.int32, device="cuda")
    expect_no_launch(RuntimeError, "cu_seqlens", lambda: torch.ops.msa.reverse_index(idx, bad_cu, 200, 64))
    good_cu = torch.tensor([0, 130, 260], dtype=torch.int32, device="cuda")
    expect_no_launch(RuntimeError, "max_seqlen", lambda: torch.ops.msa.reverse_index(idx, good_cu, 100, 64))
    expect_no_launch(RuntimeError, "block_size", lambda: torch.ops.msa.reverse_index(idx, good_cu, 130, 32))
    # The public sparse_bwd op checks k and v itself: here v has fewer tokens than q and k.
    q = torch.randn(260, 8, 64, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn_like(q[:, :2]), torch.randn(200, 2, 64, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(8, 260, device="cuda")
    expect_no_launch(RuntimeError, "q, k, v",
                     lambda: torch.ops.msa.sparse_bwd(q, q, k, v, q, lse, idx, good_cu, 130, 64, 0.125))
    # The raw msa_fwd checks the index inputs before either branch (warmup's dense kernels included):
    # an unsupported Di, and an Hi that does not divide Hq.
    k = torch.randn(260, 2, 64, dtype=torch.bfloat16, device="cuda")
    for qi, ki, name in ((torch.randn(260, 4, 96, dtype=torch.bfloat16, device="cuda"),
                          torch.randn(260, 1, 96, dtype=torch.bfloat16, device="cuda"), "q_idx"),
                         (torch.randn(260, 3, 64, dtype=torch.bfloat16, device="cuda"),
                          torch.randn(260, 1, 64, dtype=torch.bfloat16, device="cuda"), "q_idx")):
        for warmup in (True, False):
            expect_no_launch(RuntimeError, name, lambda: torch.ops.msa.msa_fwd(q, k, k, qi, ki, good_cu, 130, 2, 64,
                                                                               0.125, 0.1, warmup, False, True))
    # A block_size the selection refuses, 0 included (s27: the sparse path once divided by it first: SIGFPE).
    qi, ki = torch.randn(260, 4, 64, dtype=torch.bfloat16, device="cuda"), torch.randn(260, 1, 64, dtype=torch.bfloat16,
                                                                                        device="cuda")
    for bs in (0, 32, 256):
        expect_no_launch(RuntimeError, "block_size", lambda: torch.ops.msa.msa_fwd(q, k, k, qi, ki, good_cu, 130, 2,
                                                                                   bs, 0.125, 0.1, False, False, True))
    torch.cuda.synchronize()  # nothing faulted


@pytest.mark.gpu
def test_cuda_cu_seqlens_rechecked_after_inplace_write():
    """The host check of cu_seqlens is cached per tensor version: an in-place write is seen."""
    q, k, v, qi, ki, cu, mx = make_packed([100, 100], HEADS, 64, 64, dtype=torch.bfloat16, device="cuda")
    msa.msa_attention_varlen(q, k, v, qi, ki, cu, mx, topk=2, block_size=64)
    cu[1] = 150  # a sequence of 150 > max_seqlen = 100
    expect(ValueError, "max_seqlen", lambda: msa.msa_attention_varlen(q, k, v, qi, ki, cu, mx, topk=2, block_size=64))
    cu.view(-1)[2:].fill_(199)  # through a view: the last offset is no longer T
    cu[1] = 100
    expect(ValueError, "cu_seqlens", lambda: msa.msa_attention_varlen(q, k, v, qi, ki, cu, mx, topk=2, block_size=64))
    cu[2] = 200
    msa.msa_attention_varlen(q, k, v, qi, ki, cu, mx, topk=2, block_size=64)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_step_does_not_sync_the_host():
    """After a first call, fwd+bwd with the same cu_seqlens queues its kernels without a host sync."""
    kw = {n: x.requires_grad_() for n, x in good("cuda", N=300).items()}
    q, k, v, qi, ki, cu, mx = make_packed([100, 200], HEADS, 64, 64, dtype=torch.bfloat16, device="cuda")
    packed = [x.requires_grad_() for x in (q, k, v, qi, ki)]

    def step():
        out, kl = call(kw, topk=2, block_size=64)
        (out.float().sum() + kl).backward()
        out, kl = msa.msa_attention_varlen(*packed, cu, mx, topk=2, block_size=64)
        (out.float().sum() + kl).backward()

    step()
    step()  # the first step that adds into existing .grad tensors: its kernels load now, not under the spin
    torch.cuda.synchronize()
    # The sync debug mode sees PyTorch's own synchronising calls only, not a raw cudaStreamSynchronize in the
    # extension: so the GPU is also kept busy (~1 s of spin) while the step is queued, and the host must get
    # past the step before the spin ends (a kernel loaded lazily for the first time would also wait for it:
    # every kernel of the timed step ran in the two steps before).
    torch.cuda._sleep(1 << 31)
    spin_done = torch.cuda.Event()
    spin_done.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not spin_done.query(), "the step waited for the GPU (a host synchronisation)"
    torch.cuda.synchronize()
