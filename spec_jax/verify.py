"""Exact verification of a chain of drafted tokens (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023).

`verify_chain` is fully vectorized over rows and draft positions: no Python or lax loop over positions. The first
rejection is found with a cumulative product of the per-position accept flags, and only one distribution per row
(the residual at the first rejection, or the target at position k for the bonus token) is sampled from.

Output convention: row b commits `tokens[b, :num_accepted[b] + 1]`, i.e. the accepted drafts followed by one
correction (at the first rejection) or bonus token (all k drafts accepted). Every position after that holds the
pad value 0.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from spec_jax import sampling
from spec_jax.config import SamplingParams

PAD = 0


def verify_chain(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: Optional[jax.Array],
    key: jax.Array,
    params: SamplingParams,
    *,
    candidates: int = sampling.DEFAULT_CANDIDATES,
) -> tuple[jax.Array, jax.Array]:
  """Verify k drafted tokens per row against the target model.

  Args:
    target_logits: [B, k+1, V] raw target logits; position i scores the token after the prefix + drafts[:i]. They
      are warped by `params` (temperature, top-k, top-p) into the target distribution p.
    draft_tokens: int32 [B, k]. A negative token means "no draft here": it is never accepted, so nothing after it
      is either, and the token at its position is sampled from p (greedy: the argmax).
    draft_probs: [B, k, V] the probabilities q the drafter actually sampled from, or None for a deterministic
      drafter (q one-hot on the drafted token).
    key: PRNG key.
    params: per-row SamplingParams [B]. Greedy rows (temperature 0) accept while the draft equals the target argmax
      and commit the argmax after that; sampling rows accept draft x_i with probability min(1, p_i(x_i)/q_i(x_i))
      and, at the first rejection, sample from normalize(max(p_i - q_i, 0)) (falling back to p_i if that is all
      zero). Rows of both kinds mix in one batch.
    candidates: top-k candidates of the warp's fast path (speed only, see spec_jax.sampling).

  Returns:
    tokens int32 [B, k+1] (PAD after the committed ones) and num_accepted int32 [B] in [0, k].
  """
  b, k1, v = target_logits.shape
  k = k1 - 1
  if draft_tokens.shape != (b, k):
    raise ValueError(f"draft_tokens has shape {draft_tokens.shape}, expected {(b, k)}")
  if draft_probs is not None and draft_probs.shape != (b, k, v):
    raise ValueError(f"draft_probs has shape {draft_probs.shape}, expected {(b, k, v)}")

  draft_tokens = draft_tokens.astype(jnp.int32)
  valid = draft_tokens >= 0
  drafts = jnp.clip(draft_tokens, 0, v - 1)  # safe gather index; `valid` masks the clamped ones
  pos = lax.broadcasted_iota(jnp.int32, (b, k1), 1)
  greedy = params.temperature <= 0

  def commit(num_accepted, last_token):
    drafts_ext = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(pos < num_accepted[:, None], drafts_ext,
                       jnp.where(pos == num_accepted[:, None], last_token[:, None], PAD))
    return tokens.astype(jnp.int32), num_accepted.astype(jnp.int32)

  def first_rejection(accept):
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

  def at(a, idx):  # a[B, k+1, ...] at the per-row position idx[B]
    return jnp.take_along_axis(a, idx.reshape((b, 1) + (1,) * (a.ndim - 2)), axis=1)[:, 0]

  def all_greedy():
    target = sampling.argmax(target_logits)  # [B, k+1]
    n = first_rejection(valid & (drafts == target[:, :k]))
    return commit(n, at(target, n))

  def general():
    k_accept, k_resid = jax.random.split(key)
    # The warped target at every position, as per-position statistics: nothing of size V is materialized here.
    x, t, top_k, top_p = sampling.rows(target_logits, params)
    w = sampling.warp_rows(x, t, top_k, top_p, candidates=candidates, with_lse=True)
    w = jax.tree.map(lambda a: a.reshape(b, k1), w)  # fields [B, k+1]
    target = w.i_last  # the argmax, for greedy rows

    # p_i(x_i) at the drafts.
    # (Gathered from the full logits: slicing [:, :k] first would copy B * k * V floats.)
    d_ext = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    x_d = jnp.take_along_axis(target_logits, d_ext[..., None], axis=-1)[:, :k, 0]  # [B, k]
    w_d = jax.tree.map(lambda a: a[:, :k].reshape(-1), w)
    p_x = sampling.probs_at(x_d.reshape(-1), drafts.reshape(-1), w_d).reshape(b, k)
    if draft_probs is None:
      q_x = jnp.ones_like(p_x)
    else:
      q_x = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0].astype(jnp.float32)
    u = jax.random.uniform(k_accept, (b, k), jnp.float32)  # [0, 1)
    # u < p/q without the division: q = 0 < p accepts, p = 0 rejects.
    sample_accept = u * q_x < p_x
    n = first_rejection(valid & jnp.where(greedy[:, None], drafts == target[:, :k], sample_accept))

    # The distribution at position n: residual max(p - q, 0) after a rejected draft, p itself for the bonus
    # token (n == k) or after a missing draft.
    vocab = lax.broadcasted_iota(jnp.int32, (b, v), 1)
    p_n = sampling.probs_at(at(target_logits, n), vocab, jax.tree.map(lambda a: at(a, n), w))  # [B, V]
    if k == 0:
      residual = p_n
    else:
      n_c = jnp.minimum(n, k - 1)
      rejected = ((n < k) & at(valid, n_c))[:, None]
      if draft_probs is None:
        residual = jnp.where(rejected & (vocab == at(drafts, n_c)[:, None]), 0.0, p_n)
      else:
        residual = jnp.where(rejected, jnp.maximum(p_n - at(draft_probs, n_c).astype(jnp.float32), 0.0), p_n)
      residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
    last = sampling.categorical_from_weights(k_resid, residual)
    last = jnp.where(greedy, at(target, n), last)
    return commit(n, last)

  return lax.cond(jnp.all(greedy), all_greedy, general)


# ----------------------------------------------------------------------------------------------------------------
# Trees
# ----------------------------------------------------------------------------------------------------------------


def verify_tree(
    target_logits: jax.Array,
    tree_tokens: jax.Array,
    parents: jax.Array,
    draft_probs: Optional[jax.Array],
    key: jax.Array,
    params: SamplingParams,
    *,
    max_depth: Optional[int] = None,
    max_children: Optional[int] = None,
    candidates: int = sampling.DEFAULT_CANDIDATES,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Verify a tree of drafted tokens per row in one pass: multi-draft rejection sampling (SpecInfer, Miao et al.
  2024; "multi-step speculative sampling"), exact for greedy and for temperature/top-k/top-p rows.

  The tree, per row b: node 0 is the root, `tree_tokens[b, 0]` the last committed token and `parents[b, 0] = -1`;
  every other node's parent has a lower index. Nodes with token < 0 are padding: never accepted, never tried
  (they do not use up a child slot). D is the depth of the deepest node that may be accepted.

  The walk: from the root, at each depth the current node's children are tried in index order, with p the warped
  target at the node (`target_logits[b, node]`, warped by `params` exactly as in `verify_chain`):
  - sampled children (`draft_probs[b, node]` = q, the distribution they were drawn from, i.i.d.): accept x with
    probability min(1, p(x)/q(x)); after a rejection p <- normalize(max(p - q, 0)) before the next sibling.
  - deterministic children (draft_probs None, q one-hot, as EAGLE's evaluate_posterior): accept x with
    probability p(x); after a rejection p(x) <- 0 and p is renormalized, so a duplicate sibling is never accepted.
  - greedy rows (temperature 0): accept the first child equal to the target argmax.
  An accepted child becomes the current node; if every child is rejected (or there is none) the row ends with a
  draw from the final residual (greedy: the argmax); a row that accepts D nodes ends with a bonus draw from p at
  the last one. A p = 0 token is never accepted (the test is u * q(x) < p(x), u in [0, 1)).

  Args:
    target_logits: [B, N, V] raw target logits; node i's scores the token after node i's path.
    tree_tokens: int32 [B, N]; parents: int32 [B, N] (see above; not checked).
    draft_probs: [B, N, V] the distribution node i's children were drawn from, or None (deterministic children).
    key: PRNG key. params: per-row SamplingParams [B].
    max_depth: static D. None uses N - 1, which fits any tree but costs a step per depth; pass the tree's real
      depth. Nodes deeper than D are never accepted (exact still: the walk just stops there).
    max_children: static number of child slots tried per node. None uses N - 1 (always enough); pass the tree's
      largest branching (e.g. the proposer's top-k). Children past it are never tried (exact still).
    candidates: top-k candidates of the warp's fast path (speed only, see spec_jax.sampling).

  Returns:
    tokens int32 [B, D+1]: row b commits tokens[b, :num_accepted[b] + 1], the accepted path's tokens then the
      correction or bonus token; PAD after.
    num_accepted int32 [B] in [0, D].
    accepted_nodes int32 [B, D+1]: the root 0, then the accepted nodes in path order; -1 after the first
      num_accepted[b] + 1. These are the nodes whose fed tokens' K/V the cache keeps (root included): see
      spec_jax.tree.write_accepted.
  """
  b, n, _ = target_logits.shape
  depth = n - 1 if max_depth is None else int(max_depth)
  slots = n - 1 if max_children is None else int(max_children)
  k_accept, k_resid = jax.random.split(key)
  u = jax.random.uniform(k_accept, (b, max(depth, 0), max(slots, 0)), jnp.float32)  # [0, 1)
  return _verify_tree(target_logits, tree_tokens, parents, draft_probs, u, k_resid, params, max_depth=depth,
                      max_children=slots, candidates=candidates)


def _verify_tree(target_logits, tree_tokens, parents, draft_probs, uniforms, key, params, *, max_depth, max_children,
                 candidates=sampling.DEFAULT_CANDIDATES):
  """verify_tree with its acceptance coins given: uniforms float32 [B, max_depth, max_children] in [0, 1), the coin
  of child slot c at depth d (so tests can force coins, e.g. exactly 0). key draws the final token."""
  b, n, v = target_logits.shape
  d_max, c_max = max_depth, max_children
  if tree_tokens.shape != (b, n) or parents.shape != (b, n):
    raise ValueError(f"tree_tokens {tree_tokens.shape} and parents {parents.shape} must be {(b, n)}")
  if draft_probs is not None and draft_probs.shape != (b, n, v):
    raise ValueError(f"draft_probs has shape {draft_probs.shape}, expected {(b, n, v)}")
  if not 0 <= d_max < max(n, 1) or c_max < 0:
    raise ValueError(f"max_depth {d_max} must be in [0, N - 1 = {n - 1}], max_children {c_max} >= 0")
  if uniforms.shape != (b, d_max, c_max):
    raise ValueError(f"uniforms has shape {uniforms.shape}, expected {(b, d_max, c_max)}")

  tree_tokens = tree_tokens.astype(jnp.int32)
  parents = parents.astype(jnp.int32)
  node_iota = lax.broadcasted_iota(jnp.int32, (b, n), 1)
  # Padding never takes a child slot. (Node 0 is nobody's child: parents < own index.)
  real = (tree_tokens >= 0) & (node_iota > 0)
  safe_tokens = jnp.clip(tree_tokens, 0, v - 1)
  greedy = params.temperature <= 0

  def at(a, idx):  # a[B, N, ...] at the per-row node idx[B]
    return jnp.take_along_axis(a, idx.reshape((b, 1) + (1,) * (a.ndim - 2)), axis=1)[:, 0]

  def child_slots(cur):
    """int32 [B, C]: the children of cur[B] in index order, -1 past the last."""
    is_child = real & (parents == cur[:, None])
    rank = jnp.cumsum(is_child.astype(jnp.int32), axis=1) - 1
    c_iota = lax.broadcasted_iota(jnp.int32, (1, 1, c_max), 2)
    hit = is_child[..., None] & (rank[..., None] == c_iota)  # [B, N, C]
    return jnp.max(jnp.where(hit, node_iota[..., None], -1), axis=1)

  def walk(accept_fn, reached_fn):
    """The walk: a lax.scan over depth with an inner lax.scan over child slots (compiled once, not unrolled).
    accept_fn(state, u, cur, token, trying) -> (accept, state) with u [B] the slot's coins; reached_fn(state, cur,
    moved) is the state at a newly reached node (state None: the root). Returns (n_acc, nodes [B, D+1], cur,
    state)."""
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    state = reached_fn(None, cur, alive)

    def depth_step(carry, u_d):  # u_d [C, B]
      cur, alive, n_acc, state = carry

      def slot_step(inner, xs):
        taken, nxt, state = inner
        child, u = xs
        trying = alive & ~taken & (child >= 0)
        token = jnp.take_along_axis(safe_tokens, jnp.maximum(child, 0)[:, None], axis=1)[:, 0]
        acc, state = accept_fn(state, u, cur, token, trying)
        acc = trying & acc
        return (taken | acc, jnp.where(acc, child, nxt), state), None

      (taken, nxt, state), _ = lax.scan(slot_step, (jnp.zeros((b,), bool), cur, state), (child_slots(cur).T, u_d))
      alive = alive & taken
      state = reached_fn(state, nxt, alive)
      return (nxt, alive, n_acc + alive.astype(jnp.int32), state), jnp.where(alive, nxt, -1)

    u_t = jnp.transpose(uniforms, (1, 2, 0))  # [D, C, B]
    (cur, _, n_acc, state), path = lax.scan(depth_step, (cur, alive, jnp.zeros((b,), jnp.int32), state), u_t)
    return n_acc, jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path.T], axis=1), cur, state

  def commit(n_acc, nodes, last):
    pos = lax.broadcasted_iota(jnp.int32, (b, d_max + 1), 1)
    path_tok = jnp.take_along_axis(safe_tokens, jnp.roll(jnp.maximum(nodes, 0), -1, axis=1), axis=1)
    tokens = jnp.where(pos < n_acc[:, None], path_tok, jnp.where(pos == n_acc[:, None], last[:, None], PAD))
    nodes = jnp.where(pos <= n_acc[:, None], nodes, -1)
    return tokens.astype(jnp.int32), n_acc.astype(jnp.int32), nodes.astype(jnp.int32)

  def all_greedy():
    target = sampling.argmax(target_logits)  # [B, N]
    accept = lambda s, u, cur, token, trying: (token == at(target, cur), s)
    n_acc, nodes, cur, _ = walk(accept, lambda s, cur, moved: ())
    return commit(n_acc, nodes, at(target, cur))

  def general():
    x, t, top_k, top_p = sampling.rows(target_logits, params)
    w = sampling.warp_rows(x, t, top_k, top_p, candidates=candidates, with_lse=True)
    w = jax.tree.map(lambda a: a.reshape(b, n), w)  # fields [B, N]
    vocab = lax.broadcasted_iota(jnp.int32, (b, v), 1)

    def reached(state, cur, moved):
      """At a newly reached node: r = p there (unnormalized residual, mass m) and q of its children."""
      r = sampling.probs_at(at(target_logits, cur), vocab, jax.tree.map(lambda a: at(a, cur), w))  # [B, V]
      m = jnp.sum(r, axis=-1)
      q = None if draft_probs is None else at(draft_probs, cur).astype(jnp.float32)
      if state is None:
        return r, m, q
      keep = lambda new, old: jnp.where(moved.reshape((b,) + (1,) * (new.ndim - 1)), new, old)
      return keep(r, state[0]), keep(m, state[1]), None if q is None else keep(q, state[2])

    def accept(state, u, cur, token, trying):
      r, m, q = state
      r_x = jnp.take_along_axis(r, token[:, None], axis=1)[:, 0]
      q_x = 1.0 if q is None else jnp.take_along_axis(q, token[:, None], axis=1)[:, 0]
      # u < p(x)/q(x) with p = r/m, without dividing: q = 0 < p accepts, p = 0 never accepts (even u = 0).
      acc = jnp.where(greedy, token == at(w.i_last, cur), u * q_x * m < r_x)
      if q is None:
        r_new = jnp.where(vocab == token[:, None], 0.0, r)
      else:
        r_new = jnp.maximum(r - m[:, None] * q, 0.0)  # normalize(max(p - q, 0)) up to the scale m
      m_new = jnp.sum(r_new, axis=-1)
      # Only rejected rows move on; an all-zero residual (p == q up to rounding) keeps r so a draw stays possible.
      upd = trying & ~acc & (m_new > 0)
      return acc, (jnp.where(upd[:, None], r_new, r), jnp.where(upd, m_new, m), q)

    n_acc, nodes, cur, (r, _, _) = walk(accept, reached)
    last = sampling.categorical_from_weights(key, r)
    return commit(n_acc, nodes, jnp.where(greedy, at(w.i_last, cur), last))

  return lax.cond(jnp.all(greedy), all_greedy, general)
