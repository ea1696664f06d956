"""EAGLE-2's dynamic token trees, for any drafter that can score a batch of tree nodes in one forward.

The tree grows by cumulative draft log-probability (the product of the draft probabilities along a path, which
tracks how likely the target is to accept it): depth 1 holds the root's `topk` best children; at each further
depth the `topk` best nodes of the last depth (the frontier) are expanded, each with its `topk` best children,
and the next frontier is the `topk` best of those topk^2 children. After `depth` depths every generated node is
a candidate, and the tree keeps the `nodes - 1` candidates of highest score (the rerank). A child never scores
above its parent (log-probabilities are <= 0, and a small per-depth penalty breaks ties), so the kept set is
closed under parents. Children are top-k picks, not samples: the verifier treats them as deterministic
(spec_jax.verify.verify_tree), which keeps it exact at any temperature.

Each expansion feeds the whole frontier history (all depths so far, topk per depth) under its tree mask, so the
drafter's cache is read, never written, while expanding: nothing to undo after verification. That recomputes
earlier depths, topk * depth (depth - 1) / 2 node-forwards in all, cheap for one-layer or few-layer drafters.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from spec_jax import scopes, tree as tree_lib
from spec_jax.proposers.base import TreeDraft

LOGP_FLOOR = -30.0  # per step: a probability below e^-30 is treated as e^-30 (keeps scores finite)
DEPTH_PENALTY = 1e-3  # per depth: a child ranks strictly below its parent even when its probability rounds to 1


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """The shape of EAGLE-2's trees (SGLang's flags): `depth` = num_speculative_tokens, `topk` = eagle_topk,
  `nodes` = num_draft_tokens (root included)."""

  topk: int
  depth: int
  nodes: int

  def __post_init__(self):
    if self.topk < 1 or self.depth < 1:
      raise ValueError(f"a dynamic tree needs topk >= 1 and depth >= 1, got {self.topk} and {self.depth}")
    most = 1 + self.topk + (self.depth - 1) * self.topk ** 2
    if not self.depth + 1 <= self.nodes <= most:
      raise ValueError(f"a depth-{self.depth} top-{self.topk} tree holds {self.depth + 1} to {most} nodes "
                       f"(root included), got num_draft_tokens={self.nodes}")

  @property
  def max_children(self) -> int:
    return self.topk

  @property
  def lookahead(self) -> int:
    """Cache entries a step may write past the last committed token: the verified tree's N - 1, or the widest
    expansion (the drafter's forward writes its fed nodes into a throwaway copy of its cache)."""
    return max(self.nodes - 1, self.topk * self.depth)


def grow(first_logp: jax.Array, first_out, score: Callable, shape: DynamicTree,
         to_target: Optional[Callable] = None) -> TreeDraft:
  """Grow and rerank one tree per row.

  first_logp [B, V'] draft log-probs of the root's children; first_out: a pytree of [B, ...] arrays, what a
  depth-1 node's forward reads from its parent (EAGLE: the feature predicted at the root; else anything).
  score(tokens [B, T] target ids, parent_out (pytree of [B, T, ...]), depths [B, T] (1 = a root child),
  mask bool [B, T, T]) -> (logp [B, T' <= T, V'], out (pytree of [B, T, ...])): one forward of the T fed nodes,
  each attending to the committed context and to its ancestors among them; logp covers at least the last K (the
  frontier, the only ones read: a head over the frontier alone saves its other rows' FLOPs). to_target maps draft-vocabulary ids to
  target ids (a reduced draft vocabulary), identity when None.
  -> TreeDraft [B, N] (node 0 the root, its token left 0 for the loop to fill).
  """
  K, D, N = shape.topk, shape.depth, shape.nodes
  B = first_logp.shape[0]
  ids = to_target or (lambda x: x)
  clip = lambda lp: jnp.maximum(lp.astype(jnp.float32), LOGP_FLOOR)

  with scopes.scope(scopes.SAMPLING):  # over the draft vocabulary: the drafter's head's work
    s, t = jax.lax.top_k(clip(first_logp), K)  # [B, K]
  f_tok, f_score, f_out = [ids(t).astype(jnp.int32)], [s], [jax.tree.map(lambda x: _repeat(x, K), first_out)]
  f_cand = [jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))]  # global candidate index
  f_fed_parent = [jnp.full((B, K), -1, jnp.int32)]  # parent's index among the fed nodes
  c_tok, c_parent, c_score = [f_tok[0]], [jnp.full((B, K), -1, jnp.int32)], [s]
  n_cand = K
  for d in range(1, D):
    fed_tok = jnp.concatenate(f_tok, axis=1)  # [B, dK]
    fed_out = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *f_out)
    depths = jnp.repeat(jnp.arange(1, d + 1, dtype=jnp.int32), K)[None, :].repeat(B, 0)
    with scopes.scope(scopes.TREE):
      mask = tree_lib.ancestor_mask(jnp.concatenate(f_fed_parent, axis=1))
    logp, out = score(fed_tok, fed_out, depths, mask)
    logp, out = clip(logp[:, -K:]), jax.tree.map(lambda x: x[:, -K:], out)  # the frontier's own
    with scopes.scope(scopes.SAMPLING):
      cs, ct = jax.lax.top_k(logp, K)  # [B, K (parent), K (child)]
    child_score = (f_score[-1][:, :, None] + cs - DEPTH_PENALTY).reshape(B, K * K)
    child_tok = ids(ct).astype(jnp.int32).reshape(B, K * K)
    c_tok.append(child_tok)
    c_parent.append(jnp.repeat(f_cand[-1], K, axis=1))
    c_score.append(child_score)
    ns, pick = jax.lax.top_k(child_score, K)  # the next frontier
    par = pick // K
    f_tok.append(jnp.take_along_axis(child_tok, pick, axis=1))
    f_score.append(ns)
    f_out.append(jax.tree.map(lambda x: jnp.take_along_axis(x, _expand_idx(par, x), axis=1), out))
    f_cand.append(n_cand + pick)
    f_fed_parent.append((d - 1) * K + par)
    n_cand += K * K

  return _select(c_tok, c_parent, c_score, n_cand, N)


@scopes.scoped(scopes.TREE)
def _select(c_tok, c_parent, c_score, n_cand: int, N: int) -> TreeDraft:
  """The N - 1 best candidates (closed under parents: a child scores below its parent) as a tree."""
  tok, parent, sc = (jnp.concatenate(x, axis=1) for x in (c_tok, c_parent, c_score))
  B = sc.shape[0]
  _, sel = jax.lax.top_k(sc, N - 1)
  sel = jnp.sort(sel, axis=1)  # candidates are laid out by depth: parents come first
  node_of = jnp.zeros((B, n_cand), jnp.int32).at[jnp.arange(B)[:, None], sel].set(
      jnp.arange(1, N, dtype=jnp.int32)[None, :])
  cand_parent = jnp.take_along_axis(parent, sel, axis=1)
  parent_node = jnp.where(cand_parent < 0, 0,
                          jnp.take_along_axis(node_of, jnp.maximum(cand_parent, 0), axis=1))
  kept = (cand_parent < 0) | (parent_node > 0)  # always true (closed under parents); padding otherwise
  tokens = jnp.where(kept, jnp.take_along_axis(tok, sel, axis=1), -1)
  tokens = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), tokens], axis=1)
  parents = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), parent_node], axis=1)
  return TreeDraft(tokens=tokens, parents=parents)


def _repeat(x, K):
  return jnp.repeat(x[:, None], K, axis=1)


def _expand_idx(idx, x):
  """idx [B, K] as a take_along_axis index for x [B, T, ...]."""
  return idx.reshape(idx.shape + (1,) * (x.ndim - 2))
