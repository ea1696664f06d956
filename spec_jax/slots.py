"""Slots: fill one row of a running DecodeState with a new request, empty it again, read it out.

The shape of JetStream's engine API over `decode.py`: a host scheduler keeps a state of B slots, `insert`s a
request into a free slot (prefill plus a write of that row only), runs `decode_loop` for a bounded number of
steps, reads the committed tokens from a `snapshot`, and `release`s finished slots. Every function is jitted
with the slot as a traced index, so none recompiles per slot or per call.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax import adaptive, sharding, streams
from spec_jax import logprobs as lps
from spec_jax.cache import DEFAULT_BLOCK_SIZE, KVCache
from spec_jax.config import SamplingParams, validate_sampling
from spec_jax.controls import Controls
from spec_jax.grammar.rows import GrammarRows, blank_like, grammar_controls
from spec_jax.admit import Resume, prefill_rows
from spec_jax.decode import FINISH_ABORT, DecodeState, LoopSpec
from spec_jax.batch import check_fits
from spec_jax.prefill import DEFAULT_CHUNK, bucket
from spec_jax.proposers import base as proposers_base
from spec_jax.rows import write_row, write_rows_tree
from spec_jax.stats import Stats


@struct.dataclass
class Request:
  """One request, ready for `insert`. tokens int32[P]: the prompt (BOS included) right-padded to a bucket;
  prompt_len, max_new int32[]; sampling: SamplingParams of one row; draft_cap int32[]: the most tokens the
  proposer may draft for it per step (0: none);
  key uint32[2]: its random stream, from its seed (spec_jax/streams.py: every draw of its row is keyed by it, so
  a seeded request's output does not depend on the other rows);
  tenant int32[]: the request's tenant id, for a proposer that keeps per-tenant state (its for_request hook reads
  it: spec_jax/proposers/base.py); logprobs, logprobs_mode int32[]: the top logprobs it asks for (-1: none) and
  their mode (spec_jax/logprobs.py)."""

  tokens: jax.Array
  prompt_len: jax.Array
  max_new: jax.Array
  sampling: SamplingParams
  draft_cap: jax.Array
  key: jax.Array
  tenant: jax.Array
  controls: Controls
  logprobs: jax.Array
  logprobs_mode: jax.Array
  pages: jax.Array  # int32[pages_per_seq]: the slot's page table (serve/engine/block_manager.py); -1s: keep the slot's own
  cached: jax.Array  # int32[]: leading positions whose K/V `pages` already hold (a prefix-cache hit)
  known: jax.Array  # int32[capacity]: the prompt, then the tokens already streamed (a recomputed request)
  known_len: jax.Array  # int32[]


@struct.dataclass
class Snapshot:
  """Copies of what the host reads after a loop call (new buffers: safe to read while the next call runs).

  tokens int32[B, S]; lengths, prompt_lens int32[B]; done bool[B]; finish int32[B] FINISH_*; per-row counters
  since insert: steps, drafted, accepted int32[B], drafted_at, accepted_at int32[B, K]; option_uses int32[n] steps
  per option since the state was made; step int32[] loop steps so far; spec_enabled bool[];
  accepted_from_history int32[B]: of `accepted`, the drafts a proposer took from other requests' text (zeros for a
  proposer whose state does not count them: spec_jax/proposers/base.py).
  """

  tokens: jax.Array
  lengths: jax.Array
  prompt_lens: jax.Array
  done: jax.Array
  finish: jax.Array
  steps: jax.Array
  drafted: jax.Array
  accepted: jax.Array
  drafted_at: jax.Array
  accepted_at: jax.Array
  option_uses: jax.Array
  step: jax.Array
  spec_enabled: jax.Array
  accepted_from_history: jax.Array
  lp_chosen: jax.Array  # the committed tokens' logprobs (spec_jax/logprobs.py; [B, 0] when the loop has none)
  lp_top_ids: jax.Array
  lp_top_vals: jax.Array
  kv_lengths: jax.Array  # int32[B]: positions whose K/V every cache of the row holds (what a prefix cache may keep)


def make_request(prompt_ids: Sequence[int], *, max_new: int, spec: LoopSpec, capacity: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, draft_cap: int | None = None, seed: int = 0,
                 chunk: int = DEFAULT_CHUNK, tenant: int = 0, controls: Controls | None = None, logprobs: int = -1,
                 logprobs_mode: str = "raw_logprobs", grammar: tuple = (None, None), pages=None,
                 block_size: int = DEFAULT_BLOCK_SIZE, cached: int = 0, output_ids: Sequence[int] = ()) -> Request:
  """Host-side: check the request (ValueError with the reason) and pad it for `insert`. draft_cap: the row's
  draft-length cap (None: the loop's largest k; 0: never drafts). logprobs: the top logprobs returned per token
  (-1: none, 0: the token's own only), logprobs_mode: raw_logprobs or processed_logprobs. grammar: (a
  TokenAutomaton or None, the state's grammar capacity or None; spec_jax/grammar/rows.py). pages: the pages
  the request's K/V go to (int32, one per `block_size` tokens of `capacity`: a block manager's table row); None
  keeps the slot's own (the contiguous table of `empty_state`). cached: the first `cached` prompt positions' K/V
  are already in `pages` (a prefix-cache hit: a multiple of block_size, at most what `usable_prefix` allows);
  only the rest is prefilled. output_ids: tokens already streamed for this request (it was preempted): the row
  is recomputed from prompt + output_ids and continues after them, with max_new counting them."""
  n = len(prompt_ids)
  check_fits(spec.config, n, int(max_new), spec.lookahead, capacity)
  known = list(prompt_ids) + list(output_ids)
  if len(output_ids) >= int(max_new):
    raise ValueError(f"{len(output_ids)} tokens already streamed of max_new {max_new}: nothing left to resume")
  m = len(known) - (1 if output_ids else 0)  # the prefilled positions: the last streamed token is fed next
  cached = int(cached)
  if cached % block_size or not 0 <= cached < m:
    raise ValueError(f"a cached prefix of {cached} tokens must be a multiple of block_size {block_size} below the "
                     f"{m} positions to prefill")
  validate_sampling(temperature, top_k, top_p)
  lps.check(int(logprobs), logprobs_mode, spec.max_logprobs)
  # The padded bucket may run past the slot's capacity (a prefix hit or a resume starts it mid-row, and a capacity
  # need not be a bucket): padding past the page table goes to the null page, and nothing reads past capacity.
  P, _ = bucket(m - cached, chunk)
  tokens = np.zeros((P,), np.int32)
  tokens[:m - cached] = known[cached:m]
  known_buf = np.zeros((capacity,), np.int32)
  known_buf[:len(known)] = known
  pps = -(-capacity // block_size)
  pages = np.full((pps,), -1, np.int32) if pages is None else np.asarray(pages, np.int32)
  if pages.shape != (pps,):
    raise ValueError(f"a page table row of {pages.shape} for {pps} pages of {block_size} tokens")
  return Request(tokens=jnp.asarray(tokens), prompt_len=jnp.int32(n), max_new=jnp.int32(max_new),
                 sampling=SamplingParams.make(1, temperature, top_k, top_p), 
                 draft_cap=jnp.int32(spec.k_max if draft_cap is None else min(max(int(draft_cap), 0), spec.k_max)),
                 key=jnp.asarray(streams.seed_key(seed)), tenant=jnp.int32(tenant),
                 controls=grammar_controls(Controls.make(1) if controls is None else controls, grammar[0],
                                           grammar[1], spec.config.vocab_size),
                 logprobs=jnp.int32(logprobs), logprobs_mode=jnp.int32(lps.MODES[logprobs_mode]),
                 pages=jnp.asarray(pages), cached=jnp.int32(cached), known=jnp.asarray(known_buf),
                 known_len=jnp.int32(len(known)))


def empty_state(params, spec: LoopSpec, *, batch: int, capacity: int, costs=None, seed: int = 0,
                grammar_capacity=None, block_size: int = DEFAULT_BLOCK_SIZE,
                num_pages: int | None = None) -> DecodeState:
  """A state of `batch` free slots of `capacity` tokens each (a multiple of the prefill chunk is best). With a
  mesh (spec.mesh) the slots split over `data`, so `batch` must be a multiple of it. grammar_capacity (states,
  token classes): every slot can then take a request with a grammar of up to that size (its Request's controls
  carry a GrammarRows of the same capacity; spec_jax/grammar/rows.py); None: no grammar. The KV caches are
  paged (spec_jax/cache.py) in pages of `block_size` tokens: with `num_pages`, a pool of that many pages that
  requests get pages of through their Request's table (a block manager's); without, each slot owns its
  contiguous run (num_pages = 1 + batch * capacity / block_size per data shard)."""
  if batch % sharding.axis_size(spec.mesh, "data"):
    raise ValueError(f"{batch} slots do not split over the mesh's data axis of {spec.mesh.shape['data']}")
  controls = None
  if grammar_capacity is not None:
    controls = Controls.make(batch).replace(grammar=GrammarRows.make([None] * batch, spec.config.vocab_size,
                                                                     tuple(grammar_capacity)))
  costs = jnp.asarray(adaptive.default_costs(spec.ks) if costs is None else costs, jnp.float32)
  return _empty(params, spec, batch, capacity, costs, jnp.asarray(streams.seed_key(seed)), controls,
                block_size=block_size, num_pages=num_pages)


@sharding.settled
@functools.partial(jax.jit, static_argnames=("spec", "batch", "capacity", "block_size", "num_pages"))
def _empty(params, spec, batch, capacity, costs, key, controls=None, *, block_size, num_pages):
  # One dummy request of one token per row, prefilled and marked free: every leaf gets its real shape and dtype.
  P, chunk = bucket(1)
  prompt = jnp.zeros((batch, P), jnp.int32).at[:, 0].set(spec.config.bos_id)
  lens = jnp.ones((batch,), jnp.int32)
  shards = sharding.axis_size(spec.mesh, "data")
  pps = -(-capacity // block_size)
  pages = None
  if num_pages is not None:  # a pool handed out by the host: every row starts on its shard's null page
    pages = np.repeat((np.arange(batch) // (batch // shards)) * (num_pages // shards), pps).reshape(batch, pps)
  cache = KVCache.init(spec.config, batch, capacity, params["target"]["final_norm"].dtype, block_size=block_size,
                       num_pages=num_pages, pages=pages, shards=shards, kv_dtype=spec.kv_cache_dtype)
  return prefill_rows(params, spec, prompt, lens, lens, SamplingParams.make(batch), jnp.zeros((batch,), jnp.int32),
                      jnp.broadcast_to(key, (batch, 2)), cache, capacity=capacity, chunk=chunk,
                      live=jnp.zeros((batch,), bool), costs=costs, controls=controls)


@sharding.settled
@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def insert(params, state: DecodeState, slot, req: Request, spec: LoopSpec) -> DecodeState:
  """Prefill `req` and write it into row `slot` (traced) of a running state; no other row changes."""
  S = state.capacity
  P = req.tokens.shape[0]
  _, chunk = bucket(P)
  prompt = req.tokens[None]
  controls = req.controls
  if state.controls.grammar is not None and controls.grammar is None:  # an unconstrained row of a state with grammars
    controls = controls.replace(grammar=blank_like(state.controls.grammar, 1))
  pages_row = jnp.where(req.pages[0] < 0, state.cache.pages[slot], req.pages)
  state = state.replace(cache=state.cache.with_page_row(slot, pages_row),
                        pstate=set_page_row(state.pstate, slot, pages_row))
  # The prefill writes straight into the row's pages of the state's pools (the target's and the proposer's): a
  # one-row view of each, starting after the cached prefix. Nothing is copied.
  cache = state.cache.replace(lengths=req.cached[None], pages=pages_row[None])
  lens = (req.known_len - (req.known_len > req.prompt_len))[None]  # the prefilled positions
  resume = Resume(offsets=req.cached[None], known=req.known[None], known_lens=req.known_len[None],
                  orig_lens=req.prompt_len[None], proposer_cache=proposer_cache(state.pstate))
  row = prefill_rows(params, spec, prompt, lens, req.max_new[None], req.sampling, req.draft_cap[None], req.key[None],
                     cache, capacity=S, chunk=chunk, controls=controls,
                     logprobs=(req.logprobs[None], req.logprobs_mode[None]), resume=resume)
  put = functools.partial(write_row, slot=slot)
  row_pstate = proposers_base.row_state_for(spec.proposer, row.pstate, req)
  state = state.replace(
      tokens=put(state.tokens, row.tokens), lengths=put(state.lengths, row.lengths),
      prompt_lens=put(state.prompt_lens, row.prompt_lens), max_new=put(state.max_new, row.max_new),
      cache=state.cache.insert_row(row.cache, slot),
      pstate=spec.proposer.insert(state.pstate, slot, row_pstate), keys=put(state.keys, row.keys),
      done=put(state.done, row.done), finish=put(state.finish, row.finish),
      draft_cap=put(state.draft_cap, row.draft_cap),
      sampling=write_rows_tree(state.sampling, row.sampling, slot),
      controls=write_rows_tree(state.controls, row.controls, slot),
      stats=write_rows_tree(state.stats, Stats.zeros(1, spec.k_max), slot),
      adapt=state.adapt.reset_row(slot), last_hidden=put(state.last_hidden, row.last_hidden),
      done_step=put(state.done_step, state.step[None]),
      logprobs=write_rows_tree(state.logprobs, row.logprobs, slot))
  return sharding.constrain_state(state, spec.mesh)


def proposer_cache(pstate):
  """The proposer state's own KV cache (a draft model's, the EAGLE layer's), or None."""
  found = [x for x in jax.tree_util.tree_leaves(pstate, is_leaf=lambda x: isinstance(x, KVCache))
           if isinstance(x, KVCache)]
  return found[0] if found else None


def usable_prefix(spec: LoopSpec, hit: int, block_size: int) -> int:
  """Of a prefix-cache hit of `hit` tokens (whole pages), what a request may reuse: all of it, but one page less
  for a proposer that starts from the target's features at every prompt position (EAGLE): its cached slot
  before the reused prefix pairs that position's feature with the next token, so the page whose next token is
  not part of the hit is recomputed (vLLM drops the last matched block for EAGLE the same way)."""
  if spec.proposer.needs_prompt_hidden:
    return max(0, hit - block_size)
  return hit


def set_page_row(tree, slot, pages_row):
  """Row `slot` of every KV cache's page table in a pytree (a proposer state) set to pages_row."""
  one = lambda x: x.with_page_row(slot, pages_row) if isinstance(x, KVCache) else x
  return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, KVCache))


def set_page_tables(state: DecodeState, table) -> DecodeState:
  """Host-side: every KV cache of the state (the target's, a proposer's) takes the page table int32[B, P] (the
  block manager's, between loop calls); the new leaf takes the old one's layout, so the loop does not recompile."""
  table = np.asarray(table, np.int32)
  # one device buffer per cache: two leaves on one buffer could not both be donated to the next call
  one = lambda x: x.replace(pages=sharding.put(table, x.pages.sharding)) if isinstance(x, KVCache) else x
  return jax.tree_util.tree_map(one, state, is_leaf=lambda x: isinstance(x, KVCache))


@sharding.settled
@functools.partial(jax.jit, donate_argnames=("state",))
def fill_pages(state: DecodeState, pages, value=float("nan")) -> DecodeState:
  """Pages int32[n] (global ids) of every KV cache set to `value`: the test-only poisoning of freed pages (NaN
  there turns any read of stale K/V into NaN output; serve's --poison_freed_pages)."""
  def one(x):
    if not isinstance(x, KVCache):
      return x
    # an 8-bit pool's data cannot hold NaN (int8): its scales are poisoned too, so a read of it is NaN all the same
    return x.fill_pages(pages, value)
  return jax.tree_util.tree_map(one, state, is_leaf=lambda x: isinstance(x, KVCache))


@sharding.settled
@functools.partial(jax.jit, donate_argnames=("state",))
def release(state: DecodeState, slot) -> DecodeState:
  """Free slot `slot`: it stops running (a request still running there is aborted)."""
  running = ~state.done[slot]
  return state.replace(done=state.done.at[slot].set(True),
                       finish=state.finish.at[slot].set(jnp.where(running, FINISH_ABORT, state.finish[slot])))


@sharding.settled
@functools.partial(jax.jit, donate_argnames=("state",))
def set_speculation(state: DecodeState, enabled) -> DecodeState:
  """The global switch: off, every step drafts k = 0; requests in flight continue exactly."""
  return state.replace(spec_enabled=jnp.asarray(enabled, bool))


def set_draft_caps(state: DecodeState, caps) -> DecodeState:
  """Each row's draft-length cap int32[B] (0: the row does not draft): the segment policy, its guardrails and the
  switchback windows, set by the host between loop calls; requests in flight continue exactly. Host-side: the
  new leaf takes the old one's layout, so the loop does not recompile."""
  caps = np.asarray(caps, np.int32).reshape(state.draft_cap.shape)
  return state.replace(draft_cap=sharding.put(caps, state.draft_cap.sharding))


@sharding.settled
@jax.jit
def snapshot(state: DecodeState) -> Snapshot:
  s = state.stats
  cp = jnp.copy
  from_hist = proposers_base.accepted_from_history(state.pstate)
  return Snapshot(tokens=cp(state.tokens), lengths=cp(state.lengths), prompt_lens=cp(state.prompt_lens),
                  done=cp(state.done), finish=cp(state.finish), steps=cp(s.steps), drafted=cp(s.drafted),
                  accepted=cp(s.accepted), drafted_at=cp(s.drafted_at), accepted_at=cp(s.accepted_at),
                  option_uses=cp(state.adapt.uses), step=cp(state.step), spec_enabled=cp(state.spec_enabled),
                  accepted_from_history=jnp.zeros_like(s.accepted) if from_hist is None else cp(from_hist),
                  lp_chosen=cp(state.logprobs.chosen), lp_top_ids=cp(state.logprobs.top_ids),
                  lp_top_vals=cp(state.logprobs.top_vals), kv_lengths=_kv_lengths(state))


def _kv_lengths(state: DecodeState):
  pc = proposer_cache(state.pstate)
  return jnp.copy(state.cache.lengths) if pc is None else jnp.minimum(state.cache.lengths, pc.lengths)
