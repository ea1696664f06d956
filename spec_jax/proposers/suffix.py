"""Suffix decoding (SuffixDecoding, vLLM's method "suffix"): draft from the row's own context and from a shared,
device-resident history of what the server has already written, as tokens commit, with no model and no host
round trip.

The history is one ring buffer per slot, hist int32[B, H] (NO_TOKEN = empty or a separator), with a tenant tag per
position, owner int32[B, H], rather than one ring per tenant: the rows of one tenant decode together, and rings
they appended to step by step would interleave their outputs a few tokens at a time, so no continuation longer
than one step's chunk would survive. A slot's ring holds the outputs of the requests that went through it, each
whole, after a separator; a row drafts from every slot's ring, its own included, masked to its own tenant's
positions (or to all of them with sharing="global"). Eviction is per slot, oldest first (slots are reused about
round robin, so it is about the oldest overall).

Each step a row takes the longest suffix match (up to max_depth tokens, latest occurrence first) of its trailing
tokens in (a) its own committed context, as n-gram does, and (b) the history; the longer wins, the own context on
ties. Depth follows the match as SuffixDecoding sets it: min(k, floor(spec_factor * match length)) tokens, the rest
NO_TOKEN. A match of one token drafts one, so a chance match risks little; a long one drafts all k, since a long
match is a repeated span that tends to go on.

With a tree (eagle_topk = W > 1), a row drafts the W latest different continuations of its longest match, merged
into one token tree (spec_jax/proposers/suffix_tree.py): where the history holds several continuations of the same
context, one of them is usually the target's. The per-row counters (drafted_hist, accepted_hist) count draft
tokens that came from the history and were accepted.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.proposers import suffix_tree
from spec_jax.proposers.base import Draft, TreeDraft
from spec_jax.proposers.ngram_lookup import NO_TOKEN, longest_match
from spec_jax.rows import write_row

NO_QUERY = -2  # a query position before the row's start: equals no token, NO_TOKEN included
SHARING = ("tenant", "global")


@struct.dataclass
class SuffixState:
  """hist, owner int32[B, H]: slot b's ring of committed tokens and each one's tenant (-1: none); pos int32[B]:
  where slot b writes next; tenant int32[B]: the row's tenant; from_hist bool[B], n_draft int32[B]: this step's
  draft came from the history, and its length; drafted_hist, accepted_hist int32[B]: counters since insert.
  tree_tok, tree_par int32[B, N], tree_hist bool[B, N]: this step's tree and which nodes came from the history
  (N = 1 and unused for chains)."""

  hist: jax.Array
  owner: jax.Array
  pos: jax.Array
  tenant: jax.Array
  from_hist: jax.Array
  n_draft: jax.Array
  drafted_hist: jax.Array
  accepted_hist: jax.Array
  tree_tok: jax.Array
  tree_par: jax.Array
  tree_hist: jax.Array

  def accepted_from_history(self) -> jax.Array:
    """The proposer protocol's counter (spec_jax/proposers/base.py): accepted drafts taken from the history."""
    return self.accepted_hist


@dataclasses.dataclass(frozen=True)
class SuffixProposer:
  k: int = 4
  history: int = 2048  # tokens per slot's ring
  max_depth: int = 24  # the longest suffix matched (vLLM's suffix_decoding_max_tree_depth)
  spec_factor: float = 1.0  # drafted tokens per matched token (vLLM's suffix_decoding_max_spec_factor)
  sharing: str = "tenant"
  tree: Any = None  # None: chains; a DynamicTree (registry): topk = branches, depth = k, nodes (root included)
  name: str = "suffix"
  needs_prompt_hidden = False

  def __post_init__(self):
    if self.k < 1 or self.history < 2 or self.max_depth < 1 or self.spec_factor <= 0:
      raise ValueError(f"suffix needs k >= 1, history >= 2, max_depth >= 1 and spec_factor > 0, got k={self.k}, "
                       f"history={self.history}, max_depth={self.max_depth}, spec_factor={self.spec_factor}")
    if self.sharing not in SHARING:
      raise ValueError(f"suffix sharing must be one of {SHARING}, got {self.sharing!r}")
    if self.tree is not None and (self.tree.depth != self.k or self.tree.nodes > 1 + self.tree.topk * self.k):
      raise ValueError(f"a suffix tree is {self.k} deep (num_speculative_tokens) with at most 1 + eagle_topk * k = "
                       f"{1 + self.tree.topk * self.k} nodes, got depth {self.tree.depth}, {self.tree.nodes} nodes")

  @property
  def tree_nodes(self) -> int:
    return 1 if self.tree is None else self.tree.nodes

  def init(self, params, prefill, capacity):
    """A fresh history per row, starting with the row's first token (sampled at prefill: no step commits it)."""
    R = prefill.lengths.shape[0]
    first = jnp.take_along_axis(prefill.tokens, (prefill.lengths - 1)[:, None], axis=1)[:, 0]
    hist = jnp.full((R, self.history), NO_TOKEN, jnp.int32).at[:, 0].set(first)
    owner = jnp.full((R, self.history), -1, jnp.int32).at[:, 0].set(0)
    z = jnp.zeros((R,), jnp.int32)
    zn = jnp.zeros((R, self.tree_nodes), jnp.int32)
    return SuffixState(hist=hist, owner=owner, pos=z + 1, tenant=z, from_hist=jnp.zeros((R,), bool), n_draft=z,
                       drafted_hist=z, accepted_hist=z, tree_tok=zn - 1, tree_par=zn, tree_hist=zn > 0)

  def for_request(self, row_state: SuffixState, request) -> SuffixState:
    """A 1-row state (from init) for `request` (a slots.Request): its tenant tags what it writes and bounds what it
    drafts from (slots.insert calls it before `insert`)."""
    t = jnp.reshape(jnp.asarray(request.tenant, jnp.int32), (1,))
    return row_state.replace(tenant=t)

  def insert(self, state: SuffixState, slot, row_state: SuffixState) -> SuffixState:
    """The row's own fields; the slot's ring keeps its past and gets a separator, then the new first token."""
    put = functools.partial(write_row, slot=slot)
    H = self.history
    at = state.pos[slot]
    cols = jnp.stack([at % H, (at + 1) % H])
    hist = state.hist.at[slot, cols].set(jnp.stack([jnp.int32(NO_TOKEN), row_state.hist[0, 0]]))
    owner = state.owner.at[slot, cols].set(jnp.stack([jnp.int32(-1), row_state.tenant[0]]))
    return state.replace(hist=hist, owner=owner, pos=state.pos.at[slot].set(at + 2),
                         tenant=put(state.tenant, row_state.tenant), from_hist=put(state.from_hist, row_state.from_hist),
                         n_draft=put(state.n_draft, row_state.n_draft),
                         drafted_hist=put(state.drafted_hist, row_state.drafted_hist),
                         accepted_hist=put(state.accepted_hist, row_state.accepted_hist),
                         tree_tok=put(state.tree_tok, row_state.tree_tok),
                         tree_par=put(state.tree_par, row_state.tree_par),
                         tree_hist=put(state.tree_hist, row_state.tree_hist))

  def keep_history(self, prev: SuffixState, fresh: SuffixState) -> SuffixState:
    """A fresh batch's state (from init) whose slots keep `prev`'s rings, as `insert` keeps a slot's past: a
    batch job (serve.jobs.runner) drafts from what its earlier batches wrote, as the server's long-lived slots do. Slot
    b takes prev's slot b (a batch with fewer slots keeps the first ones only)."""
    return _keep_rings(prev, fresh, self.history)

  def forget_tenant(self, state, tenant):
    """The DecodeState `state` without `tenant`'s history (the server reuses its id, serve/engine/tenants.py)."""
    return state if self.sharing == "global" else forget_tenant(state, tenant)

  def propose(self, params, state: SuffixState, ctx, k, key):
    tokens = ctx.tokens.astype(jnp.int32)
    B, S = tokens.shape
    H = self.history
    n_max = self.max_depth
    L = ctx.lengths.astype(jnp.int32)[:, None]
    back = L - 1 - jnp.arange(n_max, dtype=jnp.int32)[None, :]
    suf = jnp.where(back >= 0, jnp.take_along_axis(tokens, jnp.clip(back, 0, S - 1), axis=1), NO_QUERY)
    # (a) the row's own context
    j_own = jax.lax.broadcasted_iota(jnp.int32, (B, S), 1)
    end_own, n_own = longest_match(tokens, suf, j_own <= L - 2, ngram_min=1, ngram_max=n_max)
    # (b) every slot's ring, oldest first, side by side: [1, B * H]
    order = (state.pos[:, None] + jnp.arange(H, dtype=jnp.int32)[None, :]) % H
    corpus = jnp.take_along_axis(state.hist, order, axis=1).reshape(1, B * H)
    owner = jnp.take_along_axis(state.owner, order, axis=1).reshape(1, B * H)
    c = jnp.arange(B * H, dtype=jnp.int32)[None, :]
    nxt = jnp.pad(corpus[:, 1:], ((0, 0), (0, 1)), constant_values=NO_TOKEN)
    end_ok = (c % H <= H - 2) & (nxt >= 0)  # a continuation follows, in the same ring
    if self.sharing == "tenant":
      end_ok = end_ok & (owner == state.tenant[:, None])
    end_hist, n_hist = longest_match(corpus, suf, end_ok, ngram_min=1, ngram_max=n_max)
    use_hist = n_hist > n_own
    n = jnp.maximum(n_own, n_hist)
    depth = jnp.minimum(k, jnp.floor(self.spec_factor * n).astype(jnp.int32))
    t = jnp.arange(k, dtype=jnp.int32)[None, :]
    p_own = end_own[:, None] + 1 + t
    own = jnp.where(p_own < L, jnp.take_along_axis(tokens, jnp.clip(p_own, 0, S - 1), axis=1), NO_TOKEN)
    p_hist = end_hist[:, None] + 1 + t
    same_ring = p_hist // H == jnp.maximum(end_hist, 0)[:, None] // H
    from_ring = jnp.where(same_ring, corpus[0, jnp.clip(p_hist, 0, B * H - 1)], NO_TOKEN)
    from_ring = jnp.where(jnp.cumprod(from_ring >= 0, axis=1) > 0, from_ring, NO_TOKEN)  # stop at a separator
    draft = jnp.where(use_hist[:, None], from_ring, own)
    draft = jnp.where((t < depth[:, None]) & (n[:, None] > 0), draft, NO_TOKEN)
    n_draft = jnp.sum(draft >= 0, axis=1).astype(jnp.int32)
    return Draft(tokens=draft), state.replace(from_hist=use_hist & (n_draft > 0), n_draft=n_draft)

  def propose_tree(self, params, state: SuffixState, ctx, key):
    """The W latest different continuations of the longest match, own context and history in one corpus per row
    (spec_jax/proposers/suffix_tree.py), merged into a tree of tree.nodes nodes."""
    tokens = ctx.tokens.astype(jnp.int32)
    B, S = tokens.shape
    H, k = self.history, self.k
    L = ctx.lengths.astype(jnp.int32)[:, None]
    back = L - 1 - jnp.arange(self.max_depth, dtype=jnp.int32)[None, :]
    suf = jnp.where(back >= 0, jnp.take_along_axis(tokens, jnp.clip(back, 0, S - 1), axis=1), NO_QUERY)
    order = (state.pos[:, None] + jnp.arange(H, dtype=jnp.int32)[None, :]) % H
    ring = jnp.pad(jnp.take_along_axis(state.hist, order, axis=1), ((0, 0), (0, 1)), constant_values=NO_TOKEN)
    owner = jnp.pad(jnp.take_along_axis(state.owner, order, axis=1), ((0, 0), (0, 1)), constant_values=-1)
    ring, owner = ring.reshape(1, -1), owner.reshape(1, -1)
    own = jnp.where(jnp.arange(S)[None, :] < L, tokens, NO_TOKEN)
    corpus = jnp.concatenate([jnp.broadcast_to(ring, (B, ring.shape[1])), own], axis=1)  # [B, B(H+1) + S]
    if self.sharing == "tenant":
      allowed = jnp.concatenate([owner == state.tenant[:, None], jnp.ones((B, S), bool)], axis=1)
    else:
      allowed = jnp.ones(corpus.shape, bool)
    nxt = jnp.pad(corpus[:, 1:], ((0, 0), (0, 1)), constant_values=NO_TOKEN)
    n = jnp.where(allowed & (nxt >= 0), suffix_tree.match_lengths(corpus, suf), 0)
    best = jnp.max(n, axis=1)
    depth = jnp.minimum(k, jnp.floor(self.spec_factor * best).astype(jnp.int32))
    conts = suffix_tree.continuations(corpus, k, depth)
    in_hist = jnp.arange(corpus.shape[1]) < ring.shape[1]
    branches, branch_hist = suffix_tree.pick_branches(conts, (n == best[:, None]) & (best[:, None] > 0),
                                                      self.tree.topk, in_hist)
    tok, par, hist = suffix_tree.merge(branches, branch_hist, self.tree.nodes)
    return TreeDraft(tokens=tok, parents=par), state.replace(tree_tok=tok, tree_par=par, tree_hist=hist)

  def update(self, params, state: SuffixState, result) -> SuffixState:
    """Append each row's committed tokens to its slot's ring; count the history's drafted and accepted tokens."""
    B, T = result.tokens.shape
    H = self.history
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    emitted = result.emitted.astype(jnp.int32)
    cols = jnp.where(t < emitted[:, None], (state.pos[:, None] + t) % H, H)  # H: dropped
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    hist = state.hist.at[rows, cols].set(result.tokens.astype(jnp.int32), mode="drop")
    owner = state.owner.at[rows, cols].set(jnp.broadcast_to(state.tenant[:, None], (B, T)), mode="drop")
    live = state.from_hist & (emitted > 0)
    accepted = jnp.minimum(result.num_accepted, emitted)  # a stop token or the limit can cut accepted drafts
    drafted = jnp.where(live, state.n_draft, 0)
    took = jnp.where(live, accepted, 0)
    if self.tree is not None:  # a tree step's nodes (all False after a chain or k = 0 step)
      ran = emitted > 0
      drafted += jnp.where(ran, jnp.sum(state.tree_hist, axis=1), 0).astype(jnp.int32)
      took += jnp.where(ran, suffix_tree.accepted_path_hist(state.tree_tok, state.tree_par, state.tree_hist,
                                                            result.tokens, accepted), 0).astype(jnp.int32)
    return state.replace(hist=hist, owner=owner, pos=state.pos + emitted,
                         drafted_hist=state.drafted_hist + drafted, accepted_hist=state.accepted_hist + took,
                         from_hist=jnp.zeros_like(state.from_hist), n_draft=jnp.zeros_like(state.n_draft),
                         tree_hist=jnp.zeros_like(state.tree_hist))


@functools.partial(jax.jit, donate_argnames=("state",))
def forget_tenant(state, tenant):
  """A DecodeState whose suffix history no longer holds `tenant`'s tokens (before its id goes to another tenant)."""
  p = state.pstate
  gone = p.owner == tenant
  return state.replace(pstate=p.replace(hist=jnp.where(gone, NO_TOKEN, p.hist), owner=jnp.where(gone, -1, p.owner)))


@functools.partial(jax.jit, static_argnums=2)
def _keep_rings(prev: SuffixState, fresh: SuffixState, H: int) -> SuffixState:
  """keep_history: for the first min(B_prev, B) slots, prev's ring, then a separator and the fresh row's first
  token (fresh.hist[:, 0]); the rest of the slots stay fresh."""
  n = min(prev.hist.shape[0], fresh.hist.shape[0])
  at = prev.pos[:n]
  rows = jnp.arange(n)[:, None]
  cols = jnp.stack([at % H, (at + 1) % H], axis=1)
  sep = jnp.full((n,), NO_TOKEN, jnp.int32)
  hist = prev.hist[:n].at[rows, cols].set(jnp.stack([sep, fresh.hist[:n, 0]], axis=1))
  owner = prev.owner[:n].at[rows, cols].set(jnp.stack([jnp.full((n,), -1, jnp.int32), fresh.tenant[:n]], axis=1))
  return fresh.replace(hist=fresh.hist.at[:n].set(hist), owner=fresh.owner.at[:n].set(owner),
                       pos=fresh.pos.at[:n].set(at + 2))
