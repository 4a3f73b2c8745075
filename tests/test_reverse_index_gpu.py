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


def _work_list_oracle(offsets, per_item):
    """item_offsets, items and each item's size from the reverse index's offsets (the ops' definition)."""
    counts = (offsets[1:] - offsets[:-1]).long()
    n_items = (counts + per_item - 1) // per_item
    item_offsets = torch.cat([torch.zeros(1, dtype=torch.long), n_items.cumsum(0)])
    key = torch.repeat_interleave(torch.arange(counts.numel()), n_items)
    c = torch.arange(key.numel()) - item_offsets[key]
    first = offsets[:-1].long()[key] + c * per_item
    size = torch.minimum(torch.full_like(c, per_item), counts[key] - c * per_item)
    return item_offsets, torch.stack([key, first], 1), size


@pytest.mark.parametrize("per_item", [1, 7, 64, 2048])
@pytest.mark.parametrize("ordered", [True, False])
def test_work_list_and_launch_order(monkeypatch, per_item, ordered):
    """The work list (item offsets, (key, first row) per item) and the launch order the sparse kernels run
    it in: a permutation of the max_items slots, the full items first in key order, then the partial items
    by size class (64 classes of per_item) descending, key order within a class, then the idle slots in
    order. Over 1024 keys and items, so the one-CTA build runs several chunks."""
    if not ordered:
        monkeypatch.setenv("MSA_ITEM_ORDER", "0")
    lengths, block_size, topk, Hi = [20000, 3, 9000], 64, 8, 4
    idx = random_indices(Hi, lengths, topk, block_size, seed=per_item, device="cuda")
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    offsets_want, rows_want, _ = ops.reverse_index(idx.cpu(), cu, max(lengths), block_size)
    poison_allocator()
    offsets, rows, item_offsets, items, order = (t.cpu() for t in ops._work_list(idx, cu.cuda(), max(lengths),
                                                                                 block_size, per_item))
    assert torch.equal(offsets, offsets_want) and torch.equal(rows, rows_want)
    item_offsets_want, items_want, size = _work_list_oracle(offsets_want, per_item)
    total = int(item_offsets_want[-1])
    assert torch.equal(item_offsets.long(), item_offsets_want)
    assert items.shape[0] >= total and torch.equal(items[:total].long(), items_want)
    if not ordered:
        assert order.numel() == 0
        return
    max_items = items.shape[0]
    assert order.shape == (max_items,) and torch.equal(order.sort().values.long(), torch.arange(max_items))
    assert torch.equal(order[total:].long(), torch.arange(total, max_items))
    full = (size == per_item).nonzero().flatten()
    assert torch.equal(order[:full.numel()].long(), full)
    part = order[full.numel():total].long()
    cls = size[part] * 64 // per_item
    assert (cls[1:] <= cls[:-1]).all(), "partial items not by size class, descending"
    same = cls[1:] == cls[:-1]
    assert (part[1:][same] > part[:-1][same]).all(), "key order within a class"
    assert ((size[part] < per_item) & (size[part] > 0)).all()
    again = ops._work_list(idx, cu.cuda(), max(lengths), block_size, per_item)
    assert torch.equal(again[4].cpu(), order)  # deterministic
