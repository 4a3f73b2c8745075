"""msa.distributed on CUDA with NCCL: one process per GPU against the single-GPU call (out, kl, all five
gradients). NVLink multicast stays off (NCCL_NVLS_ENABLE=0: it can take a shared host's GPUs out of
service). Query-split needs queries that are a suffix of the keys, which the CUDA kernels do not take yet:
it raises NotImplementedError there (tested), and the multi-GPU test runs head-parallel."""
import os

import pytest
import torch

from test_distributed import spawn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def test_cp_one_gpu_is_the_plain_call():
    """A group of one (NCCL): the exchange runs on device tensors and gives back the single-GPU call."""
    spawn(1, [((16, 2, 4, 1), "head", "zigzag", torch.bfloat16, False, "cuda", 4096, 128),
              ((16, 2, 4, 1), "auto", "contiguous", torch.bfloat16, True, "cuda", 4096, 128)])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cp_nccl_head_parallel():
    P = 4 if torch.cuda.device_count() >= 4 else 2
    spawn(P, [((16, 2, 4, 1), "head", "zigzag", torch.bfloat16, False, "cuda", 16384, 128),
              ((16, 2, 4, 1), "head", "contiguous", torch.bfloat16, True, "cuda", 8192, 128)])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_cp_nccl_query_split_says_not_implemented(layout):
    """Every rank raises before any exchange (contiguous: query shard 0 alone could run; it must not wait)."""
    with pytest.raises(BaseException, match="suffix of the keys"):
        spawn(2, [((16, 2, 4, 1), "query", layout, torch.bfloat16, False, "cuda", 4096, 128)])
