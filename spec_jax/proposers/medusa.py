"""Medusa-1 heads on the frozen target: K residual SiLU blocks on the target's last hidden state.

Indexing. `ctx.last_hidden` is the target's final-normed hidden at position p = lengths-2 (the last token fed);
through the LM head it already predicted tokens[lengths-1], the last committed token. Head i reads that same
hidden and predicts the token at p + 2 + i, so head 0 gives the first draft (position lengths) and head i the
(i+1)-th. Training uses the same offsets (train/losses.py: hidden at t -> token t + 2 + i).

Each head is `h + SiLU(W_i h + b_i)`, projected with frozen rows of the target's output matrix (all V, or the
reduced draft vocabulary d2t). The heads are independent of each other's drafts, so the k drafts come from one
batched matmul, no loop.

Trees (`tree`, a StaticTree): head d's top candidates fill depth d + 1, node (r_1, ..., r_d) holding head d's
rank-r_d token under its parent (r_1, ..., r_{d-1}), as Medusa's static trees do. The candidates are top-k, not
sampled, so the verifier treats them as deterministic children (exact at any temperature).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.config import ModelConfig
from spec_jax.kernels.common import gemm_rows
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.proposers import vocab
from spec_jax.proposers.base import Draft, Stateless, TreeDraft
from spec_jax.tree import StaticTree


def param_shapes(d_model: int, num_heads: int) -> dict:
  return {"w": (num_heads, d_model, d_model), "b": (num_heads, d_model)}


def init_params(key, d_model: int, num_heads: int, dtype=jnp.float32, scale: float = 0.0) -> dict:
  """W = 0 makes every head start as the identity map, i.e. the target's own next-token head (Medusa's init)."""
  w = scale * jax.random.normal(key, (num_heads, d_model, d_model)) / np.sqrt(d_model)
  return {"w": w.astype(dtype), "b": jnp.zeros((num_heads, d_model), dtype)}


def head_features(heads: dict, hidden: jax.Array) -> jax.Array:
  """hidden [..., D] -> [..., K, D]: every head's residual block. Published Medusa-1 heads (w [K, NL, D, D],
  b [K, NL, D]) run their NL blocks in turn."""
  if heads["w"].ndim == 4:
    h = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (heads["w"].shape[0], hidden.shape[-1]))
    for j in range(heads["w"].shape[1]):
      w = heads["w"][:, j].astype(h.dtype)
      z = gemm_rows(lambda x: jnp.einsum("...kd,kde->...ke", x, w, preferred_element_type=jnp.float32), h,
                    math.prod(h.shape[:-2]) if h.ndim > 2 else 0) + heads["b"][:, j].astype(jnp.float32)
      h = (h.astype(jnp.float32) + jax.nn.silu(z)).astype(hidden.dtype)
    return h
  h = hidden[..., None, :]
  w = heads["w"].astype(hidden.dtype)
  z = gemm_rows(lambda x: jnp.einsum("...d,kde->...ke", x, w, preferred_element_type=jnp.float32), hidden,
                math.prod(hidden.shape[:-1])) + heads["b"].astype(jnp.float32)
  return (h.astype(jnp.float32) + jax.nn.silu(z)).astype(hidden.dtype)


def project(feats: jax.Array, rows) -> jax.Array:
  """feats [..., k, D] -> float32 logits [..., k, N]: the shared output rows [N, D], or a published head's own
  matrix per head ([K, N, D], the first k used)."""
  if getattr(rows, "ndim", 2) == 3:
    k = feats.shape[-2]
    w = rows[:k]
    return gemm_rows(lambda x: jnp.einsum("...kd,knd->...kn", x, w, preferred_element_type=jnp.float32),
                     feats.astype(rows.dtype), math.prod(feats.shape[:-2]) if feats.ndim > 2 else 0)
  return vocab.project(feats, rows)


@dataclasses.dataclass(frozen=True)
class MedusaProposer(Stateless):
  vocab_size: int  # the target's V (drafts and q are returned over it)
  num_heads: int
  k: int = 4
  reduced: bool = False  # project to the d2t rows only
  name: str = "medusa"
  tree: Optional[StaticTree] = None  # None: chains of k; else k = tree.depth
  num_layers: int = 0  # a published Medusa-1 head's residual blocks per head (own head matrices); 0: ours

  def __post_init__(self):
    if self.tree is not None and self.k != self.tree.depth:
      raise ValueError(f"a medusa tree of depth {self.tree.depth} drafts k = {self.tree.depth}, got k={self.k}")
    if not 1 <= self.k <= self.num_heads:
      raise ValueError(f"medusa drafts at most {self.num_heads} tokens (one per head), got k={self.k}")

  def propose(self, params, state, ctx, k, key):
    feats = head_features(params["heads"], ctx.last_hidden)[:, :k]  # [B, k, D]
    logits = project(feats, params["rows"])
    tokens, q = vocab.draw(key, logits, ctx.sampling, params.get("d2t"), self.vocab_size)
    return Draft(tokens=tokens, probs=q), state

  def propose_tree(self, params, state, ctx, key):
    t = self.tree
    parents, depths, ranks = t.arrays()
    feats = head_features(params["heads"], ctx.last_hidden)[:, :t.depth]  # [B, D, Dm]
    _, top = jax.lax.top_k(project(feats, params["rows"]), t.ranks)  # [B, D, R]
    if "d2t" in params:
      top = jnp.take(params["d2t"], top)
    B = top.shape[0]
    # Node n holds head depths[n] - 1's rank-ranks[n] candidate; the root's entry is replaced by the loop.
    tokens = top[:, np.maximum(depths - 1, 0), ranks].astype(jnp.int32)
    return TreeDraft(tokens=tokens, parents=jnp.broadcast_to(jnp.asarray(parents), (B, t.nodes))), state


def runtime_params(heads: dict, target_params: dict, d2t: Optional[jax.Array] = None) -> dict:
  """The proposer's params: the trained heads plus the frozen output rows (shared with the target)."""
  out = {"heads": heads, "rows": vocab.output_rows(target_params, d2t)}
  if d2t is not None:
    out["d2t"] = jnp.asarray(d2t, jnp.int32)
  return out


def rank_accuracy(meta: dict, depth: int, ranks: int) -> list:
  """acc[d][r]: how often head d's rank-r candidate was the right token on the held-out data of its training
  (the checkpoint's `eval`). Exact per-rank figures (`rank{r}_h{d}`) when the trainer recorded them; otherwise
  the measured top-1 and top-5 accuracies, with ranks 1-4 shared geometrically (a ratio rho per head such that
  top1 * (1 + rho + ... + rho^4) = top5) and continued at the same ratio past rank 4."""
  ev = meta.get("eval") or {}
  acc = []
  for d in range(depth):
    if all(f"rank{r}_h{d}" in ev for r in range(ranks)):
      acc.append([float(ev[f"rank{r}_h{d}"]) for r in range(ranks)])
      continue
    if f"top1_h{d}" not in ev or f"top5_h{d}" not in ev:
      raise ValueError(f"the medusa checkpoint has no held-out accuracy for head {d} (eval top1_h{d}/top5_h{d}); "
                       f"a tree needs it (retrain, or pass an explicit tree)")
    top1, top5 = float(ev[f"top1_h{d}"]), float(ev[f"top5_h{d}"])
    lo, hi = 0.0, 1.0  # sum_{r<5} rho^r is increasing in rho: bisect for top5 / top1
    for _ in range(60):
      rho = (lo + hi) / 2
      lo, hi = (rho, hi) if top1 * sum(rho ** r for r in range(5)) < top5 else (lo, rho)
    acc.append([top1 * rho ** r for r in range(ranks)])
  return acc


def load_medusa(path: str, target_config: ModelConfig, target_params: dict, k: int, topk: int = 1,
                nodes: int = 0):
  """-> (MedusaProposer, params) from a heads checkpoint, checked against the target. With topk > 1, a static
  tree of depth <= k, up to topk candidates per node and `nodes` nodes (root included) chosen by
  StaticTree.best from the heads' held-out per-rank accuracy."""
  dtype = target_params["final_norm"].dtype
  meta, heads, d2t = head_ckpt.load_heads(path, target_config, "medusa", dtype)
  K = int(meta.get("num_heads", 0))
  tree = None
  if topk > 1:
    if not 1 <= k <= K:
      raise ValueError(f"medusa drafts at most {K} tokens (one per head), got k={k}")
    # k caps the depth: a small node budget may spend itself on wider, shallower paths (then k = its depth).
    tree = StaticTree.best(rank_accuracy(meta, k, topk), nodes or 1 + k * topk)
  head_ckpt.check_shapes(heads, param_shapes(target_config.d_model, K), path)
  proposer = MedusaProposer(vocab_size=target_config.vocab_size, num_heads=K, k=k if tree is None else tree.depth,
                            reduced=d2t is not None, tree=tree)
  return proposer, runtime_params(heads, target_params, d2t)
