"""msa.bench's accounting (CPU): the attended-token count against brute force, and the floor's FLOPs
(msa_step_flops) against a GEMM-by-GEMM count of the same selection; and a CPU run's table has the floor
columns (n/a off the GPU: no matmul peak is measured there), every other column timed, the ratios and the
dense TFLOP/s computed from the timed columns."""
import pytest
import torch

import msa
from msa import bench


def brute_attended(idx, block_size):
    """sum over (r, i) of |T(i, r)|: keys j <= i in the distinct selected blocks of row (r, i)."""
    Hi, N, _ = idx.shape
    total = 0
    for r in range(Hi):
        for i in range(N):
            blocks = {int(b) for b in idx[r, i] if int(b) >= 0}
            total += sum(1 for j in range(i + 1) if j // block_size in blocks)
    return total


def test_attended_tokens_and_step_flops_match_a_brute_force_count():
    torch.manual_seed(0)
    c = dict(bench.CONFIG, Hq=8, Hkv=2, Hi=2, D=64, Di=64, block_size=64, topk=2)
    N = 300  # not a multiple of the block: a short last block
    qi = torch.randn(1, N, c["Hi"], c["Di"])
    ki = torch.randn(1, N, 1, c["Di"])
    idx = msa.select_blocks(qi, ki, topk=c["topk"], block_size=c["block_size"])[0]
    att = brute_attended(idx, c["block_size"])
    assert bench.attended_tokens(idx, c["block_size"]) == att
    G = c["Hq"] // c["Hi"]
    # GEMM by GEMM, per (token, query head, attended key): forward Q K^T, P V; backward S, dP, dV, dK, dQ.
    main = (2 + 5) * 2 * c["D"] * att * G
    scores = sum(2 * c["Di"] * c["Hi"] * (i + 1) for i in range(N))  # every causal (i, j) per index group
    kl = (1 + 2) * 2 * c["Di"] * att  # the index logits over the selected keys, dq_idx, dk_idx
    assert bench.msa_step_flops(N, att, c) == main + scores + kl


@pytest.mark.parametrize("N", [1024, 2048, 5000])
def test_synthetic_indices_are_a_valid_selection(N):
    """The timing selection at N below, at and above topk blocks: the own block first-in, distinct blocks at or
    before it, every earlier block taken while fewer than topk exist, -1 padding last."""
    c = bench.CONFIG
    bs, k = c["block_size"], c["topk"]
    idx = bench.synthetic_indices(N, "cpu", 0)
    assert idx.shape == (c["Hi"], N, k) and idx.dtype == torch.int32
    for i in (0, 1, bs, N // 2, N - 1):
        row = idx[:, i].long()
        for r in range(c["Hi"]):
            sel = [int(b) for b in row[r] if b >= 0]
            assert sel == sorted(set(sel)) and (i // bs) in sel and max(sel) == i // bs
            assert len(sel) == min(k, i // bs + 1)
            assert (row[r, len(sel):] == -1).all()


def test_cpu_bench_table_has_the_floor_columns(capsys):
    assert bench.main(["--device", "cpu", "--n", "256", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("| N |"))
    assert "msa fwd+bwd floor ms" in head and "floor / msa fwd+bwd" in head
    row = next(line for line in out.splitlines() if line.startswith("| 256 |"))
    cells = [x.strip() for x in row.strip("|").split("|")]
    cols = [x.strip() for x in head.strip("|").split("|")]
    assert cells[cols.index("msa fwd+bwd floor ms")] == "n/a"
    assert "matmul peak (this run): n/a" in out
    # The deterministic columns are n/a too (the CPU path is deterministic whatever the flag: a second timing of
    # the same code would show noise as a cost). Every other column is timed on the CPU (msa through its exact
    # CPU path), and the derived columns are computed from the timed ones: each shown figure within the rounding
    # of its inputs (ms to 3 decimals).
    cell = dict(zip(cols, cells))
    untimed = ("msa fwd+bwd floor ms", "floor / msa fwd+bwd", "msa fwd+bwd deterministic ms", "deterministic cost")
    assert all(cell[c] == "n/a" for c in untimed), cell
    assert "deterministic columns n/a" in out
    assert all(v != "n/a" for c, v in cell.items() if c not in untimed), cell
    ms = {c: float(v) for c, v in cell.items() if c.endswith(" ms") and c not in untimed}
    assert len(ms) == 7 and all(v > 0 for v in ms.values()), ms

    def within(shown, slack, f, a, b):
        lo, hi = f(ms[a] - 5e-4, ms[b] + 5e-4), f(ms[a] + 5e-4, ms[b] - 5e-4)
        assert min(lo, hi) - slack <= shown <= max(lo, hi) + slack, (shown, a, b)

    def ratio(x, y):
        return x / y

    within(float(cell["dense/msa fwd"]), 5e-3, ratio, "dense fwd ms", "msa fwd ms")
    within(float(cell["dense/msa fwd+bwd"]), 5e-3, ratio, "dense fwd+bwd ms", "msa fwd+bwd ms")
    within(float(cell["warmup / dense fwd+bwd"]), 5e-3, ratio, "msa fwd+bwd warmup ms", "dense fwd+bwd ms")
    within(float(cell["dense/msa fwd+bwd, fp8 index"]), 5e-3, ratio, "dense fwd+bwd ms", "msa fwd+bwd, fp8 index ms")
    assert 0 < float(cell["fp8 selection recall"]) <= 1
    c = bench.CONFIG
    tflops = float(cell["dense TFLOP/s"])  # 3 significant digits
    within(tflops, 5e-3 * tflops, lambda x, _: 3.5 * 2 * 256 ** 2 * c["D"] * c["Hq"] / x / 1e9,
           "dense fwd+bwd ms", "dense fwd+bwd ms")


@pytest.mark.parametrize("device, why", [("meta", "expected cpu or cuda"), ("nonsense", "--device nonsense"),
                                         ("cuda", "no CUDA device is visible")])
def test_bad_device_is_a_usage_error(device, why, capsys):
    """--device names a usable device, or the bench stops with a usage error before any work (argparse: exit 2)."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(SystemExit) as info:
        bench.main(["--device", device, "--n", "256"])
    assert info.value.code == 2
    assert why in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_bench_graph_columns(capsys):
    """The CUDA bench at a short N: the CUDA-graph replays of msa and dense fwd+bwd are captured (no failure note)
    and timed, and a replay takes no longer than the eager step plus noise (it runs the same kernels without the
    host's launch costs)."""
    bench.CAPTURE_FAILURES.clear()
    assert bench.main(["--n", "1024", "--reps", "5"]) == 0
    out = capsys.readouterr().out
    assert "CUDA graph capture failed" not in out
    head = next(line for line in out.splitlines() if line.startswith("| N |"))
    row = next(line for line in out.splitlines() if line.startswith("| 1024 |"))
    cols = [x.strip() for x in head.strip("|").split("|")]
    cells = dict(zip(cols, (x.strip() for x in row.strip("|").split("|"))))
    for eager, graph in (("msa fwd+bwd ms", "msa fwd+bwd, CUDA graph ms"),
                         ("dense fwd+bwd ms", "dense fwd+bwd, CUDA graph ms")):
        assert cells[graph] != "n/a" and float(cells[graph]) > 0
        assert float(cells[graph]) <= 1.5 * float(cells[eager]) + 0.05, (graph, cells[graph], cells[eager])


@pytest.mark.parametrize(
    "name, tag",
    [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
     ("NVIDIA GeForce RTX 4090", "4090"), ("Tesla T4", "t4")],
)
def test_result_files_are_named_for_the_gpu_model(name, tag):
    # s48 stored an H100 run as "...-hbm3-..." (the name's last word): the model names the file.
    assert bench.gpu_tag(name) == tag
