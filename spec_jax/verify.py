"""Exact verification of a chain of drafted tokens (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023).

`verify_chain` is fully vectorized over rows and draft positions: no Python or lax loop over positions. The first
rejection is found with a cumulative product of the per-position accept flags. Against deterministic drafts every
position's target token is drawn (one draw per position and row, keyed by the row's stream at that position:
spec_jax/streams.py) and the drafts are accepted while they equal it, so the output does not depend on the drafts;
against sampled drafts one distribution per row (the residual at the first rejection, or the target at the bonus
position) is sampled from.

Output convention: row b commits `tokens[b, :num_accepted[b] + 1]`, i.e. the accepted drafts followed by one
correction (at the first rejection) or bonus token (all k drafts accepted). Every position after that holds the
pad value 0.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from spec_jax import sampling, streams
from spec_jax.config import SamplingParams

PAD = 0


def _uniforms(keys: jax.Array, shape: tuple) -> jax.Array:
  """float32 [*keys.shape, *shape] in [0, 1): `shape` coins from each key."""
  flat = jax.vmap(lambda k: jax.random.uniform(k, shape, jnp.float32))(keys.reshape(-1))
  return flat.reshape(keys.shape + shape)


def verify_chain(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: Optional[jax.Array],
    key: jax.Array,
    params: SamplingParams,
    *,
    positions: Optional[jax.Array] = None,
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
    key: the rows' random streams (spec_jax/streams.py): typed keys [B] or raw key data [B, 2], one per row; or
      one key, split into B rows.
    positions: int32 [B], the absolute position of the token that target_logits[:, 0] decides (the row's
      length); None: 0. Every draw is keyed by (row, position, purpose).
    params: per-row SamplingParams [B]. Greedy rows (temperature 0) accept while the draft equals the target argmax
      and commit the argmax after that. Sampling rows mix in one batch with greedy ones:
      - deterministic drafts: the target's own token x_i at every position is drawn from p_i with the row's TOKEN
        key of that position; draft i is accepted iff it equals x_i (probability p_i(draft), as rejection
        sampling with a one-hot q), and the first mismatch commits x_i. So the committed tokens are the same
        whatever was drafted: plain decoding's tokens with the same keys.
      - sampled drafts: draft x_i is accepted with probability min(1, p_i(x_i)/q_i(x_i)) (the ACCEPT coin of its
        position) and, at the first rejection, the token is drawn from normalize(max(p_i - q_i, 0)) (falling back
        to p_i if that is all zero) with the RESIDUAL key; the bonus token, or one after a missing draft, is
        p's own TOKEN draw.
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

  keys = streams.rows(key, b)
  positions = jnp.zeros((b,), jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
  pos_abs = positions[:, None] + pos  # [B, k+1]: the position each logits row decides

  def general():
    # The warped target at every position, as per-position statistics: nothing of size V is materialized here.
    x, t, top_k, top_p = sampling.rows(target_logits, params)
    w = sampling.warp_rows(x, t, top_k, top_p, candidates=candidates, with_lse=True)
    if draft_probs is None or k == 0:
      # The target's own draw at every position (greedy rows: the argmax); the drafts only decide how many of
      # them one step commits.
      own = sampling.sample_rows(streams.at(keys, pos_abs, streams.TOKEN).reshape(-1), x, w).reshape(b, k1)
      target = jnp.where(greedy[:, None], w.i_last.reshape(b, k1), own)
      n = first_rejection(valid & (drafts == target[:, :k]))
      return commit(n, at(target, n))
    w = jax.tree.map(lambda a: a.reshape(b, k1), w)  # fields [B, k+1]
    target = w.i_last  # the argmax, for greedy rows

    # p_i(x_i) at the drafts.
    # (Gathered from the full logits: slicing [:, :k] first would copy B * k * V floats.)
    d_ext = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    x_d = jnp.take_along_axis(target_logits, d_ext[..., None], axis=-1)[:, :k, 0]  # [B, k]
    w_d = jax.tree.map(lambda a: a[:, :k].reshape(-1), w)
    p_x = sampling.probs_at(x_d.reshape(-1), drafts.reshape(-1), w_d).reshape(b, k)
    q_x = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0].astype(jnp.float32)
    u = _uniforms(streams.at(keys, pos_abs[:, :k], streams.ACCEPT), ())  # [B, k] in [0, 1)
    # u < p/q without the division: q = 0 < p accepts, p = 0 rejects.
    sample_accept = u * q_x < p_x
    n = first_rejection(valid & jnp.where(greedy[:, None], drafts == target[:, :k], sample_accept))

    # The token at position n: from the residual max(p - q, 0) after a rejected draft, p's own draw for the
    # bonus token (n == k) or after a missing draft.
    x_n, w_n = at(target_logits, n), jax.tree.map(lambda a: at(a, n), w)
    own = sampling.sample_rows(streams.at(keys, positions + n, streams.TOKEN), x_n, w_n)
    n_c = jnp.minimum(n, k - 1)
    rejected = (n < k) & at(valid, n_c)
    vocab = lax.broadcasted_iota(jnp.int32, (b, v), 1)
    p_n = sampling.probs_at(x_n, vocab, w_n)  # [B, V]
    residual = jnp.maximum(p_n - at(draft_probs, n_c).astype(jnp.float32), 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
    resid = sampling.categorical_from_weights(streams.at(keys, positions + n, streams.RESIDUAL), residual)
    last = jnp.where(greedy, at(target, n), jnp.where(rejected, resid, own))
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
    positions: Optional[jax.Array] = None,
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
  - deterministic children (draft_probs None: top-k candidates, not samples): the target's own token at the
    node is drawn from p with the row's TOKEN key of its position, and the first child equal to it is accepted.
    A child x is so accepted with probability p(x), as in rejection sampling with a one-hot q (EAGLE's
    evaluate_posterior), duplicates are never accepted twice, and the committed tokens are the ones plain decoding
    draws with the same keys, whatever the tree.
  - sampled children (`draft_probs[b, node]` = q, the distribution they were drawn from, i.i.d.): accept x with
    probability min(1, p(x)/q(x)) (the ACCEPT coins of the node's position); after a rejection
    p <- normalize(max(p - q, 0)) before the next sibling; the final residual is drawn with the RESIDUAL key.
  - greedy rows (temperature 0): accept the first child equal to the target argmax.
  An accepted child becomes the current node; if every child is rejected (or there is none) the row ends with the
  node's own draw (sampled children: a draw from the final residual; greedy: the argmax); a row that accepts D
  nodes ends with the bonus token at the last one. A p = 0 token is never accepted.

  Args:
    target_logits: [B, N, V] raw target logits; node i's scores the token after node i's path.
    tree_tokens: int32 [B, N]; parents: int32 [B, N] (see above; not checked).
    draft_probs: [B, N, V] the distribution node i's children were drawn from, or None (deterministic children).
    key: the rows' streams (typed keys [B], raw key data [B, 2], or one key split into B rows); positions int32
      [B]: the absolute position of the token the root's logits decide (None: 0). params: per-row SamplingParams.
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
  keys = streams.rows(key, b)
  positions = jnp.zeros((b,), jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
  if draft_probs is None:  # no coins: the walk follows the target's own draws
    u = jnp.zeros((b, max(depth, 0), max(slots, 0)), jnp.float32)
  else:
    u = _uniforms(streams.at(keys, positions[:, None] + jnp.arange(max(depth, 0)), streams.ACCEPT), (max(slots, 0),))
  return _verify_tree(target_logits, tree_tokens, parents, draft_probs, u, keys, params, positions=positions,
                      max_depth=depth, max_children=slots, candidates=candidates)


def _verify_tree(target_logits, tree_tokens, parents, draft_probs, uniforms, key, params, *, max_depth, max_children,
                 positions=None, candidates=sampling.DEFAULT_CANDIDATES):
  """verify_tree with the acceptance coins of sampled children given: uniforms float32 [B, max_depth,
  max_children] in [0, 1), the coin of child slot c at depth d (so tests can force coins, e.g. exactly 0; unused
  for deterministic children). key: the rows' streams, as verify_tree's."""
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

  keys = streams.rows(key, b)
  positions = jnp.zeros((b,), jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)

  def general():
    x, t, top_k, top_p = sampling.rows(target_logits, params)
    w = sampling.warp_rows(x, t, top_k, top_p, candidates=candidates, with_lse=True)
    w = jax.tree.map(lambda a: a.reshape(b, n), w)  # fields [B, N]
    w_at = lambda cur: jax.tree.map(lambda a: at(a, cur), w)
    if draft_probs is None:
      def own(cur, d):
        """The target's own token at node cur [B] of depth d (its position's TOKEN draw; greedy: the argmax)."""
        x_cur = sampling.sample_rows(streams.at(keys, positions + d, streams.TOKEN), at(target_logits, cur), w_at(cur))
        return jnp.where(greedy, at(w.i_last, cur), x_cur)

      def reached_own(state, cur, moved):  # state: (depth, the own token at the current node)
        if state is None:
          return jnp.zeros((), jnp.int32), own(cur, 0)
        d = state[0] + 1
        return d, jnp.where(moved, own(cur, d), state[1])

      n_acc, nodes, _, (_, last) = walk(lambda s, u, cur, token, trying: (token == s[1], s), reached_own)
      return commit(n_acc, nodes, last)
    vocab = lax.broadcasted_iota(jnp.int32, (b, v), 1)

    def reached(state, cur, moved):
      """At a newly reached node: r = p there (unnormalized residual, mass m) and q of its children."""
      r = sampling.probs_at(at(target_logits, cur), vocab, w_at(cur))  # [B, V]
      m = jnp.sum(r, axis=-1)
      q = at(draft_probs, cur).astype(jnp.float32)
      if state is None:
        return r, m, q
      keep = lambda new, old: jnp.where(moved.reshape((b,) + (1,) * (new.ndim - 1)), new, old)
      return keep(r, state[0]), keep(m, state[1]), keep(q, state[2])

    def accept(state, u, cur, token, trying):
      r, m, q = state
      r_x = jnp.take_along_axis(r, token[:, None], axis=1)[:, 0]
      q_x = jnp.take_along_axis(q, token[:, None], axis=1)[:, 0]
      # u < p(x)/q(x) with p = r/m, without dividing: q = 0 < p accepts, p = 0 never accepts (even u = 0).
      acc = jnp.where(greedy, token == at(w.i_last, cur), u * q_x * m < r_x)
      r_new = jnp.maximum(r - m[:, None] * q, 0.0)  # normalize(max(p - q, 0)) up to the scale m
      m_new = jnp.sum(r_new, axis=-1)
      # Only rejected rows move on; an all-zero residual (p == q up to rounding) keeps r so a draw stays possible.
      upd = trying & ~acc & (m_new > 0)
      return acc, (jnp.where(upd[:, None], r_new, r), jnp.where(upd, m_new, m), q)

    n_acc, nodes, cur, (r, _, _) = walk(accept, reached)
    last = sampling.categorical_from_weights(streams.at(keys, positions + n_acc, streams.RESIDUAL), r)
    return commit(n_acc, nodes, jnp.where(greedy, at(w.i_last, cur), last))

  return lax.cond(jnp.all(greedy), all_greedy, general)
