"""msa.distributed on CUDA with NCCL: one process per GPU against the single-GPU call (out, kl, all five
gradients). NVLink multicast stays off (NCCL_NVLS_ENABLE=0: it can take a shared host's GPUs out of
service). Query-split runs each query shard as queries that are a suffix of the keys, warmup included."""
import os

import pytest
import torch

from test_distributed import spawn, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def test_cp_one_gpu_is_the_plain_call():
    """A group of one (NCCL): the exchange runs on device tensors and gives back the single-GPU call."""
    spawn(1, [((16, 2, 4, 1), "head", "zigzag", torch.bfloat16, False, "cuda", 4096, 128),
              ((16, 2, 4, 1), "auto", "contiguous", torch.bfloat16, True, "cuda", 4096, 128)])


@pytest.mark.parametrize("P", [2, 4])
def test_cp_gloo_ranks_on_one_gpu(P):
    """Both modes on the CUDA kernels with the ranks sharing one GPU (gloo's collectives take CUDA tensors;
    NCCL needs a GPU per rank): each rank's share of the work (head shards, query shards as suffix queries
    of the keys, warmup, the FP8 selection) runs on the GPU and matches the single-GPU call's out, kl and
    gradients. What it cannot show is NCCL and the speed of several GPUs (test_cp_nccl_* below)."""
    spawn(P, [((16, 2, 4, 1), "query", "zigzag", torch.bfloat16, False, "cuda", 4096, 128),
              ((16, 2, 4, 1), "query", "contiguous", torch.bfloat16, True, "cuda", 4096, 128),
              ((8, 4, 2, 1), "auto", "zigzag", torch.float16, False, "cuda", 2048, 64),
              ((8, 4, 2, 1), "query", "contiguous", torch.float16, True, "cuda", 2048, 64),
              ((16, 2, 4, 1), "head", "zigzag", torch.bfloat16, False, "cuda", 4096, 128),
              ((16, 2, 4, 1), "query", "zigzag", torch.bfloat16, False, "cuda", 4096, 128, torch.float8_e4m3fn),
              ((16, 2, 4, 1), "head", "contiguous", torch.bfloat16, False, "cuda", 4096, 128,
               torch.float8_e4m3fn)],
          backend="gloo")


def test_bench_cp_runs_on_cuda(tmp_path):
    """The CP benchmark's CUDA path end to end (torchrun, two ranks over gloo on the available GPUs, short
    lengths): it runs, saves its table and labels it a functional run, not a measurement."""
    r = torchrun("-m", "msa.bench_cp", "--backend", "gloo", "--seqlen", "8192", "--reps", "1", "--save", str(tmp_path))
    saved = list(tmp_path.iterdir())
    assert len(saved) == 1 and "| 8192 |" in saved[0].read_text(), r.stdout
    assert "no performance claim" in saved[0].read_text()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cp_nccl_head_parallel():
    P = 4 if torch.cuda.device_count() >= 4 else 2
    spawn(P, [((16, 2, 4, 1), "head", "zigzag", torch.bfloat16, False, "cuda", 16384, 128),
              ((16, 2, 4, 1), "head", "contiguous", torch.bfloat16, True, "cuda", 8192, 128)])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_cp_nccl_query_split(layout):
    """Query shards as suffix queries on the CUDA kernels: the single-GPU call's out, kl and gradients."""
    spawn(2, [((16, 2, 4, 1), "query", layout, torch.bfloat16, False, "cuda", 4096, 128),
              ((8, 4, 2, 1), "query", layout, torch.float16, False, "cuda", 2048, 64)])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_cp_nccl_query_split_warmup(layout):
    """Warmup on the query shards (flash with the key layout, the dense KL kernel or, Hkv > Hi, the dense
    mode): the single-GPU call's out, kl and gradients."""
    spawn(2, [((16, 2, 4, 1), "query", layout, torch.bfloat16, True, "cuda", 4096, 128),
              ((8, 4, 2, 1), "query", layout, torch.float16, True, "cuda", 2048, 64)])
