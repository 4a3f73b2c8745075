"""Input factories shared by the tests."""
import functools
import importlib.util
import os
import shutil

import numpy as np
import torch

# (Hq, Hkv, Hi, Hki) head classes of the foundation issue.
HEADS = [(4, 4, 4, 1), (8, 2, 4, 1), (8, 4, 2, 1), (16, 2, 4, 2)]


# Varlen tests: an empty and a one-token sequence among long ones; the other head dims, block size and fp16 (D, Di,
# block_size, dtype), beside each test file's default shape.
VARLEN_LENGTHS = [1000, 1, 129, 0, 2500]
VARLEN_SHAPES = [(64, 128, 64, torch.float16), (128, 128, 64, torch.bfloat16), (64, 64, 128, torch.float16)]


def make_inputs(B, N, heads, D, Di, dtype=torch.float64, device="cpu", seed=0, requires_grad=False):
    """Fresh random normal (q, k, v, q_idx, k_idx) in the batched layout."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    Hq, Hkv, Hi, Hki = heads
    shapes = [(B, N, Hq, D), (B, N, Hkv, D), (B, N, Hkv, D), (B, N, Hi, Di), (B, N, Hki, Di)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
            .requires_grad_(requires_grad) for s in shapes]


def make_packed(lengths, heads, D, Di, dtype=torch.float64, device="cpu", seed=0, requires_grad=False):
    """(q, k, v, q_idx, k_idx, cu_seqlens, max_seqlen) for sequences of the given lengths, packed."""
    T = sum(lengths)
    tensors = [x[0] for x in make_inputs(1, T, heads, D, Di, dtype, device, seed)]
    tensors = [x.detach().requires_grad_(requires_grad) for x in tensors]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)
    return (*tensors, cu, max(lengths))


def suffix_packed(lq, lk, heads, D, Di, dtype=torch.float64, device="cpu", seed=0):
    """q-side (q, q_idx) and k-side (k, v, k_idx) packed tensors with their offsets: sequence s has lk[s]
    keys and its last lq[s] positions as queries; the q-side rows are those positions' rows of a square
    draw, so the square call on the keys' layout is the oracle for the suffix rows."""
    q, k, v, qi, ki, cu_k, mx_k = make_packed(lk, heads, D, Di, dtype=dtype, device=device, seed=seed)
    rows = torch.cat([torch.arange(b - n, b) for n, b in zip(lq, cu_k[1:].tolist())]).to(device)
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return dict(q=q[rows].clone(), qi=qi[rows].clone(), k=k, v=v, ki=ki, cu_q=cu_q, mx_q=max(max(lq), 1),
                cu_k=cu_k, mx_k=mx_k, rows=rows, q_full=q, qi_full=qi)


def packed(x):
    """(B, N, H, D) -> (B*N, H, D) float64 numpy."""
    return x.detach().double().reshape(-1, *x.shape[2:]).cpu().numpy()


def batch_cu(B, N):
    return [N * b for b in range(B + 1)]


def poison_allocator(nbytes=1 << 28, small_bytes=64 << 20):
    """Fill memory the caching allocator will hand out next with 0x7f bytes, so an unwritten output
    element shows up as garbage instead of a lucky zero or a stale, correct value of an earlier call.
    The cached free blocks are dropped first (an earlier call's outputs of the same size would be reused
    before the poisoned block: best fit), and both of the allocator's pools are filled: requests up to
    1 MiB (lse, lse_idx, kl_rows, small-N outputs) come from the small pool, which a large block never feeds.
    Free fragments inside segments that still hold live tensors keep their old bytes."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = [torch.empty(nbytes, dtype=torch.uint8, device="cuda")]
    held += [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(small_bytes >> 20)]
    for t in held:
        t.fill_(0x7F)
    torch.cuda.synchronize()


def assert_written(name, x):
    """Every element of an output written: finite, and none of poison_allocator's bytes left (0x7F7F is a finite
    bf16 and 0x7F7F7F7F a finite fp32: 3.39e38; in an integer output the pattern itself: 2139062143 as int32, no
    valid block index)."""
    if not x.is_floating_point():
        poison = int.from_bytes(b"\x7f" * x.element_size(), "little", signed=True)
        assert (x != poison).all(), f"{name}: poison left (unwritten output?)"
        return
    x = x.float()
    assert torch.isfinite(x).all() and (x.abs() < 1e38).all(), f"{name}: poison left (unwritten output?)"


def assert_same_forward(a, b, what, written=False):
    """Two msa_fwd results that must not depend on `what`: the per-entry results bitwise (kl_rows too: the per-row
    sums kl is the mean of), the index gradients (fp32 atomics) up to rounding. written: a's per-entry results are
    also checked for poison (assert_written) first."""
    for name, i in (("out", 0), ("kl", 1), ("indices", 2), ("lse", 3), ("lse_idx", 4), ("kl_rows", 7)):
        if written:
            assert_written(name, a[i])
        assert torch.equal(a[i], b[i]), f"{name} depends on {what}"
    for name, x, y in zip(("kl_dq_idx", "kl_dk_idx"), a[5:7], b[5:7]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-9, msg=f"{name} depends on {what}")


def assert_rounded_once(name, got, exact, dtype):
    """A half-precision result computed in fp32 and rounded once (the CPU path): within one unit of `dtype`'s
    rounding of the fp64 value (eps |exact| plus 1e-3 eps max |exact| for values near zero)."""
    got, exact = np.asarray(got, dtype=np.float64), np.asarray(exact, dtype=np.float64)
    eps = torch.finfo(dtype).eps
    err = np.abs(got - exact)
    bound = eps * np.abs(exact) + 1e-3 * eps * (np.abs(exact).max() if exact.size else 0.0)
    assert (err <= bound).all(), f"{name}: {int((err > bound).sum())} values beyond one unit, max error {err.max():.3g}"


def sm90_kernels_run():
    """Whether calls on the current GPU run this build's sm_90a kernels now (the op's own answer, device_config:
    a 90a build on a 9.x GPU without MSA_PORTABLE_KERNELS=1, read at each call)."""
    return int(torch.ops.msa.device_config(torch.empty(0, device="cuda"))[1]) == 1


def fp8_rel_tol(di):
    """The near-tie tolerance of the FP8 selection: the Hopper FP8 top-k accumulates in f16 (11 significant bits;
    before s66 in fp32 accumulators, whose tensor-core adds keep about 14: 33 of 96000 rows beyond 1e-5 on the first
    H100 run, none beyond 2e-3), so scores within ~1e-3 of each other may swap; the widened bf16 path accumulates in
    fp32 (SPEC 2's 1e-5)."""
    return 2e-3 if di == 128 and sm90_kernels_run() else 1e-5


def cuda_kernel_names(fn):
    """The names of the CUDA activities (kernels, memsets) that fn() ran, from the profiler, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()]


def load_file(path, name):
    """The module in the file at `path` (a script or setup.py: not on sys.path), executed under `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=None)
def kernel_coverage():
    """scripts/kernel_coverage.py as a module, loaded once (read-only: its parsers and VARIANTS)."""
    return load_file(os.path.join(os.path.dirname(__file__), "..", "scripts", "kernel_coverage.py"), "kernel_coverage")


def launched_kernel(name):
    """(kernel, [template arguments]) of a launched kernel's demangled name (scripts/kernel_coverage.py's
    parse_launched), e.g. ("index_topk_sm90_kernel", ["__nv_bfloat16", "64", "4", "false", "false", "true"])."""
    return kernel_coverage().parse_launched(name)


def find_nvcc():
    """The CUDA compiler as setup.py looks for it (CUDACXX, CUDA_HOME / CUDA_PATH, the default toolkit, PATH); None
    when there is none."""
    cands = [os.environ.get("CUDACXX")]
    cands += [os.path.join(os.environ[v], "bin", "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    cands += ["/usr/local/cuda/bin/nvcc", shutil.which("nvcc")]
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)
