"""The compiled reverse index (CUDA) against the CPU definition."""
import pytest
import torch

from helpers import make_packed, poison_allocator

pytestmark = pytest.mark.gpu
ops = torch.ops.msa


def random_indices(Hi, lengths, topk, block_size, seed, device):
    """Valid-looking selections with the local block, random earlier blocks, repeats and -1 gaps."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        local = torch.arange(n) // block_size
        rnd = (torch.rand(Hi, n, topk, generator=g) * (local[None, :, None] + 1)).long()
        rnd[..., 0] = local
        rnd[torch.rand(Hi, n, topk, generator=g) < 0.1] = -1
        rows.append(rnd)
    return torch.cat(rows, dim=1).to(torch.int32).to(device)


@pytest.mark.parametrize("lengths,block_size,topk", [([5000, 1, 129, 3000], 64, 16), ([8192], 128, 16),
                                                     ([300, 0, 700], 128, 3)])
def test_reverse_index_matches_cpu(lengths, block_size, topk):
    Hi = 4
    idx = random_indices(Hi, lengths, topk, block_size, seed=sum(lengths), device="cuda")
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    want = ops.reverse_index(idx.cpu(), cu, max(lengths), block_size)
    poison_allocator()
    got = ops.reverse_index(idx, cu.cuda(), max(lengths), block_size)
    for g, w in zip(got, want):
        assert g.dtype == torch.int32 and g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)
    again = ops.reverse_index(idx, cu.cuda(), max(lengths), block_size)
    for g, a in zip(got, again):  # deterministic
        assert torch.equal(g, a)


def test_reverse_index_of_selection():
    q, k, v, qi, ki, cu, mx = make_packed([700, 129], (8, 2, 4, 1), 64, 64, dtype=torch.float32, seed=5)
    idx = ops.select_blocks(qi, ki, cu, mx, 3, 64, 0.125)
    want = ops.reverse_index(idx, cu, mx, 64)
    got = ops.reverse_index(idx.cuda(), cu.cuda(), mx, 64)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)
