"""msa.distributed on the CPU with gloo: 2, 3 and 4 processes (torch.multiprocessing) against the
single-process call on the full sequence: out, kl and all five gradients, both modes and layouts,
fp64 and bf16. One spawn runs several configurations (a spawn costs a few seconds of imports)."""
import copy
import gc
import os
import tempfile
import traceback
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import msa
import msa.nn
from helpers import make_inputs

B, N, TOPK, BS = 2, 512, 3, 64
# (heads (Hq, Hkv, Hi, Hki), mode, layout, dtype, warmup[, device, n, d, index_dtype])
CONFIGS = {
    2: [((8, 2, 4, 1), "head", "zigzag", torch.float64, False),
        ((8, 2, 4, 1), "query", "zigzag", torch.float64, False),
        ((8, 2, 4, 1), "query", "contiguous", torch.bfloat16, False),
        ((8, 4, 2, 1), "auto", "contiguous", torch.float64, True),
        ((4, 1, 1, 1), "auto", "zigzag", torch.float64, False),     # Hi = 1 < P: query-split
        ((8, 2, 4, 1), "auto", "zigzag", torch.float32, False),
        ((8, 2, 4, 1), "query", "zigzag", torch.bfloat16, False, "cpu", N, 64, torch.float8_e4m3fn),  # FP8 selection
        ((8, 2, 4, 1), "head", "contiguous", torch.bfloat16, False, "cpu", N, 64, torch.float8_e4m3fn)],
    4: [((8, 2, 4, 1), "head", "zigzag", torch.float64, False),     # kv heads replicated over 2 ranks each
        ((8, 4, 2, 1), "auto", "zigzag", torch.float64, False),     # 2 head shards x 2 query shards
        ((8, 2, 4, 1), "query", "zigzag", torch.bfloat16, False),
        ((16, 2, 4, 2), "auto", "contiguous", torch.float64, True),
        ((8, 4, 2, 1), "auto", "contiguous", torch.float64, False)],   # 2 x 2 in the contiguous layout
    3: [((8, 2, 4, 1), "auto", "zigzag", torch.float64, False, "cpu", 576)],   # 3 does not divide Hi = 4: query-split
}


def _close(got, want, dtype, what):
    """atol is relative to want's largest element: the index gradients are ~1e-4 (the kl is a mean over
    B * N * Hi rows), so an absolute 2e-2 (bf16) would pass them all zero."""
    rtol, atol = {torch.float64: (1e-9, 1e-10), torch.float32: (1e-4, 1e-5)}.get(dtype, (2e-2, 2e-2))
    scale = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    try:
        torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol * scale)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def _check(rank, P, heads, mode, layout, dtype, warmup, device="cpu", n=N, d=64, index_dtype=None):
    """index_dtype (the FP8 selection): each rank scales the key prefix it holds by its own power of two, which can
    round a value below e4m3's normal range differently; the largest |k_idx| of each (sequence, head) is put at
    position 0, which every rank's prefix holds, so the copies, and the selection, are exactly the single-process
    call's."""
    full = make_inputs(B, n, heads, d, d, dtype=dtype, device=device, seed=17, requires_grad=True)
    if index_dtype is not None:
        with torch.no_grad():
            full[4][:, 0, :, 0] = 2 * full[4].abs().amax(dim=(1, 3))
    g = torch.randn(B, n, heads[0], d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    g = g.to(dtype=dtype, device=device)
    kw = dict(topk=TOPK, block_size=BS, warmup=warmup, index_dtype=index_dtype)
    out, kl = msa.msa_attention(*full, **kw)
    ((out * g).sum() + kl).backward()
    want = [x.grad.clone() for x in full]
    for x in full:
        x.grad = None
    shards = [msa.distributed.shard_sequence(x, layout=layout) for x in full]
    out_r, kl_r = msa.distributed.msa_attention_cp(*shards, layout=layout, mode=mode, **kw)
    g_r = msa.distributed.shard_sequence(g, layout=layout)
    ((out_r * g_r).sum() + kl_r / P).backward()
    name = f"P={P} heads={heads} mode={mode} layout={layout} {dtype} warmup={warmup} index_dtype={index_dtype}"
    _close(msa.distributed.gather_sequence(out_r.detach(), layout=layout), out.detach(), dtype, f"{name}: out")
    assert abs(kl_r.item() - kl.item()) <= (1e-12 if dtype == torch.float64 else 1e-4) * max(1.0, abs(kl.item())), \
        f"{name}: kl {kl_r.item()} vs {kl.item()}"
    for x, w, label in zip(full, want, ("dq", "dk", "dv", "dq_idx", "dk_idx")):
        grad = x.grad.double()  # this rank's shard only: the slice's gradient
        dist.all_reduce(grad)
        _close(grad, w, dtype, f"{name}: {label}")


def _expect(exc, match, fn):
    try:
        fn()
    except exc as e:
        assert match in str(e), str(e)
    else:
        raise AssertionError(f"expected {exc.__name__} ({match})")


def _check_errors(rank, P):
    """Bad calls raise the same clear error on every rank, before any exchange (no rank left waiting)."""
    x = make_inputs(1, 24 * P, (8, 2, 4, 1), 64, 64, dtype=torch.float64)
    shards = [msa.distributed.shard_sequence(t) for t in x]
    other = "contiguous" if rank == 0 else "zigzag"
    _expect(ValueError, "layout: expected the same on every rank", lambda: msa.distributed.msa_attention_cp(
        *shards, layout=other, topk=2, block_size=64))
    _expect(ValueError, "layout: expected one of", lambda: msa.distributed.msa_attention_cp(*shards, layout="ring"))
    if 4 % P:
        _expect(ValueError, "mode: 'head' needs", lambda: msa.distributed.msa_attention_cp(*shards, mode="head"))
    _expect(ValueError, "needs an even number of rows", lambda: msa.distributed.msa_attention_cp(
        *[t[:, :-1] for t in shards]))


def _check_layer(rank, P):
    """msa.nn.MSAAttention with cp_group: this rank's shard of x in, its shard of y out; y, kl and the weight
    gradients (summed over ranks) those of the layer on the whole sequence (rotary at the global positions)."""
    torch.manual_seed(5)
    layer = msa.nn.MSAAttention(96, 8, 2, 64, 4, 64, topk=3, block_size=64, dtype=torch.float64)
    x = torch.randn(2, 64 * P, 96, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    y, kl = layer(x)
    (y.square().sum() + kl).backward()
    want = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    layer.set_context_parallel(dist.group.WORLD, "zigzag")
    x_r = msa.distributed.shard_sequence(x)
    y_r, kl_r = layer(x_r)
    (y_r.square().sum() + kl_r / P).backward()
    _close(msa.distributed.gather_sequence(y_r.detach()), y.detach(), torch.float64, "layer: y")
    assert abs(kl_r.item() - kl.item()) < 1e-12, (kl_r.item(), kl.item())
    for n, p in layer.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        _close(g, want[n], torch.float64, f"layer: d{n}")
    assert copy.deepcopy(layer).cp_group is None


def _worker(rank, P, path, errors, configs=None, backend=None):
    """configs None: the gloo configurations of CONFIGS[P] on the CPU; else the given CUDA configurations,
    with NCCL on GPU `rank` (backend None) or with gloo, whose collectives take CUDA tensors too, on GPU
    `rank % device_count` (so several ranks can share one GPU)."""
    torch.set_num_threads(1)
    if configs is not None:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = backend or ("gloo" if configs is None else "nccl")
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=P)
    world = weakref.ref(dist.group.WORLD)
    try:
        for cfg in CONFIGS[P] if configs is None else configs:
            _check(rank, P, *cfg)
        if configs is not None:
            return
        _check_errors(rank, P)
        _check_layer(rank, P)
        # gather_sequence undoes shard_sequence, and its backward sums every rank's gradient
        x = torch.randn(3, 8 * P, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_()
        for layout in ("zigzag", "contiguous"):
            y = msa.distributed.gather_sequence(msa.distributed.shard_sequence(x, layout=layout), layout=layout)
            assert torch.equal(y, x)
            (y * (rank + 1)).sum().backward()
        want = 2 * sum(range(1, P + 1))
        gx = x.grad.clone()
        dist.all_reduce(gx)
        assert torch.equal(gx, torch.full_like(gx, float(want))), gx.unique()
    except Exception:
        with open(f"{errors}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # destroy_process_group frees the group (and joins its gloo threads) only if nothing else holds it: a group
    # alive here lives into the interpreter's exit, where its threads can abort the process (msa/distributed.py)
    gc.collect()
    if world() is not None:
        with open(f"{errors}.{rank}", "w") as f:
            f.write(f"rank {rank}: the process group is still referenced after destroy_process_group "
                    f"({len(gc.get_referrers(world()))} Python referrers)")
        raise AssertionError("process group outlives destroy_process_group")


def spawn(P, configs=None, backend=None):
    """Runs _worker on P processes; a worker's traceback fails the calling test."""
    with tempfile.TemporaryDirectory() as d:
        errors = os.path.join(d, "err")
        try:
            mp.spawn(_worker, args=(P, os.path.join(d, "store"), errors, configs, backend), nprocs=P, join=True)
        except Exception:
            logs = [open(os.path.join(d, f)).read() for f in sorted(os.listdir(d)) if f.startswith("err")]
            pytest.fail("\n".join(logs) or "a worker failed")


@pytest.mark.parametrize("P", [2, 3, 4])
def test_cp_matches_single_process(P):
    spawn(P)


def test_cp_errors_without_a_process_group():
    x = torch.zeros(1, 4, 1, 64)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        msa.distributed.shard_sequence(x)


def torchrun(*args, env=None):
    """`torchrun --standalone --nproc_per_node=2 ARGS` (--master_port=0 hangs with this torch); asserts it exits 0."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_bench_cp_runs_under_torchrun(tmp_path):
    """The CP benchmark (python -m msa.bench_cp under torchrun) runs end to end on the CPU with gloo."""
    torchrun("-m", "msa.bench_cp", "--seqlen", "256", "--reps", "1", "--save", str(tmp_path),
             env={**os.environ, "OMP_NUM_THREADS": "1"})
    saved = list(tmp_path.iterdir())
    assert len(saved) == 1 and "| 256 |" in saved[0].read_text()


def test_context_parallel_example_runs_under_torchrun():
    """examples/context_parallel.py (the README's torchrun example) runs and matches the single-process call."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = torchrun(os.path.join(here, "examples", "context_parallel.py"), env={**os.environ, "OMP_NUM_THREADS": "1"})
    out_diff = float(r.stdout.split("max |out - single| = ")[1].split(",")[0])
    assert out_diff < 1e-6, r.stdout
    diffs = [float(line.split("max |diff| = ")[1].split()[0]) for line in r.stdout.splitlines() if "max |diff|" in line]
    assert len(diffs) == 5 and max(diffs) < 1e-8, r.stdout
