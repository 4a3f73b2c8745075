import torch, msa
idx = torch.zeros(4, 260, 2, dtype=torch.int32, device="cuda")
bad_cu = torch.tensor([0, 200, 100, 260], dtype=torch.int32, device="cuda")
try:
    torch.ops.msa.reverse_index(idx, bad_cu, 200, 64)
except ValueError as e:
    print("ok:", e)
