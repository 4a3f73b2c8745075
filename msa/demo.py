"""msa.demo: train a small model with MiniMax Sparse Attention on a long-context retrieval task.

    python -m msa.demo            # full config for one GPU: N=8192, blocks of 128, top-16, bf16 autocast
    python -m msa.demo --quick    # tiny CPU config: N=1024, blocks of 64, top-4 (~2 minutes on 2 cores)

Three runs with the same seed, hence the same initialization and the same batches:

    dense     the same model with every msa layer in warmup mode for the whole run: dense causal
              attention through msa's warmup path (SPEC 5); the KL still trains the indexer
    warmup    dense for the first --warmup-steps steps, then sparse (top-k blocks per token)
    nowarmup  sparse from step 0

Loss = task cross-entropy + kl_weight * msa.nn.kl_loss(model) (kl_weight = 1). The index branch reads
x.detach(), so the KL trains the index projections only and the task loss everything else. On CUDA the
parameters stay fp32 and the forward runs under torch.autocast(bfloat16); on the CPU, msa's exact fp32 path.

The task: multi-query associative recall in a haystack. Full config (quick in brackets): N = 8192 [1024]
tokens = 64 [16] blocks of 128 [64]. The first 3/4 of the sequence is a haystack of one repeated filler
token holding P = 8 key-value pairs. Each pair is written as 15 [3] copies, one copy = a run of 16 [8]
identical tokens inside one block, the copies of a key in distinct blocks. The last 1/8 holds 128 [32]
query tokens among filler. Every position is embedded as E_a[a] + E_b[b] (a factored embedding): a
copy token is E_key[k] + E_val[v], a query E_key[k] + E_query, the filler E_fill + E_none. The model
predicts v at the query positions only (loss and accuracy there); values are random per sequence, so
the answer has to be read from the context, at least 1/8 of the sequence (8 [2] blocks) away. Choices:

- One attention hop solves it: the query and its copies share E_key[k], so one content-addressed
  attention layer finds them and carries E_val[v] back. The model is one pre-norm block (msa attention +
  MLP, residuals, RMSNorm) and a linear head, as small as the task allows (`layers` in Config sets more).
  A second layer has no retrieval left to do and no loss shapes its attention: in a 2-layer quick run
  its query rows had block recall 0.59 against 0.90 for the retrieving layer.
- copies = topk - 1 makes block recall meaningful. The metric's reference I* is the top-k blocks by
  main attention mass, low-mass ones included. A query row puts its mass on its key's copies, evenly
  (identical tokens, no positions), so I* is the 15 [3] copy blocks plus one, and a selection (which
  always holds the row's own block) that finds every copy scores 15/16 to 1. With a single copy per
  key, 14 of I*'s 16 blocks would be near-zero-mass noise and block recall would measure the noise.
  The indexer still has a real choice: 15 of up to 63 [15] visible blocks.
- Spans and one filler token make it learnable in ~100 steps. At initialization attention is uniform
  and the gradient that starts retrieval scales with the share of the context holding the answer:
  copies * span / N = 1/34 [1/43]. With single-token copies, random fillers and 256 keys the quick model
  was still at 20% accuracy after 120 steps; with 15 copies of 16 tokens a dense model at N = 8192
  learns the task in ~80 steps even at batch 2 (CPU, SDPA stand-in).
- Every key occurs in every sequence (8 keys): the per-key match is learned once, the values are new.
- No rotary embedding (NoPE, as in the global layers of several long-context models): the task is
  content-addressed; without positions every token of a key's copies gets the same logit, so I* is
  clean. With rotary on half the channels the quick run's query-row block recall was ~0.80 instead of
  ~0.90 (copies ranked by distance, and an arbitrary extra block).
- Recall over all rows is dominated by haystack rows, whose attention no loss constrains (the loss is
  at query rows): reported, but the query rows measure the retrieval the task needs.

Logged per step: task loss, accuracy, KL (summed over layers; in sparse mode the KL is over the selected
tokens, SPEC 4, so it is a different quantity from the warmup one). Every eval_every steps on a fixed
held-out batch: loss, accuracy, and msa.metrics.recall of every layer on the tensors the kernel receives
(captured by wrapping msa.nn.msa_attention during evaluation), over recall_rows evenly spaced
qualifying rows ("all") and over the query rows ("query"), averaged over layers (per layer in the JSON).
At the end, the held-out accuracy with the sparse branch forced on ("sparse acc": what the indexer gives).

Writes summary.json (config, per-run curves and evaluations, final metrics, checks, wall time, device,
torch version, git commit, command, date) and curves.png (loss, accuracy, KL, block and score recall)
into --out (default examples/results/demo-<date>-<device>), and prints a table.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import msa
import msa.nn as mnn
from msa import metrics
from msa.bench import selection_recall

RUNS = ("dense", "warmup", "nowarmup")


@dataclasses.dataclass
class Config:
    # data (the defaults are the full GPU config; QUICK below is the CPU one)
    seq_len: int = 8192
    block_size: int = 128
    topk: int = 16
    n_keys: int = 8           # distinct keys (key-value pairs) per sequence, at most block_size // span
    copies: int = 15          # copies of each pair, in distinct blocks: topk - 1 (+ the forced local block)
    span: int = 16            # tokens of one copy (a run of identical tokens inside one block)
    key_vocab: int = 8        # keys drawn from this many (= n_keys: every key in every sequence)
    n_values: int = 32        # values (classes); chance accuracy 1 / n_values
    n_fillers: int = 1        # haystack token types (1: one repeated filler token)
    n_queries: int = 128      # query positions per sequence, in the last query_frac of it
    context_frac: float = 0.75
    query_frac: float = 0.125
    # model
    layers: int = 1
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    index_heads: int = 2
    index_head_dim: int = 64
    index_key_heads: int = 1
    rope_dim: int = 0         # rotary channels of both branches (0: no rotary, see the docstring)
    mlp_ratio: int = 4
    # training
    steps: int = 1500
    batch: int = 16
    warmup_steps: int = 300
    lr: float = 3e-3
    lr_warmup: int = 20
    weight_decay: float = 0.01
    kl_weight: float = 1.0
    grad_clip: float = 1.0
    # evaluation
    eval_every: int = 50
    eval_batch: int = 4
    recall_rows: int = 512    # evenly spaced qualifying rows of the held-out batch for the "all rows" recall
    log_every: int = 1


FULL = Config()
QUICK = Config(seq_len=1024, block_size=64, topk=4, copies=3, span=8, n_queries=32, hidden=128, heads=2, kv_heads=1,
               index_heads=1, steps=100, batch=4, warmup_steps=40, eval_every=10, eval_batch=2, recall_rows=256)


# ----------------------------------------------------------------------------------------------
# Task
# ----------------------------------------------------------------------------------------------
class Task:
    """Multi-query associative recall in a haystack (see the module docstring).

    A position is a pair of ids (a, b), embedded as E_a[a] + E_b[b]:
      filler: a in [0, n_fillers), b = NONE;  pair: a = n_fillers + key, b = value;
      query:  a = n_fillers + key, b = QUERY.  The target of a query is the value of its key.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        c = cfg
        self.n_a = c.n_fillers + c.key_vocab
        self.NONE, self.QUERY = c.n_values, c.n_values + 1
        self.n_b = c.n_values + 2
        self.ctx_blocks = int(c.seq_len * c.context_frac) // c.block_size
        self.q_start = c.seq_len - max(c.n_queries, int(c.seq_len * c.query_frac))
        if not 1 <= c.copies <= self.ctx_blocks:
            raise ValueError(f"copies={c.copies}: expected 1..{self.ctx_blocks} (the context blocks at N={c.seq_len})")
        if self.ctx_blocks * c.block_size > self.q_start:
            raise ValueError(f"the context ({self.ctx_blocks} blocks) overlaps the query region (from {self.q_start})")
        if c.n_keys > c.key_vocab:
            raise ValueError(f"n_keys={c.n_keys} > key_vocab={c.key_vocab}")
        if c.block_size % c.span or c.n_keys > c.block_size // c.span:
            raise ValueError(f"n_keys={c.n_keys} spans of {c.span} tokens must fit in one block of {c.block_size}")

    def batch(self, n: int, gen: torch.Generator):
        """(a, b, query_pos, target): a, b (n, N) int64; query_pos, target (n, n_queries) int64."""
        c = self.cfg
        N, Bk, C, P, R, L = c.seq_len, c.block_size, self.ctx_blocks, c.n_keys, c.copies, c.span
        S = Bk // L  # span slots per block
        a = torch.randint(0, c.n_fillers, (n, N), generator=gen)
        b = torch.full((n, N), self.NONE, dtype=torch.long)
        keys = torch.rand(n, c.key_vocab, generator=gen).argsort(-1)[:, :P]            # distinct keys
        vals = torch.randint(0, c.n_values, (n, P), generator=gen)
        # Copy r of key p goes to block blk[s, p, r]: R distinct blocks of the context per key.
        blk = torch.rand(n, P, C, generator=gen).argsort(-1)[..., :R].reshape(n, P * R)
        # Distinct slots within a block: rank the copies landing in each block (a key has at most one
        # copy per block, so at most P <= S of them), then read a random permutation of the block's slots.
        order = torch.argsort(blk * 2 + torch.rand(n, P * R, generator=gen), dim=-1)  # by block, ties random
        sorted_blk = torch.gather(blk, 1, order).contiguous()
        rank_sorted = torch.arange(P * R).expand(n, -1) - torch.searchsorted(sorted_blk, sorted_blk)
        rank = torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)
        slot = torch.gather(torch.rand(n, C, S, generator=gen).argsort(-1).view(n, C * S), 1, blk * S + rank)
        start = blk * Bk + slot * L                                                   # (n, P*R)
        pos = (start[..., None] + torch.arange(L)).flatten(1)                          # (n, P*R*L), distinct
        a.scatter_(1, pos, (c.n_fillers + keys).repeat_interleave(R * L, dim=1))
        b.scatter_(1, pos, vals.repeat_interleave(R * L, dim=1))
        # Queries: distinct positions in [q_start, N), each asking one of the sequence's keys.
        qpos = torch.rand(n, N - self.q_start, generator=gen).argsort(-1)[:, :c.n_queries].sort(-1).values
        qpos = qpos + self.q_start
        which = torch.randint(0, P, (n, c.n_queries), generator=gen)
        a.scatter_(1, qpos, c.n_fillers + torch.gather(keys, 1, which))
        b.scatter_(1, qpos, torch.full_like(qpos, self.QUERY))
        return a, b, qpos, torch.gather(vals, 1, which)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        c = cfg
        self.norm1 = nn.RMSNorm(c.hidden)
        self.attn = mnn.MSAAttention(c.hidden, c.heads, c.kv_heads, c.head_dim, c.index_heads, c.index_head_dim,
                                     c.index_key_heads, topk=c.topk, block_size=c.block_size,
                                     rope=c.rope_dim > 0, index_rope=c.rope_dim > 0,
                                     rope_dim=c.rope_dim or None, index_rope_dim=c.rope_dim or None)
        self.norm2 = nn.RMSNorm(c.hidden)
        self.mlp = nn.Sequential(nn.Linear(c.hidden, c.mlp_ratio * c.hidden), nn.GELU(),
                                 nn.Linear(c.mlp_ratio * c.hidden, c.hidden))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))[0]
        return x + self.mlp(self.norm2(x))


class RecallModel(nn.Module):
    def __init__(self, cfg: Config, task: Task):
        super().__init__()
        self.emb_a = nn.Embedding(task.n_a, cfg.hidden)
        self.emb_b = nn.Embedding(task.n_b, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.n_values)

    def forward(self, a, b, qpos):
        x = self.emb_a(a) + self.emb_b(b)
        for blk in self.blocks:
            x = blk(x)
        xq = torch.gather(x, 1, qpos[..., None].expand(-1, -1, x.shape[-1]))
        return self.head(self.norm(xq))


# ----------------------------------------------------------------------------------------------
# Evaluation: accuracy and the index's recall, from the tensors the kernel receives
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _capture_attention():
    """Records, per msa_attention call made by msa.nn layers, (q, k, indices) as the kernel sees them."""
    calls = []
    orig = mnn.msa_attention

    def wrapped(q, k, v, q_idx, k_idx, **kw):
        out, kl, idx = orig(q, k, v, q_idx, k_idx, return_indices=True, **kw)
        calls.append((q.detach(), k.detach(), idx))
        return out, kl

    mnn.msa_attention = wrapped
    try:
        yield calls
    finally:
        mnn.msa_attention = orig


def _packed_recall(q, k, idx, cfg, rows):
    B, N = q.shape[:2]
    cu = torch.arange(0, B * N + 1, N, dtype=torch.int32, device=q.device)
    r = metrics.recall(q.reshape(B * N, *q.shape[2:]), k.reshape(B * N, *k.shape[2:]),
                       idx.permute(1, 0, 2, 3).reshape(idx.shape[1], B * N, idx.shape[-1]),
                       block_size=cfg.block_size, rows=rows, cu_seqlens=cu, max_seqlen=N)
    return float(r["block_recall"]), float(r["score_recall"])


@torch.no_grad()
def evaluate(model, held, cfg, amp, recall=True):
    a, b, qpos, tgt = held
    model.eval()
    with _capture_attention() as calls, amp():
        logits = model(a, b, qpos)
    out = dict(eval_loss=float(F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())),
               eval_acc=float((logits.argmax(-1) == tgt).float().mean()))
    if not recall:
        model.train()
        return out
    N = a.shape[1]
    qrows = (qpos + torch.arange(a.shape[0], device=qpos.device)[:, None] * N).flatten()
    if not calls:
        raise RuntimeError("msa.demo: no msa_attention call was captured (msa.nn.MSAAttention no longer calls "
                           "msa.nn.msa_attention?)")
    per = []
    for q, k, idx in calls:
        br_all, sr_all = _packed_recall(q, k, idx, cfg, cfg.recall_rows)
        br_q, sr_q = _packed_recall(q, k, idx, cfg, qrows)
        per.append((br_all, sr_all, br_q, sr_q))
    for j, name in enumerate(("block_recall_all", "score_recall_all", "block_recall_query", "score_recall_query")):
        out[name] = sum(p[j] for p in per) / len(per)
        out[name + "_layers"] = [p[j] for p in per]
    model.train()
    return out


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def _lr(step, cfg):
    if step < cfg.lr_warmup:
        return cfg.lr * (step + 1) / cfg.lr_warmup
    t = (step - cfg.lr_warmup) / max(1, cfg.steps - cfg.lr_warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _amp(device):
    if device.type == "cuda":  # fp32 parameters, bf16 compute: the msa kernels take bf16/fp16
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext  # the CPU path is exact in fp32


def train_run(run, cfg, device, seed, held, bar=None):
    """One training run: run in RUNS. Same seed, same init and same batches for every run."""
    task = Task(cfg)
    torch.manual_seed(seed)
    model = RecallModel(cfg, task).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed + 1)
    amp = _amp(device)
    curves = dict(step=[], loss=[], acc=[], kl=[], dense=[])
    pending = []  # per-step device scalars, read back at eval points (one sync per eval, not per step)

    def flush():
        if pending:
            vals = torch.stack([torch.stack(p[1:]) for p in pending]).tolist()
            for (step, *_), (loss, acc, kl) in zip(pending, vals):
                curves["step"].append(step)
                curves["loss"].append(loss)
                curves["acc"].append(acc)
                curves["kl"].append(kl)
                curves["dense"].append(_is_dense(run, step, cfg))
            pending.clear()

    evals, eval_s = [], 0.0
    t_run = time.perf_counter()
    for step in range(cfg.steps + 1):
        mnn.set_warmup(model, _is_dense(run, min(step, cfg.steps - 1), cfg))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            flush()  # reads the step scalars back: the device is idle after it
            t = time.perf_counter()
            e = evaluate(model, held, cfg, amp)
            eval_s += time.perf_counter() - t
            e["step"] = step
            evals.append(e)
            if bar is not None and curves["loss"]:
                bar.set_postfix(run=run, loss=f"{curves['loss'][-1]:.3f}", acc=f"{e['eval_acc']:.2f}",
                                kl=f"{curves['kl'][-1]:.3f}", recall=f"{e['block_recall_query']:.2f}", refresh=False)
        if step == cfg.steps:
            break
        a, b, qpos, tgt = (x.to(device, non_blocking=True) for x in task.batch(cfg.batch, gen))
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg)
        with amp():
            logits = model(a, b, qpos)
            task_loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
            kl = mnn.kl_loss(model)
        loss = task_loss + cfg.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            acc = (logits.detach().argmax(-1) == tgt).float().mean()
            pending.append((step, task_loss.detach().float(), acc, kl.detach().float()))
        if bar is not None:
            bar.update(1)
    train_s = time.perf_counter() - t_run - eval_s
    final = dict(evals[-1])
    # The same held-out batch with the sparse main branch forced on: what the trained indexer gives.
    mnn.set_warmup(model, False)
    final["eval_acc_sparse"] = evaluate(model, held, cfg, amp, recall=False)["eval_acc"]
    # Control: the same trained model with an untrained indexer (fresh random index projections): how much
    # of the sparse accuracy the learned selection gives, against the blocks a random selection hits.
    final["eval_acc_random_index"] = _random_index_acc(model, held, cfg, amp, seed)
    # The FP8 selection (index_dtype=torch.float8_e4m3fn) of the trained indexer, sparse as above.
    final.update(_fp8_selection(model, held, amp))
    n = max(1, min(len(curves["acc"]), cfg.eval_every))
    final["train_acc_last"] = sum(curves["acc"][-n:]) / n
    final["train_loss_last"] = sum(curves["loss"][-n:]) / n
    return dict(curves=curves, evals=evals, final=final, train_s=train_s, eval_s=eval_s,
                steps_per_s=cfg.steps / max(train_s, 1e-9))


@torch.no_grad()
def _random_index_acc(model, held, cfg, amp, seed):
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "_idx_" in n}
    g = torch.Generator(device="cpu").manual_seed(seed + 104729)
    for n, p in model.named_parameters():
        if "_idx_proj" in n:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    try:
        return evaluate(model, held, cfg, amp, recall=False)["eval_acc"]
    finally:
        for n, p in model.named_parameters():
            if n in saved:
                p.copy_(saved[n])


@torch.no_grad()
def _fp8_selection(model, held, amp):
    """The held-out batch's sparse forward with the selection on e4m3 copies of the index inputs (index_dtype, SPEC 2)
    against the same with the inputs' own dtype: its accuracy, and the share of the latter's kept blocks it keeps
    (msa.bench.selection_recall, all rows of every layer; the forced own block counts in both): the FP8 selection's
    recall on a trained indexer, where the bench measures it on random inputs."""
    a, b, qpos, tgt = held
    model.eval()
    out = {}
    try:
        for name, dtype in (("inputs", None), ("fp8", torch.float8_e4m3fn)):
            mnn.set_index_dtype(model, dtype)
            with _capture_attention() as calls, amp():
                logits = model(a, b, qpos)
            out[name] = (float((logits.argmax(-1) == tgt).float().mean()), [c[2] for c in calls])
    finally:
        mnn.set_index_dtype(model, None)
        model.train()
    pairs = list(zip(out["fp8"][1], out["inputs"][1]))
    return dict(eval_acc_sparse_fp8=out["fp8"][0],
                fp8_selection_recall=sum(selection_recall(g, w) for g, w in pairs) / len(pairs))


def _is_dense(run, step, cfg):
    return run == "dense" or (run == "warmup" and step < cfg.warmup_steps)


# ----------------------------------------------------------------------------------------------
# Output: JSON summary, plots, table
# ----------------------------------------------------------------------------------------------
COLORS = {"dense": "black", "warmup": "tab:blue", "nowarmup": "tab:red"}
LABELS = {"dense": "dense (msa warmup path)", "warmup": "MSA, warmup", "nowarmup": "MSA, no warmup"}


def _smooth(y, n):
    if n <= 1 or len(y) < 2:
        return list(y)
    out, acc = [], 0.0
    for i, v in enumerate(y):
        acc += v
        if i >= n:
            acc -= y[i - n]
        out.append(acc / min(i + 1, n))
    return out


def plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = summary["config"]
    runs = summary["runs"]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    win = max(1, cfg["steps"] // 50)
    for name, r in runs.items():
        c, ev, col = r["curves"], r["evals"], COLORS.get(name)
        es = [e["step"] for e in ev]
        axes[0, 0].plot(c["step"], _smooth(c["loss"], win), color=col, label=LABELS[name])
        axes[0, 1].plot(c["step"], _smooth(c["acc"], win), color=col, alpha=0.5)
        axes[0, 1].plot(es, [e["eval_acc"] for e in ev], "o-", ms=3, color=col, label=LABELS[name])
        axes[0, 2].plot(c["step"], _smooth(c["kl"], win), color=col, label=LABELS[name])
        for j, key in enumerate(("block_recall", "score_recall")):
            ax = axes[1, j]
            ax.plot(es, [e[key + "_query"] for e in ev], "o-", ms=3, color=col, label=f"{LABELS[name]}, query rows")
            ax.plot(es, [e[key + "_all"] for e in ev], "s--", ms=3, color=col, alpha=0.6,
                    label=f"{LABELS[name]}, all rows")
        axes[1, 2].plot(es, [e["eval_loss"] for e in ev], "o-", ms=3, color=col, label=LABELS[name])
    titles = [("task loss (train, smoothed)", "log"), ("retrieval accuracy (line: train; dots: held-out)", None),
              ("KL(P || Pidx), sum over layers (train)", "log"), ("block recall (held-out)", None),
              ("score recall (held-out)", None), ("task loss (held-out)", "log")]
    for ax, (title, scale) in zip(axes.flat, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if scale:
            ax.set_yscale(scale)
        if "warmup" in runs:
            ax.axvline(cfg["warmup_steps"], color="tab:blue", ls=":", lw=1)
        ax.grid(alpha=0.3)
    axes[0, 1].set_ylim(-0.02, 1.02)
    for ax in axes[1, :2]:
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"msa demo: {summary['task']['name']}, N={cfg['seq_len']}, block {cfg['block_size']}, "
                 f"top-{cfg['topk']}, warmup {cfg['warmup_steps']} steps (dotted); {summary['device']}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stamp():
    """The commit written by scripts/stamp_commit.sh into a tree copied without (or with a stale) .git."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".msa_commit")
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _git(*args):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _device_slug(device):
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
    return "-".join("".join(ch if ch.isalnum() else " " for ch in name).split()) or "cuda"


def table(summary):
    rows = [("run", "final acc", "vs dense", "sparse acc", "random-index acc", "fp8 acc/sel", "KL", "block rec q/all",
             "score rec q/all", "steps/s")]
    dense = summary["runs"].get("dense", {}).get("final", {}).get("eval_acc")
    for name, r in summary["runs"].items():
        f = r["final"]
        rel = f"{f['eval_acc'] / dense:.3f}" if dense else "-"
        rows.append((name, f"{f['eval_acc']:.3f}", rel, f"{f['eval_acc_sparse']:.3f}",
                     f"{f['eval_acc_random_index']:.3f}",
                     f"{f['eval_acc_sparse_fp8']:.3f}/{f['fp8_selection_recall']:.3f}", f"{r['curves']['kl'][-1]:.4f}",
                     f"{f['block_recall_query']:.3f}/{f['block_recall_all']:.3f}",
                     f"{f['score_recall_query']:.3f}/{f['score_recall_all']:.3f}", f"{r['steps_per_s']:.2f}"))
    w = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w[j]) if j else c.ljust(w[j]) for j, c in enumerate(r)) for r in rows)


def checks(summary):
    """The outcomes the demo is meant to show, measured (nothing here fails the run)."""
    cfg, runs = summary["config"], summary["runs"]
    out = {}
    if "dense" in runs and "warmup" in runs:
        d, w = runs["dense"]["final"]["eval_acc"], runs["warmup"]["final"]["eval_acc"]
        out["warmup_acc_over_dense"] = w / d if d else None
        out["warmup_reaches_95pct_of_dense"] = bool(d and w >= 0.95 * d)
    if "warmup" in runs:
        kl = runs["warmup"]["curves"]["kl"]
        n = max(1, min(10, cfg["warmup_steps"] // 10))
        if cfg["warmup_steps"] >= 2 * n and len(kl) >= cfg["warmup_steps"]:
            first, last = kl[:n], kl[cfg["warmup_steps"] - n:cfg["warmup_steps"]]
            out["warmup_kl_start"], out["warmup_kl_end"] = sum(first) / n, sum(last) / n
            out["kl_falls_during_warmup"] = out["warmup_kl_end"] < out["warmup_kl_start"]
        f = runs["warmup"]["final"]
        out["warmup_block_recall_query_end"] = f["block_recall_query"]
        out["warmup_block_recall_all_end"] = f["block_recall_all"]
        out["block_recall_query_at_least_0.8"] = f["block_recall_query"] >= 0.8
        out["warmup_random_index_acc"] = f["eval_acc_random_index"]
        out["warmup_fp8_sparse_acc"] = f["eval_acc_sparse_fp8"]
        out["warmup_fp8_selection_recall"] = f["fp8_selection_recall"]
    if "nowarmup" in runs:
        out["nowarmup_acc"] = runs["nowarmup"]["final"]["eval_acc"]
    return out


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m msa.demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny CPU-friendly config (N=1024, block 64, top-4)")
    p.add_argument("--steps", type=int, help="training steps per run")
    p.add_argument("--seq-len", type=int, help="sequence length N")
    p.add_argument("--batch", type=int, help="sequences per step")
    p.add_argument("--warmup-steps", type=int, help="dense warmup steps of the 'warmup' run")
    p.add_argument("--topk", type=int, help="blocks per (token, index group), own block included")
    p.add_argument("--copies", type=int, help="copies of each key-value pair (in distinct blocks)")
    p.add_argument("--layers", type=int, help="msa blocks of the model (default 1: the task is one hop)")
    p.add_argument("--index-head-dim", type=int, choices=(64, 128),
                   help="Di of the index branch (default 64; 128 takes the Hopper FP8 top-k in the runs' FP8 check)")
    p.add_argument("--eval-every", type=int, help="held-out evaluation (accuracy, recall) every this many steps")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", default=None, help="output folder (default examples/results/demo-<date>-<device>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p.parse_args(argv)


def make_config(args):
    cfg = QUICK if args.quick else FULL
    over = {k: v for k, v in (("steps", args.steps), ("seq_len", args.seq_len), ("batch", args.batch),
                              ("warmup_steps", args.warmup_steps), ("eval_every", args.eval_every),
                              ("layers", args.layers), ("topk", args.topk), ("copies", args.copies),
                              ("index_head_dim", args.index_head_dim))
            if v is not None}
    cfg = dataclasses.replace(cfg, **over)
    if cfg.warmup_steps > cfg.steps:
        cfg = dataclasses.replace(cfg, warmup_steps=cfg.steps)
    return cfg


def main(argv=None):
    args = parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in runs if r not in RUNS]
    if bad or not runs:
        raise SystemExit(f"--runs: expected a comma-separated subset of {','.join(RUNS)}, got {args.runs!r}")
    cfg = make_config(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not msa.has_cuda_kernel("msa_fwd"):
        raise SystemExit("--device cuda: this msa build has no CUDA kernels; use --device cpu")
    task = Task(cfg)
    date = datetime.datetime.now()
    out = args.out or os.path.join("examples", "results", f"demo-{date:%Y%m%d-%H%M}-{_device_slug(device)}")
    os.makedirs(out, exist_ok=True)
    held = tuple(x.to(device) for x in task.batch(cfg.eval_batch, torch.Generator().manual_seed(args.seed + 7919)))

    cmd = "python -m msa.demo " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"msa demo on {_device_name(device)}, torch {torch.__version__}: {cmd}")
    print(f"  task: N={cfg.seq_len}, {cfg.n_keys} keys x {cfg.copies} copies in the first "
          f"{task.ctx_blocks} of {-(-cfg.seq_len // cfg.block_size)} blocks, {cfg.n_queries} queries in the last "
          f"{cfg.seq_len - task.q_start} tokens; block {cfg.block_size}, top-{cfg.topk}")
    print(f"  dense baseline: the same model with every msa layer in warmup mode for all steps "
          f"(dense causal attention through msa's warmup path)")
    try:
        from tqdm.auto import tqdm
        bar = None if args.no_progress else tqdm(total=cfg.steps * len(runs), unit="step", mininterval=1.0)
    except ImportError:
        bar = None
    results, t0 = {}, time.perf_counter()
    for run in runs:
        if bar is not None:
            bar.set_description(run)
        results[run] = train_run(run, cfg, device, args.seed, held, bar)
        msg = (f"  {run}: {results[run]['steps_per_s']:.2f} steps/s (train {results[run]['train_s']:.1f} s, "
               f"eval {results[run]['eval_s']:.1f} s), final held-out acc {results[run]['final']['eval_acc']:.3f}")
        (bar.write if bar is not None else print)(msg)
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t0
    summary = dict(
        task=dict(name="multi-query associative recall in a haystack", n_a=task.n_a, n_b=task.n_b,
                  context_blocks=task.ctx_blocks, query_start=task.q_start),
        config=dataclasses.asdict(cfg), seed=args.seed, runs=results, command=cmd, date=date.isoformat(timespec="seconds"),
        device=_device_name(device), torch=torch.__version__, msa=getattr(msa, "__version__", None),
        git_commit=os.environ.get("MSA_COMMIT") or _stamp() or _git("rev-parse", "HEAD"), git_dirty=bool(_git("status", "--porcelain", "--untracked-files=no")),
        dense_attention="msa warmup path (msa.nn.set_warmup(model, True) for all steps: dense causal)",
        autocast="bfloat16" if device.type == "cuda" else None, wall_s=wall)
    summary["checks"] = checks(summary)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(summary, os.path.join(out, "curves.png"))
    print(table(summary))
    print("checks: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in summary["checks"].items()))
    print(f"wall {wall:.1f} s; wrote {os.path.join(out, 'summary.json')} and {os.path.join(out, 'curves.png')}")
    return summary


if __name__ == "__main__":
    main()
