"""msa.demo end to end: a tiny CPU run of all three runs writes a complete summary and the plot."""
import json
import math

import pytest
import torch

pytest.importorskip("matplotlib")

from msa import demo  # noqa: E402


def _finite(values):
    return len(values) > 0 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _check_summary(out, steps, warmup_steps, device_type):
    summary = json.loads((out / "summary.json").read_text())
    for key in ("config", "runs", "checks", "device", "torch", "date", "command", "git_commit", "wall_s"):
        assert key in summary, key
    assert summary["torch"] == torch.__version__
    assert summary["config"]["steps"] == steps
    assert set(summary["runs"]) == set(demo.RUNS)
    for name, run in summary["runs"].items():
        c = run["curves"]
        assert c["step"] == list(range(steps)), name
        for key in ("loss", "acc", "kl"):
            assert len(c[key]) == steps and _finite(c[key]), (name, key)
        assert all(0.0 <= a <= 1.0 for a in c["acc"])
        assert all(k >= -1e-6 for k in c["kl"]), (name, c["kl"])
        dense = [True] * steps if name == "dense" else \
            [s < warmup_steps for s in range(steps)] if name == "warmup" else [False] * steps
        assert c["dense"] == dense, name
        assert len(run["evals"]) >= 2 and run["evals"][-1]["step"] == steps
        for e in run["evals"]:
            vals = [e[k] for k in ("eval_loss", "eval_acc", "block_recall_all", "score_recall_all",
                                   "block_recall_query", "score_recall_query")]
            assert _finite(vals), (name, e)
            assert all(0.0 <= v <= 1.0 + 1e-5 for v in vals[1:]), (name, e)
        f = run["final"]
        assert _finite([f["eval_acc"], f["eval_acc_sparse"], f["train_acc_last"], run["steps_per_s"]])
        # The FP8 selection on the trained indexer: an accuracy, and a share of the other selection's kept blocks
        # that counts at least the forced own block of every row (so > 0).
        assert 0.0 <= f["eval_acc_sparse_fp8"] <= 1.0 and 0.0 < f["fp8_selection_recall"] <= 1.0, f
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    if device_type == "cpu":
        assert summary["device"].startswith("cpu")
    return summary


def test_demo_cpu_tiny(tmp_path):
    out = tmp_path / "demo"
    steps, warmup = 6, 3
    summary = demo.main(["--quick", "--steps", str(steps), "--warmup-steps", str(warmup), "--seq-len", "512",
                         "--batch", "2", "--eval-every", "3", "--device", "cpu", "--out", str(out),
                         "--no-progress"])
    saved = _check_summary(out, steps, warmup, "cpu")
    assert saved["checks"] == json.loads(json.dumps(summary["checks"]))
    # The "dense" flags above restate the schedule; the runs themselves must follow it. Same seed, init and
    # batches: the warmup run's dense steps reproduce the dense run's, and every sparse step differs from it
    # (the KL at step 0: 0.437 sparse vs 0.415 dense, measured).
    runs = {name: saved["runs"][name]["curves"] for name in demo.RUNS}
    for key in ("loss", "kl"):
        assert runs["warmup"][key][:warmup] == pytest.approx(runs["dense"][key][:warmup], rel=1e-6, abs=0), key
    for name, first_sparse in (("warmup", warmup), ("nowarmup", 0)):
        for s in range(first_sparse, steps):
            d, k = runs["dense"]["kl"][s], runs[name]["kl"][s]
            assert abs(k - d) > 1e-3 * d, f"{name} step {s}: KL {k} equals the dense run's: not sparse"
    assert saved["config"]["seq_len"] == 512 and saved["config"]["block_size"] == 64


def test_index_head_dim_option():
    """--index-head-dim sets the index branch's Di (128: the Hopper FP8 top-k in the runs' FP8 check); others refused."""
    assert demo.make_config(demo.parse_args(["--quick", "--index-head-dim", "128"])).index_head_dim == 128
    assert demo.make_config(demo.parse_args(["--quick"])).index_head_dim == 64
    with pytest.raises(SystemExit):
        demo.parse_args(["--index-head-dim", "96"])


def test_task_layout():
    """Every key's copies sit in distinct context blocks, each a run of `span` identical tokens, and every
    query's target is the value of its key."""
    cfg = demo.QUICK
    task = demo.Task(cfg)
    a, b, qpos, tgt = task.batch(3, torch.Generator().manual_seed(0))
    for s in range(3):
        pair = b[s] < cfg.n_values
        assert int(pair.sum()) == cfg.n_keys * cfg.copies * cfg.span
        assert int(pair.nonzero().max()) < task.ctx_blocks * cfg.block_size
        for key in a[s, pair].unique():
            where = (pair & (a[s] == key)).nonzero().flatten()
            blocks = where // cfg.block_size
            assert len(blocks.unique()) == cfg.copies
            assert (torch.bincount(blocks) <= cfg.span).all()
            assert len(b[s, where].unique()) == 1
        assert (b[s, qpos[s]] == task.QUERY).all() and (qpos[s] >= task.q_start).all()
        for q, v in zip(qpos[s], tgt[s]):
            where = (pair & (a[s] == a[s, q])).nonzero().flatten()
            assert int(b[s, where[0]]) == int(v)


@pytest.mark.gpu
def test_demo_cuda_short(tmp_path):
    out = tmp_path / "demo"
    steps, warmup = 100, 50
    demo.main(["--steps", str(steps), "--warmup-steps", str(warmup), "--eval-every", "25", "--device", "cuda",
               "--out", str(out), "--no-progress"])
    summary = _check_summary(out, steps, warmup, "cuda")
    assert summary["autocast"] == "bfloat16"
