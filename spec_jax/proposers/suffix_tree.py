"""The suffix proposer's token trees: the top few different continuations of the longest suffix match, where the
row's context and the shared history hold several, merged into one tree (SuffixDecoding's tree speculation).

One corpus per row, [B, C]: every slot's history ring (oldest first, each followed by a NO_TOKEN column, so no
match or continuation runs from one ring into the next), then the row's own committed tokens (NO_TOKEN from its
length on). A candidate is a position j where a suffix match ends and a continuation follows; its match length is
how many of the row's trailing tokens (up to max_depth) end there. Only candidates of the longest length found
compete, latest first: the own context comes last in the corpus, so it wins ties, as in the chain. Branch 0 is
then exactly the chain's draft; branch w is the latest candidate whose continuation (to the match's depth, cut at
the first NO_TOKEN) differs from branches 0..w-1. Static shapes throughout: W rounds of argmax over [B, C].

The branches [B, W, k] become a tree by merging shared prefixes: node (w, d) is kept only when no earlier branch
has the same first d + 1 tokens, and its parent is the node of the first branch sharing its first d tokens.
Siblings therefore differ, which the tree verifier needs (a duplicate sibling would be tried twice), and every
accepted path is one branch's prefix. Kept nodes are numbered depth first by depth, then branch, so parents come
before children, and a tree of N nodes keeps the first N - 1 of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax.proposers.ngram_lookup import NO_TOKEN


def match_lengths(corpus, suf):
  """int32[B, C]: how many of each row's trailing tokens end at corpus position j (suf[:, r] the r-th from the
  end; a value no corpus token has where the row is shorter), over the full width of `suf`."""
  C = corpus.shape[1]
  match = jnp.ones((suf.shape[0], C), bool)
  n = jnp.zeros((suf.shape[0], C), jnp.int32)
  for r in range(min(suf.shape[1], C)):
    shifted = jnp.pad(corpus[:, :C - r], ((0, 0), (r, 0)), constant_values=NO_TOKEN)
    match = match & (shifted == suf[:, r:r + 1])  # a running AND: lengths only grow while every token matched
    n = n + match
  return n


def continuations(corpus, k: int, depth):
  """[k] x int32[B, C]: the t-th token after each position, NO_TOKEN from the first NO_TOKEN on or at t >= the
  row's depth."""
  out, alive = [], None
  for t in range(k):
    tok = jnp.pad(corpus[:, t + 1:], ((0, 0), (0, t + 1)), constant_values=NO_TOKEN)
    ok = (tok >= 0) & (t < depth[:, None])
    alive = ok if alive is None else alive & ok
    out.append(jnp.where(alive, tok, NO_TOKEN))
  return out


def pick_branches(conts, candidate, width: int, from_hist):
  """The `width` latest candidates with pairwise different continuations -> (branches int32[B, W, k], NO_TOKEN
  where a row has fewer; branch_hist bool[B, W]: the branch came from the history). conts from `continuations`;
  candidate bool[B, C]; from_hist bool[C]: the position lies in the history part of the corpus."""
  B, C = candidate.shape
  j = jax.lax.broadcasted_iota(jnp.int32, (B, C), 1)
  branches, hist = [], []
  for _ in range(width):
    end = jnp.max(jnp.where(candidate, j, -1), axis=1)  # [B]
    has = end >= 0
    at = jnp.maximum(end, 0)[:, None]
    chain = [jnp.where(has, jnp.take_along_axis(c, at, axis=1)[:, 0], NO_TOKEN) for c in conts]
    same = candidate
    for c, tok in zip(conts, chain):
      same = same & (c == tok[:, None])
    candidate = candidate & ~same  # this continuation is taken; its other occurrences add nothing
    branches.append(jnp.stack(chain, axis=1))
    hist.append(has & from_hist[jnp.maximum(end, 0)])
  return jnp.stack(branches, axis=1), jnp.stack(hist, axis=1)


def merge(branches, branch_hist, nodes: int):
  """Branches [B, W, k] -> (tokens int32[B, N], parents int32[B, N], hist bool[B, N]): node 0 the root (its token
  left 0 for the loop), padding nodes token NO_TOKEN under the root."""
  B, W, k = branches.shape
  valid = branches >= 0
  eq = (branches[:, :, None, :] == branches[:, None, :, :]) & valid[:, :, None, :]  # [B, W, W', k]
  same_prefix = jnp.cumprod(eq, axis=3) > 0  # branch w and w' agree on tokens 0..d
  first = jnp.argmax(same_prefix, axis=2).astype(jnp.int32)  # [B, W, k]: the first branch with that prefix
  w_idx = jnp.arange(W, dtype=jnp.int32)[None, :, None]
  d_idx = jnp.arange(k, dtype=jnp.int32)[None, None, :]
  keep = valid & (first == w_idx)
  # depth-major numbering before compaction: node (w, d) is 1 + d * W + w
  parent_old = jnp.where(d_idx == 0, 0, 1 + (d_idx - 1) * W + jnp.roll(first, 1, axis=2))
  # compaction: kept nodes in depth-major order get 1, 2, ...; order the [B, W, k] grid depth-major first
  keep_dm = jnp.swapaxes(keep, 1, 2).reshape(B, W * k)
  new_dm = jnp.cumsum(keep_dm, axis=1).astype(jnp.int32)  # the new index of each kept node
  new_of_old = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.where(keep_dm, new_dm, 0)], axis=1)
  dest = jnp.where(keep_dm & (new_dm < nodes), new_dm, nodes)  # nodes: dropped
  flat = lambda x: jnp.swapaxes(jnp.broadcast_to(x, (B, W, k)), 1, 2).reshape(B, W * k)
  parent_new = jnp.take_along_axis(new_of_old, flat(parent_old), axis=1)
  rows = jnp.arange(B)[:, None]
  tokens = jnp.full((B, nodes), NO_TOKEN, jnp.int32).at[:, 0].set(0)
  tokens = tokens.at[rows, dest].set(flat(branches), mode="drop")
  parents = jnp.zeros((B, nodes), jnp.int32).at[:, 0].set(-1)
  parents = parents.at[rows, dest].set(parent_new, mode="drop")
  hist = jnp.zeros((B, nodes), bool).at[rows, dest].set(flat(branch_hist[:, :, None]), mode="drop")
  return tokens, parents, hist


def accepted_path_hist(tokens, parents, hist, out, accepted):
  """int32[B]: how many of the accepted nodes came from the history. The path is found from the committed
  tokens: siblings differ (merge), so out[:, d] names the child taken at depth d + 1."""
  B = tokens.shape[0]
  cur = jnp.zeros((B,), jnp.int32)
  n = jnp.zeros((B,), jnp.int32)
  for d in range(out.shape[1] - 1):
    hit = (parents == cur[:, None]) & (tokens == out[:, d:d + 1]) & (tokens >= 0)
    hit = hit.at[:, 0].set(False)
    nxt = jnp.argmax(hit, axis=1).astype(jnp.int32)
    ok = hit.any(axis=1) & (d < accepted)
    n = n + (ok & jnp.take_along_axis(hist, nxt[:, None], axis=1)[:, 0])
    cur = jnp.where(ok, nxt, cur)
  return n
