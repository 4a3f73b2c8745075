"""torchrun --nproc_per_node=2 examples/context_parallel.py: MSA over a sequence sharded across ranks.

Runs on GPUs with NCCL (one GPU per rank) or on the CPU with gloo; checks the sharded result against the
single-process call on rank 0's copy of the full inputs and prints the largest differences.
"""
import os

import torch
import torch.distributed as dist

import msa
import msa.distributed as cp


def main():
    gpu = torch.cuda.is_available()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if gpu else torch.float32
    B, N = 1, 8192 if gpu else 1024
    g = torch.Generator().manual_seed(0)  # every rank draws the same full tensors
    heads = [(16, 128), (2, 128), (2, 128), (4, 128), (1, 128)]  # q, k, v, q_idx, k_idx: (H, D)
    full = [torch.randn(B, N, h, d, generator=g).to(device, dtype).requires_grad_() for h, d in heads]

    shards = [cp.shard_sequence(x) for x in full]
    out, kl = cp.msa_attention_cp(*shards, topk=16, block_size=128)
    (out.float().square().mean() / P + kl / P).backward()
    got = cp.gather_sequence(out.detach())

    ref_out, ref_kl = msa.msa_attention(*full, topk=16, block_size=128)
    grads = [x.grad.clone() for x in full]
    for x in full:
        x.grad = None
    (ref_out.float().square().mean() + ref_kl).backward()  # the sum of the per-rank losses
    for gr in grads:
        dist.all_reduce(gr)
    if rank == 0:
        print(f"P={P} N={N} {dtype}: max |out - single| = {(got - ref_out).abs().max().item():.3g}, "
              f"kl {kl.item():.6f} vs {ref_kl.item():.6f}")
        for name, gr, x in zip(("q", "k", "v", "q_idx", "k_idx"), grads, full):
            print(f"  d{name}: max |diff| = {(gr - x.grad).abs().max().item():.3g} (max |grad| "
                  f"{x.grad.abs().max().item():.3g})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
