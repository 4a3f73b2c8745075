"""torchrun --nproc_per_node=P -m msa.bench_cp: context parallelism against one GPU.

Per N: fwd+bwd of `msa.distributed.msa_attention_cp` with the sequence of N tokens sharded over the P
ranks (bench configuration of SPEC 8, bf16), and of `msa_attention` on one GPU (rank 0 alone) at N / P;
tokens per second = tokens of the sequence / time of the step. Without CUDA it runs the CPU reference with
gloo (a smoke run of the code path: those figures are no performance claim). `--backend gloo` on CUDA puts
rank r on GPU r % device_count, so P ranks can share one GPU: a functional run of the CUDA path, also no
performance claim (the table says so). The default lengths go to 2M tokens, one GPU's 1M step doubled. `--save` writes the table
with date, commit, devices and command under benchmarks/results/ (rank 0).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import msa.distributed as cp
from msa.bench import CONFIG, Timer, git_commit, make_inputs, msa_fwd_bwd, save_result


def _step_cp(group, layout, mode):
    """msa.bench.msa_fwd_bwd (the one-device step) with the sharded call: the same gradients of ones."""
    def step(q, k, v, qi, ki):
        out, kl = cp.msa_attention_cp(q, k, v, qi, ki, group=group, layout=layout, mode=mode, topk=CONFIG["topk"],
                                      block_size=CONFIG["block_size"])
        torch.autograd.grad((out, kl), (q, k, v, qi, ki), (torch.ones_like(out), torch.ones_like(kl)))
    return step


def _shard(x, layout):
    return cp.shard_sequence(x.detach(), layout=layout).requires_grad_()


def run(args, device, P, rank):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device, args.reps)
    rows = []
    for N in args.seqlen:
        sets = [[_shard(x, args.layout) for x in make_inputs(N, device, dtype, seed)] for seed in range(2)]
        dist.barrier()
        t_cp = timer(_step_cp(None, args.layout, args.mode), sets)
        del sets
        t_one = None
        if rank == 0:
            one = [make_inputs(N // P, device, dtype, seed) for seed in range(2)]
            t_one = timer(msa_fwd_bwd, one)
            del one
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append((N, t_cp, t_one))
    return rows


def table(rows, P):
    lines = [f"| N | CP over {P} (ms) | CP tokens/s | 1 device at N/{P} (ms) | 1 device tokens/s | CP / 1 device "
             f"(tokens/s) |", "|---|---|---|---|---|---|"]
    for N, t_cp, t_one in rows:
        a, b = N / t_cp * 1e3, (N // P) / t_one * 1e3
        lines.append(f"| {N} | {t_cp:.2f} | {a:,.0f} | {t_one:.2f} | {b:,.0f} | {a / b:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="torchrun --nproc_per_node=P -m msa.bench_cp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, nargs="*", help="sequence lengths (default: 128K, 1M, 2M on CUDA; 1K on CPU)")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl on CUDA, gloo on the CPU")
    p.add_argument("--layout", default="zigzag", choices=cp.LAYOUTS)
    p.add_argument("--mode", default="auto", choices=cp.MODES)
    p.add_argument("--reps", type=int, help="timed repetitions (median reported)")
    p.add_argument("--save", nargs="?", const="benchmarks/results", help="write the table to this folder")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (it can take a shared host's GPUs down)
    backend = args.backend or ("nccl" if on_gpu else "gloo")
    dist.init_process_group(backend)
    P, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    shared = on_gpu and backend == "gloo"  # ranks may share a GPU: not a measurement of P GPUs
    args.seqlen = args.seqlen or ([131072, 1048576, 2097152] if on_gpu else [1024])
    args.reps = args.reps or (5 if on_gpu else 2)
    try:
        rows = run(args, device, P, rank)
    finally:
        dist.destroy_process_group()
    if rank:
        return 0
    if shared:
        what = (f"{P} ranks over gloo on {min(P, torch.cuda.device_count())} x {torch.cuda.get_device_name(device)} "
                f"(a functional run of the CUDA path, no performance claim)")
    elif on_gpu:
        what = f"{P} x {torch.cuda.get_device_name(device)} ({backend})"
    else:
        what = f"{P} CPU processes (gloo; a smoke run, no performance claim)"
    cmd = f"torchrun --nproc_per_node={P} -m msa.bench_cp {' '.join(argv if argv is not None else sys.argv[1:])}"
    text = "\n".join([
        "# msa context-parallel benchmark", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- commit: {git_commit()}", f"- devices: {what}; torch {torch.__version__}", f"- command: `{cmd.strip()}`",
        f"- config: SPEC 8 bench configuration (B=1, Hq={CONFIG['Hq']}, Hkv={CONFIG['Hkv']}, Hi={CONFIG['Hi']}, "
        f"Hki={CONFIG['Hki']}, D={CONFIG['D']}, block {CONFIG['block_size']}, top-{CONFIG['topk']}), fwd+bwd median "
        f"ms, layout {args.layout}, mode {args.mode}; tokens/s = tokens of one sequence / step time", "",
        table(rows, P), ""])
    print(text)
    if args.save:
        save_result(text, args.save, f"cp{P}-{'gpu-gloo-functional' if shared else 'gpu' if on_gpu else 'cpu'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
