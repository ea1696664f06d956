"""The decode state, the draft-verify-commit step and the bounded generation loop (lax.while_loop).

A DecodeState of B rows is a set of B slots. Batch generation (`spec_jax.batch.generate`) prefills every row at once and runs
the loop to the end; a server fills and empties single slots between bounded loop calls (spec_jax/slots.py).

Invariant: row b's committed tokens are tokens[b, :lengths[b]]; the KV cache holds all of them but the last
(cache.lengths == lengths - 1). A step feeds [last committed, draft_1..draft_k] at positions lengths-1 .. ,
verifies the k drafts against the target's k+1 next-token distributions, and commits the accepted drafts plus
one token from the target (correction or bonus), cut at a stop token or the max-token limit. Plain decoding is
the same step with k = 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax import adaptive, scopes, sharding, streams, tree
from spec_jax import logprobs as lps
from spec_jax import controls as ctl
from spec_jax.controls import Controls
from spec_jax.grammar import rows as grammar_rows
from spec_jax.cache import KVCache, kv_storage_dtype
from spec_jax.config import ModelConfig, SamplingParams
from spec_jax.models.transformer import forward
from spec_jax.proposers.base import NoneProposer, ProposeContext, VerifyResult
from spec_jax.rows import feature_layers, target_features
from spec_jax.stats import Stats
from spec_jax.verify import verify_chain, verify_tree

FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_CAPACITY = 0, 1, 2, 3, 4
FINISH_NAMES = {FINISH_NONE: None, FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ABORT: "abort",
                FINISH_CAPACITY: "capacity"}
NO_LIMIT = np.iinfo(np.int32).max  # max_steps for a loop that runs until every row is done


def lookahead(k_max: int, tree) -> int:
  """Cache entries a step writes past the last committed token: k_max for chains, N - 1 for an N-node `tree`
  (the proposer's; none while nothing drafts)."""
  return max(k_max, tree.lookahead if tree is not None and k_max else 0)


@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """Everything static about a generation loop (hashable: a jit static argument). Built by `make_spec` only."""

  config: ModelConfig
  proposer: Any = NoneProposer()
  # The draft lengths the adaptive controller may pick from, each <= proposer.k (= the config's
  # num_speculative_tokens); a step drafts k = ks[option] (`option` is the controller's index into ks), a row
  # min(k, its draft_cap). k_max = max(ks) is the batch's largest, what the cache must leave room for.
  ks: tuple = (0,)
  stop_ids: tuple = ()
  impl: str = "xla"
  probe_every: int = 16
  mesh: Any = None  # a jax.sharding.Mesh ('data', 'model'), or None for one device (spec_jax/sharding.py)
  max_logprobs: int = lps.OFF  # top logprobs a row may ask for (spec_jax/logprobs.py); OFF: no logprob buffers
  kv_cache_dtype: str = "auto"  # every KV cache of the state (spec_jax/cache.py KV_CACHE_DTYPES)

  @property
  def k_max(self) -> int:
    return max(self.ks)

  @property
  def lookahead(self) -> int:
    return lookahead(self.k_max, self.proposer.tree)

  def __post_init__(self):
    check_kv_cache_dtype(self.kv_cache_dtype, self.impl)
    # A proposer that runs attention itself (the draft model, EAGLE) declares a `mesh` field: it runs on the
    # loop's mesh, so its Pallas kernels run per shard as the target's do.
    if any(f.name == "mesh" for f in dataclasses.fields(self.proposer)) and self.proposer.mesh != self.mesh:
      object.__setattr__(self, "proposer", dataclasses.replace(self.proposer, mesh=self.mesh))

  def is_tree(self, k: int) -> bool:
    """Does drafting k tokens mean the proposer's tree? (Smaller k are chains.)"""
    return k > 0 and self.proposer.tree is not None and k == self.proposer.tree.depth


@struct.dataclass
class DecodeState:
  """B slots, capacity S tokens each. A free or finished slot has done = True and never runs.

  tokens int32[B, S]: prompt + generated; row b's committed tokens are tokens[b, :lengths[b]].
  lengths int32[B]; prompt_lens int32[B]; max_new int32[B]: the new-token limit per row.
  cache: the target's KVCache (cache.lengths == lengths - 1).
  pstate: the proposer's state (a pytree whose leaves carry the slot axis).
  keys uint32[B, 2]: each row's random stream (raw key data; spec_jax/streams.py): every draw of a row is keyed
  by it, the token's position and the draw's purpose, so a seeded row's output does not depend on its neighbours.
  done bool[B]; finish int32[B] FINISH_*; draft_cap int32[B]: the most tokens the proposer may draft for
  the row per step (0: none; a row drafts min(the step's k, its cap): the segment policy's per-request k).
  sampling: SamplingParams [B]; controls: Controls [B] (logit_bias, penalties, min_p, min_tokens, stop ids;
  spec_jax/controls.py). stats: Stats [B] counters. adapt: AdaptState (per-row acceptance, cost table).
  last_hidden [B, F]: the proposer's target features (spec_jax.rows.target_features; the final-normed hidden,
  F = D, for all but EAGLE-3) at the position that predicted the last committed token.
  spec_enabled bool[]: the global speculation switch (off: every step drafts k = 0).
  step int32[]: loop steps so far; done_step int32[B]: the step at which each row finished.
  logprobs: the committed tokens' logprobs for rows that ask (spec_jax/logprobs.py).
  """

  tokens: jax.Array
  lengths: jax.Array
  prompt_lens: jax.Array
  max_new: jax.Array
  cache: KVCache
  pstate: Any
  keys: jax.Array
  done: jax.Array
  finish: jax.Array
  draft_cap: jax.Array
  sampling: SamplingParams
  controls: Controls
  stats: Stats
  adapt: adaptive.AdaptState
  last_hidden: jax.Array
  spec_enabled: jax.Array
  step: jax.Array
  done_step: jax.Array
  logprobs: lps.Logprobs

  @property
  def capacity(self) -> int:
    return self.tokens.shape[1]


# ------------------------------------------------------------------------------------------------------- step

def _commit(state: DecodeState, spec: LoopSpec, active, out, n_acc):
  """Cut the verifier's output at stop tokens and the token limit, write it, and update done/finish."""
  B, T = out.shape
  t = jnp.arange(T, dtype=jnp.int32)[None, :]
  n_emit = n_acc + 1
  is_stop = ctl.is_stop(out, state.controls, spec.stop_ids) & (t < n_emit[:, None])
  has_stop = is_stop.any(axis=1)
  first_stop = jnp.argmax(is_stop, axis=1).astype(jnp.int32)
  n_emit = jnp.where(has_stop, first_stop + 1, n_emit)
  remaining = state.max_new - (state.lengths - state.prompt_lens)
  n_emit = jnp.where(active, jnp.minimum(n_emit, remaining), 0)
  stopped = active & has_stop & (first_stop < n_emit)

  S = state.tokens.shape[1]
  slots = jnp.where(t < n_emit[:, None], state.lengths[:, None] + t, S)  # S: dropped
  rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  tokens = state.tokens.at[rows, slots].set(out, mode="drop")
  lengths = state.lengths + n_emit
  hit_len = active & (lengths - state.prompt_lens >= state.max_new)
  finish = jnp.where(stopped, FINISH_STOP, jnp.where(hit_len, FINISH_LENGTH, state.finish))
  done = state.done | stopped | hit_len
  return tokens, lengths, n_emit, finish, done


def spec_step(params, state: DecodeState, spec: LoopSpec, option: int) -> DecodeState:
  """One draft-verify-commit round for all rows, drafting k = spec.ks[option] tokens."""
  k = spec.ks[option]
  if spec.is_tree(k):
    return tree_step(params, state, spec, option)
  B, S = state.tokens.shape
  # The forward writes k + 1 cache entries from lengths - 1 on. A row without room for them is an error (the
  # host checks prompt + max_new + k_max + 1 <= capacity, so this only guards against misuse): it finishes with
  # FINISH_CAPACITY instead of its write being clamped over committed entries.
  overflow = ~state.done & (state.lengths + k > S)
  finish = jnp.where(overflow, FINISH_CAPACITY, state.finish)
  state = state.replace(done=state.done | overflow, finish=finish)
  active = ~state.done
  keys = streams.rows(state.keys, B)
  last = jnp.take_along_axis(state.tokens, (state.lengths - 1)[:, None], axis=1)  # [B, 1]
  pstate = state.pstate
  grammar = state.controls.grammar
  if k > 0:
    ctx = ProposeContext(state.tokens, state.lengths, state.sampling, state.last_hidden)
    with scopes.scope(scopes.DRAFTER):
      draft, pstate = spec.proposer.propose(params["proposer"], pstate, ctx, k, draft_keys(keys, state.lengths, k))
    pos = jnp.arange(k, dtype=jnp.int32)[None, :]
    draft_tokens, draft_probs = draft.tokens.astype(jnp.int32), draft.probs
    if grammar is not None:  # the tokens the grammar forces are drafts too (spec_jax/grammar/rows.py)
      draft_tokens, draft_probs = grammar_rows.forced_chain(grammar, draft_tokens, draft_probs)
    draft_tokens = jnp.where(pos < state.draft_cap[:, None], draft_tokens, -1)
  else:
    draft_tokens, draft_probs = jnp.zeros((B, 0), jnp.int32), None
  feed = jnp.concatenate([last, jnp.maximum(draft_tokens, 0)], axis=1)  # no-draft slots feed a harmless 0
  positions = (state.lengths - 1)[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  logits, hidden, cache, *layers = forward(params["target"], feed, positions, state.cache, config=spec.config,
                                           impl=spec.impl, return_layers=feature_layers(spec.proposer),
                                           mesh=spec.mesh)
  hidden = target_features(hidden, layers[0] if layers else None)
  # The controls at each position, with the drafts before it counted (plain decoding is the same with k = 0).
  raw = logits
  with scopes.scope(scopes.CONTROLS):
    logits = ctl.apply(logits, state.controls, state.sampling.temperature, state.tokens, state.lengths,
                       state.prompt_lens, *ctl.chain_path(last, draft_tokens), spec.stop_ids)
    if grammar is not None:  # each position masked by the grammar state after the drafts before it
      feed_path = jnp.concatenate([last, draft_tokens], axis=1)
      logits = grammar_rows.mask(logits, grammar, grammar_rows.path_states(
          grammar, feed_path, grammar_rows.chain_parents(B, k + 1)))
  with scopes.scope(scopes.SAMPLING):
    out, n_acc = verify_chain(logits, draft_tokens, draft_probs, keys, state.sampling, positions=state.lengths)
  committed = _commit(state, spec, active, out, n_acc)
  state = _advance_grammar(state, out, committed[2])
  n_emit = committed[2]
  with scopes.scope(scopes.CONTROLS):
    state = state.replace(logprobs=lps.record(state.logprobs, raw, logits, state.sampling, out, n_emit,
                                              state.lengths))
  cache = cache.replace(lengths=state.cache.lengths + n_emit)
  pos = jnp.arange(k, dtype=jnp.int32)[None, :]
  committed_drafts = jnp.minimum(n_acc, n_emit)  # a stop token or the limit can cut accepted drafts
  stats = state.stats.record(active, draft_tokens >= 0, pos < committed_drafts[:, None], n_emit)
  return _step_done(params, state, spec, option, committed, out=out, n_acc=n_acc, cache=cache, path_hidden=hidden,
                    pstate=pstate, stats=stats)


def tree_step(params, state: DecodeState, spec: LoopSpec, option: int) -> DecodeState:
  """spec_step with a token tree: the proposer drafts N nodes per row, the target scores them all in one forward
  under the tree mask (positions = the root's + depth), `verify_tree` walks the tree, and the accepted path's K/V
  are written into consecutive cache slots (`tree.write_accepted`; the forward writes none), so the cache stays a
  plain prefix."""
  k = spec.ks[option]
  shape = spec.proposer.tree
  N = shape.nodes
  B, S = state.tokens.shape
  overflow = ~state.done & (state.lengths + spec.lookahead > S)  # writes from lengths - 1 on (tree.lookahead)
  state = state.replace(done=state.done | overflow, finish=jnp.where(overflow, FINISH_CAPACITY, state.finish))
  active = ~state.done
  keys = streams.rows(state.keys, B)
  last = jnp.take_along_axis(state.tokens, (state.lengths - 1)[:, None], axis=1)[:, 0]
  ctx = ProposeContext(state.tokens, state.lengths, state.sampling, state.last_hidden)
  with scopes.scope(scopes.DRAFTER):
    draft, pstate = spec.proposer.propose_tree(params["proposer"], state.pstate, ctx,
                                               draft_keys(keys, state.lengths, k))
  node = jnp.arange(N, dtype=jnp.int32)[None, :]
  parents = draft.parents.astype(jnp.int32)
  with scopes.scope(scopes.TREE):
    mask = tree.ancestor_mask(parents)
    depths = tree.mask_depths(mask)
  # Node 0 is the root (the last committed token); a row keeps the nodes no deeper than its draft cap (a row that
  # may not draft keeps only its root).
  tree_tokens = jnp.where(node == 0, last[:, None],
                          jnp.where(depths <= state.draft_cap[:, None], draft.tokens.astype(jnp.int32), -1))
  grammar = state.controls.grammar
  if grammar is not None:  # the tokens the grammar forces are drafts too (spec_jax/grammar/rows.py)
    tree_tokens = grammar_rows.forced_tree(grammar, tree_tokens, parents)
  positions = (state.lengths - 1)[:, None] + depths
  logits, hidden, (k_new, v_new), *layers = forward(params["target"], jnp.maximum(tree_tokens, 0), positions,
                                                    state.cache, config=spec.config, impl=spec.impl, tree_mask=mask,
                                                    return_layers=feature_layers(spec.proposer), mesh=spec.mesh,
                                                    write=False)
  hidden = target_features(hidden, layers[0] if layers else None)
  raw = logits
  with scopes.scope(scopes.CONTROLS):
    logits = ctl.apply(logits, state.controls, state.sampling.temperature, state.tokens, state.lengths,
                       state.prompt_lens, tree_tokens, mask, depths, spec.stop_ids)
    if grammar is not None:  # each node masked by the grammar state after its path
      logits = grammar_rows.mask(logits, grammar, grammar_rows.path_states(grammar, tree_tokens, parents))
  with scopes.scope(scopes.SAMPLING):
    out, n_acc, nodes = verify_tree(logits, tree_tokens, parents, None, keys, state.sampling,
                                    positions=state.lengths, max_depth=k, max_children=shape.max_children)
  committed = _commit(state, spec, active, out, n_acc)
  state = _advance_grammar(state, out, committed[2])
  n_emit = committed[2]
  with scopes.scope(scopes.CONTROLS):  # the logits of the committed path's nodes
    state = state.replace(logprobs=lps.record(state.logprobs, raw, logits, state.sampling, out, n_emit,
                                              state.lengths, path=nodes))
  with scopes.scope(scopes.TREE):
    cache = tree.write_accepted(state.cache, k_new, v_new, nodes, mesh=spec.mesh)
  cache = cache.replace(lengths=state.cache.lengths + n_emit)
  # [B, k + 1, D] as a chain's; entries past the accepted path (node -1) repeat the root's (finite, never read)
  path_hidden = jnp.take_along_axis(hidden, jnp.maximum(nodes, 0)[:, :, None], axis=1)
  # Per depth d: drafted when the row's tree reaches depth d + 1; accepted when the committed path does.
  d = jnp.arange(1, k + 1, dtype=jnp.int32)[None, :]
  reach = jnp.max(jnp.where(tree_tokens >= 0, depths, 0), axis=1)
  committed_drafts = jnp.minimum(n_acc, n_emit)
  stats = state.stats.record(active, d <= reach[:, None], d <= committed_drafts[:, None], n_emit,
                             drafted_count=jnp.sum(tree_tokens[:, 1:] >= 0, axis=1))
  return _step_done(params, state, spec, option, committed, out=out, n_acc=n_acc, cache=cache,
                    path_hidden=path_hidden, pstate=pstate, stats=stats)


def draft_keys(keys, lengths, k: int):
  """Typed keys [B, k]: the DRAFT key of each drafted position (draft i proposes the token at lengths + i)."""
  return streams.at(keys, lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :], streams.DRAFT)


def _advance_grammar(state: DecodeState, out, n_emit) -> DecodeState:
  """The rows' grammar states after this step's committed tokens (nothing without a grammar)."""
  g = state.controls.grammar
  if g is None:
    return state
  return state.replace(controls=state.controls.replace(grammar=grammar_rows.advance(g, out, n_emit)))


def _step_done(params, state: DecodeState, spec: LoopSpec, option: int, committed, *, out, n_acc, cache, path_hidden,
               pstate, stats) -> DecodeState:
  """The tail that chain and tree steps share, once the committed tokens (`_commit`'s output), cache and
  acceptance stats are known: the features the proposer continues from, the adaptive controller's observation,
  the proposer's update and the new state. `path_hidden` [B, k + 1, D]: the target's features along the
  committed path (a chain's positions, or a tree's accepted nodes)."""
  tokens, lengths, n_emit, finish, done = committed
  k = spec.ks[option]
  pick = jnp.clip(n_emit - 1, 0, k)[:, None, None]
  new_hidden = jnp.take_along_axis(path_hidden, pick, axis=1)[:, 0]
  last_hidden = jnp.where((n_emit > 0)[:, None], new_hidden, state.last_hidden)
  active = ~state.done
  adapt = adaptive.observe(state.adapt, option, k, active & (state.draft_cap > 0), n_acc)
  with scopes.scope(scopes.DRAFTER):
    pstate = spec.proposer.update(params["proposer"], pstate, VerifyResult(out, n_acc, n_emit, lengths, path_hidden))
  done_step = jnp.where(done & ~state.done, state.step + 1, state.done_step)
  return state.replace(tokens=tokens, lengths=lengths, cache=cache, pstate=pstate, done=done,
                       finish=finish, stats=stats, adapt=adapt, last_hidden=last_hidden, step=state.step + 1,
                       done_step=done_step)


def choose_option(state: DecodeState, spec: LoopSpec):
  """int32[]: the index into spec.ks that the next step drafts with (adaptive speculation)."""
  if len(spec.ks) == 1:
    return jnp.zeros((), jnp.int32)
  drafting = ~state.done & (state.draft_cap > 0) & state.spec_enabled
  return adaptive.choose(state.adapt, ~state.done, drafting, spec.ks, spec.probe_every)


def switch_in_place(index, branches, operand):
  """lax.switch(index, branches, operand) for branches that map `operand` to a pytree of the same structure.

  Each branch runs as a while_loop of zero or one trips instead of a conditional: XLA:CPU copies every large
  buffer a conditional's branches update in place (the adaptive loop copied the whole KV cache, K and V, in every
  branch of every step: ~20 % of a k = 0 step on Gemma 3 270M, docs/benchmark-log.md section 15), while a while loop
  updates its carry in place. The index is read once, so exactly one branch runs.
  """
  index = jnp.clip(index, 0, len(branches) - 1)  # as lax.switch clamps
  for i, branch in enumerate(branches):
    _, operand = jax.lax.while_loop(lambda c: c[0], lambda c, f=branch: (jnp.zeros((), bool), f(c[1])),
                                      (index == i, operand))
  return operand


def adaptive_step(params, state: DecodeState, spec: LoopSpec) -> DecodeState:
  if len(spec.ks) == 1:
    return spec_step(params, state, spec, 0)
  option = choose_option(state, spec)
  branches = [functools.partial(spec_step, params, spec=spec, option=i) for i in range(len(spec.ks))]
  return switch_in_place(option, branches, state)


@sharding.settled
@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def decode_loop(params, state: DecodeState, spec: LoopSpec, max_steps=NO_LIMIT) -> DecodeState:
  """Steps until every row is done or `max_steps` (traced: no recompile per value) steps have run."""
  def cond(carry):
    s, i = carry
    return ~jnp.all(s.done) & (i < max_steps)

  def body(carry):
    s, i = carry
    return sharding.constrain_state(adaptive_step(params, s, spec), spec.mesh), i + 1

  state, _ = jax.lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))
  return state


def check_kv_cache_dtype(kv_cache_dtype: str, impl: str) -> None:
  """An unknown --kv_cache_dtype is an error (every attention impl reads an 8-bit cache with its scales)."""
  del impl
  kv_storage_dtype(kv_cache_dtype)


def make_spec(config: ModelConfig, proposer=NoneProposer(), *, ks: Optional[Sequence[int]] = None,
              adaptive_k: bool = True, stop_ids: Sequence[int] = (), impl: str = "xla", probe_every: int = 16,
              mesh=None, max_logprobs: int = lps.OFF, kv_cache_dtype: str = "auto") -> LoopSpec:
  """The loop's static settings, the one place a LoopSpec is built; the stop ids add to the model's EOS ids. `ks`:
  the draft lengths the controller may pick (default: adaptive.option_set of the proposer's k). With a mesh, the
  state is sharded by spec_jax/sharding.py's table (params must be placed with sharding.shard_params)."""
  ks = adaptive.option_set(proposer.k, adaptive_k, proposer.tree) if ks is None else tuple(ks)
  return LoopSpec(config=config, proposer=proposer, ks=ks, stop_ids=tuple(sorted(set(config.eos_ids) | set(stop_ids))),
                  impl=impl, probe_every=probe_every, mesh=mesh, max_logprobs=max_logprobs,
                  kv_cache_dtype=kv_cache_dtype)
