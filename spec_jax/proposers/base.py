"""The proposer protocol. Proposers are frozen dataclasses (static under jit); their state is a pytree whose
leaves carry the batch (slot) axis, so one row can be replaced while the others keep decoding.

  needs_prompt_hidden: bool                       whether init() reads the prompt's target hidden states
  feature_layers: tuple (optional, default ())    the target layers whose outputs are the proposer's features
                                                  (EAGLE-3); () = the final-normed hidden state
  tree: None | tree shape                         None: chains (propose); else propose_tree drafts token trees of
                                                  tree.nodes nodes, tree.depth deep, at most tree.max_children
                                                  children per node (k = tree.depth)
  init(params, prefill: PrefillOut, capacity)     -> state     the rows of `prefill`, after the target's prefill
  propose(params, state, ctx, k, key)             -> (Draft, state)
  propose_tree(params, state, ctx, key)           -> (TreeDraft, state)   (tree proposers only)
  update(params, state, result: VerifyResult)     -> state     after verify/commit (every step, k = 0 included)
  insert(state, slot, row_state)                  -> state     write a 1-row state (from init) into row `slot`
  for_request(row_state, request) (optional)      -> row_state made for the slots.Request it serves, before
                                                  insert: the proposer reads the request fields it keeps per row
                                                  (suffix: its tenant); `row_state_for` calls it
  forget_tenant(decode_state, tenant) (optional)  -> decode_state  without that tenant's shared history (suffix;
                                                  `without_tenant` calls it)
A proposer's state may also have accepted_from_history() (optional) -> int32[B]: of the accepted drafts since
insert, those taken from other requests' text (suffix); the snapshot reports it (`accepted_from_history`).

`params` is the proposer's own weights (an empty dict for model-free proposers). A draft token < 0 means
"nothing proposed here": the verifier never accepts it nor anything after it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional, Protocol

import jax
from flax import struct

from spec_jax.cache import KVCache


@struct.dataclass
class Draft:
  """tokens int32[B, k] (< 0 where there is no proposal); probs float32[B, k, V] the drafter's sampling
  distribution, None when the drafts are deterministic."""

  tokens: jax.Array
  probs: Optional[jax.Array] = None


@struct.dataclass
class TreeDraft:
  """A token tree per row (spec_jax/tree.py): tokens int32[B, N] (node 0, the root, is filled by the loop with the
  last committed token; < 0 marks padding nodes), parents int32[B, N] (parents[:, 0] = -1, parents[b, i] < i).
  Children are deterministic candidates (top-k, not sampled), so the verifier needs no draft distribution."""

  tokens: jax.Array
  parents: jax.Array


@struct.dataclass
class PrefillOut:
  """What a proposer starts from, after the target's prefill and the first sampled token.

  prompt_tokens int32[B, P]: the right-padded prompts (P a multiple of `chunk`, or equal to it).
  tokens int32[B, S]: the token buffer; row b holds its prompt and the first new token in tokens[b, :lengths[b]].
  lengths int32[B]: prompt_lens + 1.
  prompt_lens int32[B].
  prompt_hidden [B, P, F] | None: the proposer's target features (`target_features`: the final-normed hidden
    states, F = D, or its feature layers side by side) of the padded prompt (P = bucket), only for proposers with
    needs_prompt_hidden.
  last_hidden [B, D]: the target's hidden state at the last prompt token (it predicted the first new token).
  chunk int (static): the prefill chunk the prompt was padded for.
  pages int32[B, P']: the target cache's page table; num_pages, block_size (static): its pool. A proposer with a
    KV cache of its own makes it with `cache_for`: the same table over a pool of as many pages, so a page id
    holds its tokens of every cache (spec_jax/cache.py).
  offsets int32[B] | None: positions before prompt_tokens' first column, whose K/V (the proposer's too) the pages
    already hold (a prefix-cache hit); prompt_tokens are then the positions offsets .. prompt_lens - 1, and
    prompt_hidden holds those positions only.
  proposer_cache: the decode state's own proposer cache (a slot insert): its pool is what `cache_for` returns, so
    the proposer prefills straight into the request's pages.
  """

  prompt_tokens: jax.Array
  tokens: jax.Array
  lengths: jax.Array
  prompt_lens: jax.Array
  prompt_hidden: Optional[jax.Array]
  last_hidden: jax.Array
  pages: Optional[jax.Array] = None
  chunk: int = struct.field(pytree_node=False, default=512)
  num_pages: int = struct.field(pytree_node=False, default=0)
  block_size: int = struct.field(pytree_node=False, default=16)
  offsets: Optional[jax.Array] = None
  proposer_cache: Optional[object] = None
  kv_dtype: str = struct.field(pytree_node=False, default="auto")  # the target cache's (--kv_cache_dtype)

  def cache_for(self, config, dtype, capacity: int):
    """An empty KV cache for a proposer's own model, paged like the target's (contiguous rows of `capacity`
    slots when no table is given) and stored like it (one --kv_cache_dtype covers every cache)."""
    if self.proposer_cache is not None:
      return self.proposer_cache.replace(lengths=self.offsets, pages=self.pages)
    if self.pages is None:
      return KVCache.init(config, self.tokens.shape[0], capacity, dtype, kv_dtype=self.kv_dtype)
    B, pps = self.pages.shape
    return KVCache.init(config, B, pps * self.block_size, dtype, block_size=self.block_size,
                        num_pages=self.num_pages, pages=self.pages, kv_dtype=self.kv_dtype)


@struct.dataclass
class ProposeContext:
  """tokens int32[B, S] (row b's committed tokens are tokens[b, :lengths[b]]); lengths int32[B]; sampling
  SamplingParams (drafters that sample use the target's settings); last_hidden [B, D] the target's final hidden at
  the last token fed (it predicted tokens[b, lengths-1])."""

  tokens: jax.Array
  lengths: jax.Array
  sampling: Any
  last_hidden: jax.Array


@struct.dataclass
class VerifyResult:
  """tokens int32[B, k+1] verifier output, of which the first `emitted[b]` were committed; num_accepted int32[B]
  drafts accepted before cuts; emitted int32[B] tokens committed this step (after EOS/limit cuts; 0 for done
  rows); new_lengths int32[B] buffer lengths after commit; hidden [B, k+1, D] target hidden states of the fed
  tokens (last committed + drafts)."""

  tokens: jax.Array
  num_accepted: jax.Array
  emitted: jax.Array
  new_lengths: jax.Array
  hidden: jax.Array


class Proposer(Protocol):
  name: str
  k: int  # the largest number of tokens it drafts per step (a tree's depth): the config's num_speculative_tokens
  needs_prompt_hidden: ClassVar[bool]
  tree: Any  # None for chain proposers

  def init(self, params, prefill: PrefillOut, capacity: int): ...
  def propose(self, params, state, ctx: ProposeContext, k: int, key: jax.Array) -> tuple[Draft, Any]: ...
  def update(self, params, state, result: VerifyResult): ...
  def insert(self, state, slot, row_state): ...


@dataclasses.dataclass(frozen=True)
class Stateless:
  """Base for proposers that keep no state between steps (ngram, medusa)."""

  needs_prompt_hidden: ClassVar[bool] = False
  tree = None  # chains; not a dataclass field, so that a subclass may declare one (medusa's static trees)

  def init(self, params, prefill, capacity):
    return ()

  def update(self, params, state, result):
    return state

  def insert(self, state, slot, row_state):
    return state


@dataclasses.dataclass(frozen=True)
class NoneProposer(Stateless):
  """k = 0: plain decoding through the same loop."""

  name: str = "none"
  k: int = 0

  def propose(self, params, state, ctx, k, key):
    raise AssertionError("the none proposer is never asked for drafts")




# The optional hooks above, as shared code calls them: no proposer is a special case there.


def row_state_for(proposer, row_state, request):
  """The 1-row proposer state (from init) made for `request` (a slots.Request): the proposer's for_request hook,
  else unchanged."""
  hook = getattr(proposer, "for_request", None)
  return row_state if hook is None else hook(row_state, request)


def without_tenant(proposer, decode_state, tenant):
  """The decode state without `tenant`'s shared history (before its id goes to another tenant): the proposer's
  forget_tenant hook, else unchanged (a proposer that shares nothing between requests)."""
  hook = getattr(proposer, "forget_tenant", None)
  return decode_state if hook is None else hook(decode_state, tenant)


def accepted_from_history(pstate):
  """int32[B]: the accepted drafts the proposer took from other requests' text since insert, or None (it takes
  none)."""
  count = getattr(pstate, "accepted_from_history", None)
  return None if count is None else count()
