"""python -m msa.bench: time msa against dense attention on this device.

CUDA: the SPEC 8 bench configuration (B=1, Hq=16, Hkv=2, Hi=4, Hki=1, D=Di=128, Bk=128, k=16, bf16) at
N in {8K..128K}, dense cuDNN SDPA measured in the same run. CPU: the reference path at small N against
PyTorch's CPU SDPA. Every msa op without a compiled kernel for the device is reported as such, not timed.
`--save` writes the table with date, commit, GPU and command under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import msa
from msa import reference
from msa._provenance import git_commit, gpu_tag  # msa.bench's names too (bench_cp, tests)

CONFIG = dict(Hq=16, Hkv=2, Hi=4, Hki=1, D=128, Di=128, block_size=128, topk=16)


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def _event_ms(run):
    """ms between CUDA events recorded on the current stream before and after run(), synchronised."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


class Timer:
    """Median wall time of `fn(inputs)` over rotating input sets (CUDA events on the GPU)."""

    def __init__(self, device, reps, warmup=2):
        self.device, self.reps, self.warmup = device, reps, warmup

    def __call__(self, fn, input_sets):
        for i in range(self.warmup):
            fn(*input_sets[i % len(input_sets)])
        times = []
        for i in range(self.reps):
            args = input_sets[i % len(input_sets)]
            if self.device.type == "cuda":
                times.append(_event_ms(lambda: fn(*args)))
            else:
                t0 = time.perf_counter()
                fn(*args)
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def graphed(self, fn, input_sets):
        """Median ms of `fn` captured once in a CUDA graph (torch.cuda.graph) and replayed: each replay on the next
        input set, copied into the captured tensors before its timed span. The GPU time of the step without the
        host's launch costs (what torch.compile's mode="reduce-overhead" or a captured training step gets).
        None, with the reason in CAPTURE_FAILURES, when the capture fails."""
        static = [x.detach().clone().requires_grad_(x.requires_grad) for x in input_sets[0]]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # allocator and lazy initialisation outside the capture
                fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn(*static)
        except RuntimeError as e:
            CAPTURE_FAILURES.append(f"{getattr(fn, '__name__', fn)}: {str(e).splitlines()[0]}")
            torch.cuda.synchronize()
            return None
        times = []
        for i in range(self.warmup + self.reps):
            with torch.no_grad():
                for s, x in zip(static, input_sets[i % len(input_sets)]):
                    s.copy_(x)
            ms = _event_ms(graph.replay)
            if i >= self.warmup:
                times.append(ms)
        del graph, static
        torch.cuda.empty_cache()
        return statistics.median(times)


# Captures that failed in this run (Timer.graphed), stated in the stored run's header.
CAPTURE_FAILURES: list[str] = []


def make_inputs(N, device, dtype, seed, requires_grad=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    c = CONFIG
    shapes = [(1, N, c["Hq"], c["D"]), (1, N, c["Hkv"], c["D"]), (1, N, c["Hkv"], c["D"]),
              (1, N, c["Hi"], c["Di"]), (1, N, c["Hki"], c["Di"])]
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_(requires_grad)
            for s in shapes]


def dense_fwd(q, k, v, *_):
    # SDPA wants (B, H, N, D); GQA through enable_gqa keeps K/V unexpanded.
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=True)


def dense_fwd_bwd(q, k, v, *_):
    out = dense_fwd(q, k, v)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


def msa_fwd(q, k, v, qi, ki):
    with torch.no_grad():
        msa.msa_attention(q, k, v, qi, ki, topk=CONFIG["topk"], block_size=CONFIG["block_size"])


def msa_fwd_bwd(q, k, v, qi, ki, deterministic=False, warmup=False, index_dtype=None):
    out, kl = msa.msa_attention(q, k, v, qi, ki, topk=CONFIG["topk"], block_size=CONFIG["block_size"],
                                deterministic=deterministic, warmup=warmup, index_dtype=index_dtype)
    torch.autograd.grad((out, kl), (q, k, v, qi, ki), (torch.ones_like(out), torch.ones_like(kl)))


def msa_fwd_bwd_warmup(q, k, v, qi, ki):
    """fwd+bwd in warmup mode (SPEC 5): dense main branch, KL over the full causal set."""
    msa_fwd_bwd(q, k, v, qi, ki, warmup=True)


def msa_fwd_bwd_fp8(q, k, v, qi, ki):
    """fwd+bwd with the FP8 selection (index_dtype=torch.float8_e4m3fn: the copies, then the FP8 top-k)."""
    msa_fwd_bwd(q, k, v, qi, ki, index_dtype=torch.float8_e4m3fn)


def selection_recall(got, want, rows=4096):
    """The fraction of want's kept blocks that got keeps too ((..., T, topk) selections, -1 padded), in row chunks."""
    hit = kept = 0
    for i in range(0, want.shape[-2], rows):
        w, g = want[..., i:i + rows, :], got[..., i:i + rows, :]
        hit += ((g[..., :, None] == w[..., None, :]) & (w[..., None, :] >= 0)).any(-2).sum().item()
        kept += (w >= 0).sum().item()
    return hit / max(kept, 1)


def msa_fwd_bwd_det(q, k, v, qi, ki):
    msa_fwd_bwd(q, k, v, qi, ki, deterministic=True)


def suffix_inputs(x):
    """The last half of the queries of inputs x (make_inputs) over all their keys, as new leaves: the query
    shard of the last rank in a two-way contiguous query split (msa.distributed), the heaviest one."""
    half = x[0].shape[1] // 2
    q, k, v, qi, ki = (t.detach() for t in x)
    return [q[:, half:].contiguous().requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True),
            qi[:, half:].contiguous().requires_grad_(True), ki.requires_grad_(True)]


def msa_fwd_bwd_bhnd(q, k, v, qi, ki):
    """fwd+bwd from (B, H, N, D) tensors seen as (B, N, H, D), as Hugging Face models hand them over:
    the cost of the one internal copy of each input (and of the gradients' layout)."""
    msa_fwd_bwd(*(x.transpose(1, 2) for x in (q, k, v, qi, ki)))


def fwd_bwd_memory(x, deterministic=False):
    """GiB of one msa fwd+bwd on CUDA inputs x (make_inputs): the peak above the inputs (workspace plus
    out, kl and the five gradients), and the workspace (the same minus out and the gradients)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    msa_fwd_bwd(*x, deterministic=deterministic)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    returned = sum(t.numel() * t.element_size() for t in x)
    returned += x[0].numel() * x[0].element_size()  # out is the size of q
    return peak, peak - returned / 2**30


def sparse_fwd(q, k, v, idx, cu, N):
    """The main branch of the forward given the selection: reverse index, both passes, combines."""
    torch.ops.msa.sparse_fwd(q, k, v, idx, cu, N, CONFIG["block_size"], CONFIG["D"] ** -0.5)


def select_fn(qi, ki, index_dtype=None):
    msa.select_blocks(qi, ki, topk=CONFIG["topk"], block_size=CONFIG["block_size"], index_dtype=index_dtype)


def select_fn_fp8(qi, ki):
    select_fn(qi, ki, torch.float8_e4m3fn)


def synthetic_indices(N, device, seed):
    """A valid selection (local block + random distinct earlier blocks), packed (Hi, N, k), for timing
    the kernels that consume a selection when the selector itself is not available on the device."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    c = CONFIG
    bs, k = c["block_size"], c["topk"]
    local = torch.arange(N) // bs
    keys = torch.rand(c["Hi"], N, N // bs + 1, generator=g) if N <= 16384 else None
    if keys is None:  # large N: draw with repeats, the kernels count a repeat once
        earlier = (torch.rand(c["Hi"], N, k - 1, generator=g) * local[None, :, None]).long()
    else:
        keys = keys.masked_fill(torch.arange(N // bs + 1)[None, None, :] >= local[None, :, None], 2.0)
        earlier = keys.topk(min(k - 1, keys.shape[-1]), largest=False).indices  # N < (k-1)*bs: fewer blocks
        earlier = torch.nn.functional.pad(earlier, (0, k - 1 - earlier.shape[-1]), value=-1)
        earlier = torch.where(torch.arange(k - 1)[None, None, :] < local[None, :, None], earlier, -1)
    idx = torch.cat([local[None, :, None].expand(c["Hi"], N, 1), earlier], dim=-1)
    idx = torch.where(idx < 0, N, idx).sort(-1).values  # ascending, -1 padding last
    return torch.where(idx == N, -1, idx).to(torch.int32).to(device)


def attended_tokens(indices, block_size):
    """sum over (token, index group) of |T(i, r)| (SPEC 8), from packed (Hi, N, k) indices."""
    N = indices.shape[1]
    i = torch.arange(N, device=indices.device)[None, :, None]
    b = indices.long()
    n = torch.clamp(i - b * block_size + 1, min=0, max=block_size)
    return int((n * ((b >= 0) & reference.first_occurrence(b))).sum())


def msa_step_flops(N, att_groups, c=CONFIG):
    """The useful FLOPs of one msa fwd+bwd (bench configuration), what its floor is computed from: the attended
    main FLOPs fwd + bwd (SPEC 8: 3.5 x 4 D per (token, query head, attended key): Q K^T and P V forward, five
    GEMMs backward), the index scoring (SPEC 8: 2 Di Hi N (N + 1) / 2) and the KL's index-branch GEMMs (the
    index logits once, dq_idx, dk_idx: 3 x 2 Di per (token, index group, attended key)). Work the kernels
    repeat (the stats pass's second Q K^T and index logits) is not counted. att_groups: sum over (i, r) of
    |T(i, r)| (attended_tokens)."""
    heads_per_group = c["Hq"] // c["Hi"]
    attended = 3.5 * 4 * c["D"] * att_groups * heads_per_group
    index = 2 * c["Di"] * c["Hi"] * N * (N + 1) / 2
    kl = 3 * 2 * c["Di"] * att_groups
    return attended + index + kl


def matmul_peak_tflops(device, sizes=(8192, 16384)):
    """bf16 torch.matmul TFLOP/s on this GPU now: the best median over square sizes (the ceiling the floors use)."""
    timer = Timer(device, reps=10, warmup=3)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        ms = timer(torch.matmul, [(a, b)])
        best = max(best, 2 * n ** 3 / ms / 1e9)
        del a, b
    return best


def run(args, peak_tflops=None):
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16
    ns = args.n or ([8192, 16384, 32768, 65536, 131072] if on_gpu else [512, 1024, 2048])
    timer = Timer(device, reps=args.reps or (20 if on_gpu else 2))
    c = CONFIG
    rows = []
    steps = len(ns)
    for step, N in enumerate(ns, 1):
        progress(f"[{step}/{steps}] N={N}: inputs")
        # Rotate input sets that together exceed the L2 cache (60 MB on an H200) at small N.
        n_sets = max(1, min(3, (256 << 20) // max(1, N * (c["Hq"] + 2 * c["Hkv"]) * c["D"] * 2))) if on_gpu else 1
        sets = [make_inputs(N, device, dtype, seed=s) for s in range(n_sets)]
        dense_flops = 2 * N * N * c["D"] * c["Hq"]
        row = dict(N=N)
        progress(f"[{step}/{steps}] N={N}: dense fwd")
        row["dense_fwd"] = timer(dense_fwd, sets)
        progress(f"[{step}/{steps}] N={N}: dense fwd+bwd")
        row["dense_fwdbwd"] = timer(dense_fwd_bwd, sets)
        row["dense_tflops"] = 3.5 * dense_flops / row["dense_fwdbwd"] / 1e9
        if device.type == "cpu" or msa.has_cuda_kernel("msa_fwd"):
            progress(f"[{step}/{steps}] N={N}: msa fwd")
            row["msa_fwd"] = timer(msa_fwd, sets)
            with torch.no_grad():
                idx = msa.select_blocks(sets[0][3], sets[0][4], topk=c["topk"], block_size=c["block_size"])
            att_groups = attended_tokens(idx[0], c["block_size"])  # sum over (i, r)
            att = att_groups * (c["Hq"] // c["Hi"])  # sum over (i, h)
            row["fwd_ratio"] = row["dense_fwd"] / row["msa_fwd"]
            if device.type == "cpu" or msa.has_cuda_kernel("msa_bwd"):
                progress(f"[{step}/{steps}] N={N}: msa fwd+bwd")
                row["msa_fwdbwd"] = timer(msa_fwd_bwd, sets)
                row["attended_tflops"] = 3.5 * 4 * c["D"] * att / row["msa_fwdbwd"] / 1e9
                if peak_tflops:
                    # The floor: the step's FLOPs at the matmul peak measured in this run; and how close.
                    row["floor"] = msa_step_flops(N, att_groups) / peak_tflops / 1e9
                    row["floor_frac"] = row["floor"] / row["msa_fwdbwd"]
                row["ratio"] = row["dense_fwdbwd"] / row["msa_fwdbwd"]
                if on_gpu:
                    progress(f"[{step}/{steps}] N={N}: msa and dense fwd+bwd, CUDA graph replays")
                    row["msa_fwdbwd_graph"] = timer.graphed(msa_fwd_bwd, sets)
                    row["dense_fwdbwd_graph"] = timer.graphed(dense_fwd_bwd, sets)
                    # (Not on the CPU: its path is deterministic as it is, and two timings would differ by noise.)
                    progress(f"[{step}/{steps}] N={N}: msa fwd+bwd, deterministic=True")
                    row["msa_fwdbwd_det"] = timer(msa_fwd_bwd_det, sets)
                    row["det_cost"] = row["msa_fwdbwd_det"] / row["msa_fwdbwd"] - 1
                progress(f"[{step}/{steps}] N={N}: msa fwd+bwd, warmup=True")
                row["msa_fwdbwd_warmup"] = timer(msa_fwd_bwd_warmup, sets)
                row["warmup_over_dense"] = row["msa_fwdbwd_warmup"] / row["dense_fwdbwd"]
                progress(f"[{step}/{steps}] N={N}: msa fwd+bwd, index_dtype=float8_e4m3fn")
                row["msa_fwdbwd_fp8"] = timer(msa_fwd_bwd_fp8, sets)
                row["ratio_fp8"] = row["dense_fwdbwd"] / row["msa_fwdbwd_fp8"]
                with torch.no_grad():
                    idx8 = msa.select_blocks(sets[0][3], sets[0][4], topk=c["topk"], block_size=c["block_size"],
                                             index_dtype=torch.float8_e4m3fn)
                row["fp8_recall"] = selection_recall(idx8, idx)
                del idx8
                progress(f"[{step}/{steps}] N={N}: msa fwd+bwd, queries the last N/2 of the keys")
                row["msa_fwdbwd_suffix"] = timer(msa_fwd_bwd, [suffix_inputs(x) for x in sets])
                if on_gpu:
                    progress(f"[{step}/{steps}] N={N}: msa fwd+bwd from (B, H, N, D) views")
                    bhnd = [[x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in st] for st in sets]
                    row["msa_fwdbwd_bhnd"] = timer(msa_fwd_bwd_bhnd, bhnd)
                    del bhnd
            if on_gpu:
                progress(f"[{step}/{steps}] N={N}: sparse fwd (given the selection)")
                cu = torch.tensor([0, N], dtype=torch.int32, device=device)
                flat = [[x.detach()[0] for x in s[:3]] for s in sets]
                row["sparse_fwd"] = timer(lambda q, k, v: sparse_fwd(q, k, v, idx[0], cu, N), flat)
                row["sparse_fwd_tflops"] = 1.5 * 4 * c["D"] * att / row["sparse_fwd"] / 1e9
                if msa.has_cuda_kernel("sparse_bwd"):
                    progress(f"[{step}/{steps}] N={N}: sparse bwd (given out, lse)")
                    saved = []
                    for q, k, v in flat:
                        out, lse = torch.ops.msa.sparse_fwd(q, k, v, idx[0], cu, N, c["block_size"], c["D"] ** -0.5)
                        saved.append((torch.randn_like(out), q, k, v, out, lse))
                    row["sparse_bwd"] = timer(lambda do, q, k, v, o, l: torch.ops.msa.sparse_bwd(
                        do, q, k, v, o, l, idx[0], cu, N, c["block_size"], c["D"] ** -0.5), saved)
                    row["sparse_bwd_tflops"] = 2.5 * 4 * c["D"] * att / row["sparse_bwd"] / 1e9
                    del saved
                    # The same with an attention sink: every row's first slot becomes block 0, so one key per
                    # index group is selected by every token (the backward splits it over many CTAs).
                    progress(f"[{step}/{steps}] N={N}: sparse bwd with a sink")
                    sink = idx[0].clone()
                    sink[..., 0] = 0  # rows are ascending with the local block in: slot 0 is their smallest block
                    saved = []
                    for q, k, v in flat:
                        out, lse = torch.ops.msa.sparse_fwd(q, k, v, sink, cu, N, c["block_size"], c["D"] ** -0.5)
                        saved.append((torch.randn_like(out), q, k, v, out, lse))
                    row["sparse_bwd_sink"] = timer(lambda do, q, k, v, o, l: torch.ops.msa.sparse_bwd(
                        do, q, k, v, o, l, sink, cu, N, c["block_size"], c["D"] ** -0.5), saved)
                    del saved, sink
            if on_gpu and "msa_fwdbwd" in row:
                row["peak_extra_gib"], row["workspace_gib"] = fwd_bwd_memory(sets[0])
                row["workspace_det_gib"] = fwd_bwd_memory(sets[0], deterministic=True)[1]
        if on_gpu and msa.has_cuda_kernel("select_blocks"):
            progress(f"[{step}/{steps}] N={N}: index top-k")
            row["index_topk"] = timer(select_fn, [(x[3].detach(), x[4].detach()) for x in sets])
            row["index_tflops"] = 2 * c["Di"] * c["Hi"] * N * (N + 1) / 2 / row["index_topk"] / 1e9
            progress(f"[{step}/{steps}] N={N}: index top-k, index_dtype=float8_e4m3fn")
            row["index_topk_fp8"] = timer(select_fn_fp8, [(x[3].detach(), x[4].detach()) for x in sets])
        if on_gpu and msa.has_cuda_kernel("reverse_index"):
            progress(f"[{step}/{steps}] N={N}: reverse index")
            idx = synthetic_indices(N, device, seed=N)
            cu = torch.tensor([0, N], dtype=torch.int32, device=device)
            row["reverse_index"] = timer(lambda i: torch.ops.msa.reverse_index(i, cu, N, c["block_size"]), [(idx,)])
        rows.append(row)
        del sets
        if on_gpu:
            torch.cuda.empty_cache()
    return rows


def fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def table(rows, device):
    cols = [("N", "N", "d"), ("dense fwd ms", "dense_fwd", ".3f"), ("dense fwd+bwd ms", "dense_fwdbwd", ".3f"),
            ("dense TFLOP/s", "dense_tflops", ".3g"), ("msa fwd ms", "msa_fwd", ".3f"),
            ("dense/msa fwd", "fwd_ratio", ".2f"), ("msa fwd+bwd ms", "msa_fwdbwd", ".3f"), ("msa attended TFLOP/s", "attended_tflops", ".3g"),
            ("msa fwd+bwd floor ms", "floor", ".3f"), ("floor / msa fwd+bwd", "floor_frac", ".0%"),
            ("dense/msa fwd+bwd", "ratio", ".2f"), ("msa fwd+bwd deterministic ms", "msa_fwdbwd_det", ".3f"),
            ("deterministic cost", "det_cost", ".1%"), ("msa fwd+bwd warmup ms", "msa_fwdbwd_warmup", ".3f"),
            ("warmup / dense fwd+bwd", "warmup_over_dense", ".2f"),
            ("msa fwd+bwd, last N/2 queries ms", "msa_fwdbwd_suffix", ".3f"),
            ("msa fwd+bwd, fp8 index ms", "msa_fwdbwd_fp8", ".3f"),
            ("dense/msa fwd+bwd, fp8 index", "ratio_fp8", ".2f"),
            ("fp8 selection recall", "fp8_recall", ".4f")]
    if device.type == "cuda":
        cols += [("msa fwd+bwd, CUDA graph ms", "msa_fwdbwd_graph", ".3f"),
                 ("dense fwd+bwd, CUDA graph ms", "dense_fwdbwd_graph", ".3f"),
                 ("msa fwd+bwd from (B,H,N,D) views ms", "msa_fwdbwd_bhnd", ".3f"), ("index top-k ms", "index_topk", ".3f"), ("index TFLOP/s", "index_tflops", ".3g"),
                 ("index top-k, fp8 ms", "index_topk_fp8", ".3f"),
                 ("reverse index ms", "reverse_index", ".3f"), ("sparse fwd ms", "sparse_fwd", ".3f"),
                 ("sparse fwd TFLOP/s", "sparse_fwd_tflops", ".3g"), ("sparse bwd ms", "sparse_bwd", ".3f"),
                 ("sparse bwd TFLOP/s", "sparse_bwd_tflops", ".3g"), ("sparse bwd, sink ms", "sparse_bwd_sink", ".3f"), ("msa fwd+bwd peak above inputs GiB", "peak_extra_gib", ".2f"),
                 ("workspace GiB (peak - out - grads)", "workspace_gib", ".2f"),
                 ("deterministic workspace GiB", "workspace_det_gib", ".2f")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(key), spec) for _, key, spec in cols) + " |")
    return "\n".join(lines)


def header(device, argv, peak_tflops=None):
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'x86_64'}, {os.cpu_count()} cores)"
    notes = []
    if device.type == "cuda" and not msa.has_cuda_kernel("msa_fwd"):
        notes.append("msa_fwd has no CUDA kernel in this build yet: msa columns are n/a (not timed).")
    if device.type == "cpu":
        notes.append("CPU: msa runs the chunked PyTorch reference (msa/reference.py); dense is torch's CPU SDPA; "
                     "deterministic columns n/a (that path is deterministic whatever the flag).")
    notes += [f"CUDA graph capture failed (column n/a): {f}" for f in CAPTURE_FAILURES]
    return "\n".join([
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- commit: {git_commit()}",
        f"- device: {gpu}; torch {torch.__version__}",
        f"- command: `{' '.join(argv)}`",
        f"- config: B=1, Hq={CONFIG['Hq']}, Hkv={CONFIG['Hkv']}, Hi={CONFIG['Hi']}, Hki={CONFIG['Hki']}, "
        f"D={CONFIG['D']}, Di={CONFIG['Di']}, block={CONFIG['block_size']}, k={CONFIG['topk']}, bf16, causal; "
        f"median ms; TFLOP/s: dense = 3.5 * 2N^2*D*Hq / time, attended = 3.5 * 4*D*sum|T| / time, "
        f"index = 2*Di*Hi*N(N+1)/2 / time (SPEC 8); sparse fwd = 1.5 * 4*D*sum|T| / time (QK^T twice, PV once: "
        f"stats pass + output pass; msa fwd adds the selection and the index/KL terms); sparse bwd = 2.5 * 4*D*sum|T| "
        f"/ time (main dq, dk, dv; the KL's index gradient is computed in the forward); sparse bwd, sink = the same "
        f"selection with block 0 in every row (one key per index group selected by every token); deterministic = "
        f"msa fwd+bwd with deterministic=True (bitwise reproducible gradients), cost = its extra time; (B,H,N,D) "
        f"views = the inputs as transposes of (B, H, N, D) tensors (one internal copy each); warmup = msa fwd+bwd "
        f"with warmup=True (dense main branch, KL over the full causal set), and its time over dense fwd+bwd; last N/2 "
        f"queries = msa fwd+bwd of queries N/2..N-1 over all N keys (suffix queries, bottom-right causal: a query "
        f"shard of context parallelism; dk, dv, dk_idx over all N); CUDA graph = the same fwd+bwd captured once "
        f"(torch.cuda.graph) and replayed on each input set copied into the captured tensors: the GPU time without "
        f"the host's launch costs; fp8 index = msa fwd+bwd with index_dtype=torch.float8_e4m3fn (the selection scores "
        f"e4m3 copies of q_idx, k_idx: msa.fp8_index_copies, then the FP8 top-k; KL and gradients unchanged), its "
        f"recall = the fraction of the bf16 selection's kept blocks it keeps (these random inputs), index top-k, fp8 "
        f"= select_blocks with it (the copies included); floor = the step's useful FLOPs (attended "
        f"fwd+bwd, index scoring, and the KL's index-branch GEMMs 6*Di*sum over (i, r) |T(i, r)|: msa.bench."
        f"msa_step_flops) at the matmul peak below, floor / msa fwd+bwd = the fraction of it reached",
        "- matmul peak (this run): " + (f"{peak_tflops:.0f} TFLOP/s (bf16 torch.matmul, best of 8192^3 and 16384^3)"
                                         if peak_tflops else "n/a (not measured off the GPU)"),
        *[f"- note: {n}" for n in notes]])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m msa.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n", type=int, nargs="*", help="sequence lengths (default: 8K..128K on CUDA, 512..2K on CPU)")
    p.add_argument("--reps", type=int, help="timed repetitions (median reported)")
    p.add_argument("--save", nargs="?", const="benchmarks/results", help="write the table to this folder")
    args = p.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        p.error(f"--device {args.device}: {e}")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: expected cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device is visible (torch.cuda.is_available() is False); "
                "leave --device out to run the CPU path")
    cmd = ["python -m msa.bench", *(argv if argv is not None else sys.argv[1:])]
    print(f"msa {msa.__version__} benchmark on {device} (progress on stderr)", flush=True)
    peak = None
    if device.type == "cuda":
        progress("matmul peak (bf16, this run)")
        peak = matmul_peak_tflops(device)
    rows = run(args, peak)
    text = f"# msa benchmark\n\n{header(device, cmd, peak)}\n\n{table(rows, device)}\n"
    print(text)
    if args.save:
        tag = "cpu" if device.type == "cpu" else gpu_tag(torch.cuda.get_device_name(device))
        save_result(text, args.save, tag)
    return 0


def save_result(text, folder, tag):
    """Writes a result table to folder/<UTC date-time>-<tag>-<commit>.md and says where."""
    os.makedirs(folder, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    path = os.path.join(folder, f"{stamp}-{tag}-{git_commit()}.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"saved {path}")
    return path


if __name__ == "__main__":
    sys.exit(main())
