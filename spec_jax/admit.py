"""Admitting prompts into rows: the one prefill path of the batch start, slot insert and the empty slot state.

`prefill_rows` prefills right-padded prompts into the target's cache (spec_jax/prefill.py, in chunks) and starts
their rows: the first token sampled from the target, the proposer's state, fresh counters. Called outside jit
(`batch.start`: each prefill chunk is its own program) or inside one (`slots.insert`, `slots.empty_state`: they
inline).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax import adaptive, sharding, streams
from spec_jax import controls as ctl
from spec_jax import logprobs as lps
from spec_jax.controls import Controls
from spec_jax.grammar import rows as grammar_rows
from spec_jax.decode import FINISH_ABORT, FINISH_LENGTH, FINISH_NONE, FINISH_STOP, DecodeState, LoopSpec
from spec_jax.models.transformer import lm_head
from spec_jax.prefill import prefill
from spec_jax.proposers.base import PrefillOut
from spec_jax.rows import feature_layers
from spec_jax.sampling import sample
from spec_jax.stats import Stats


@struct.dataclass
class Resume:
  """Rows that start past their prompt's first positions (slot insert):
  offsets int32[R]: the leading positions whose K/V the rows' pages already hold (a prefix-cache hit); the
    prefilled tokens are the positions offsets .. on.
  known int32[R, capacity]: the rows' tokens so far: the prompt, then the tokens already streamed (a request
    preempted and recomputed); known_lens int32[R]; orig_lens int32[R]: the prompt's length. With streamed tokens
    the prefill covers known[:known_lens - 1] and the last streamed token stands for the first sampled one.
  proposer_cache: the state's proposer KV cache (its pool), which a proposer's own prefill writes into, or None.
  """

  offsets: jax.Array
  known: jax.Array
  known_lens: jax.Array
  orig_lens: jax.Array
  proposer_cache: Any = None


def prefill_rows(params, spec: LoopSpec, prompt_tokens, prompt_lens, max_new, sampling, draft_cap, keys, cache, *,
                 capacity: int, chunk: int, live=None, costs=None, controls=None, logprobs=None,
                 resume: Optional[Resume] = None) -> DecodeState:
  """Prefill prompts int32[R, P] (right-padded, P a multiple of `chunk`) into `cache` and start their rows.
  With `resume`, the prompts are the tokens after resume.offsets and prompt_lens the prefilled lengths.

  keys uint32[R, 2]: each row's stream (spec_jax/streams.py).
  A whole state (`live` given) or rows to write into one (slot insert):
  `live` bool[R]: rows that hold a request; the others are done from the start (batch padding, free slots); the
  state takes the mesh's layout. `costs`: the adaptive controller's step costs [R, n] (None: ones). `controls`:
  the rows' sampling controls (spec_jax/controls.py; None: none). `logprobs`: (want, mode) int32[R] each
  (spec_jax/logprobs.py; None: no row asks).
  """
  if controls is None:
    controls = Controls.make(prompt_tokens.shape[0])
  needs = spec.proposer.needs_prompt_hidden
  out = prefill(params["target"], prompt_tokens, prompt_lens, cache, config=spec.config, impl=spec.impl, chunk=chunk,
                return_all=needs, feature_layers=feature_layers(spec.proposer), mesh=spec.mesh,
                offsets=None if resume is None else resume.offsets)
  if logprobs is None:
    logprobs = (jnp.full((prompt_tokens.shape[0],), -1, jnp.int32), jnp.zeros((prompt_tokens.shape[0],), jnp.int32))
  return _start(params, spec, prompt_tokens, prompt_lens, max_new, sampling, draft_cap, keys, out[0], out[1],
                out[2] if needs else None, live, costs, controls, logprobs, resume, capacity=capacity, chunk=chunk)


@sharding.settled
@functools.partial(jax.jit, static_argnames=("spec", "capacity", "chunk"), donate_argnames=("cache",))
def _start(params, spec, prompt_tokens, prompt_lens, max_new, sampling, draft_cap, keys, cache, hidden, prompt_hidden,
           live, costs, controls, logprobs, resume, *, capacity, chunk):
  state = start_rows(params, spec, prompt_tokens, prompt_lens, max_new, sampling, draft_cap, keys, cache, hidden,
                     prompt_hidden, capacity, chunk, controls, logprobs, resume)
  if costs is not None:
    state = state.replace(adapt=adaptive.AdaptState.init(prompt_tokens.shape[0], costs))
  if live is None:
    return state
  state = state.replace(done=state.done | ~live, finish=jnp.where(live, state.finish, FINISH_ABORT))
  return sharding.constrain_state(state, spec.mesh)


def start_rows(params, spec: LoopSpec, prompt_tokens, prompt_lens, max_new, sampling, draft_cap, keys, cache,
               hidden, prompt_hidden, capacity: int, chunk: int, controls=None, logprobs=None,
               resume: Optional[Resume] = None) -> DecodeState:
  """Rows right after the target's prefill: sample the first token, start the proposer, fresh counters.

  prompt_tokens int32[R, P] right-padded; cache: the prefilled target cache (capacity slots); hidden [R, D] at
  each row's last prompt token; prompt_hidden [R, P, F] (the proposer's features) or None. Traced inside jit
  (generate and slot insert).
  """
  R, P = prompt_tokens.shape
  offsets = jnp.zeros((R,), jnp.int32) if resume is None else resume.offsets
  # The proposer's features at the last prompt token: the hidden state itself, or its feature layers'.
  feats = hidden if not feature_layers(spec.proposer) else \
      jnp.take_along_axis(prompt_hidden, (prompt_lens - 1 - offsets)[:, None, None], axis=1)[:, 0]
  controls = Controls.make(R) if controls is None else controls
  keys = jnp.asarray(keys, jnp.uint32).reshape(R, 2)
  rows = jnp.arange(R)
  if resume is None:
    tokens = jnp.zeros((R, capacity), jnp.int32).at[:, :P].set(prompt_tokens)
    known_lens = orig_lens = prompt_lens
  else:
    tokens, known_lens, orig_lens = resume.known, resume.known_lens, resume.orig_lens
  # Clear the padding past each prompt (slots the loop may read as "committed" must be this row's own).
  tokens = jnp.where(jnp.arange(capacity)[None, :] < known_lens[:, None], tokens, 0)
  # The first token's controls see the prompt and no output (one position, no drafts).
  none = jnp.full((R, 1), -1, jnp.int32)
  raw = lm_head(params["target"], hidden)[:, None, :]
  logits = ctl.apply(raw, controls, sampling.temperature, tokens,
                     prompt_lens, prompt_lens, none, jnp.ones((R, 1, 1), jnp.bool_), jnp.zeros((R, 1), jnp.int32),
                     spec.stop_ids)[:, 0]
  if controls.grammar is not None:  # the first token from the grammar's initial state
    g = controls.grammar
    logits = grammar_rows.mask(logits[:, None], g, g.state[:, None])[:, 0]
  first = sample(streams.at(streams.rows(keys, R), prompt_lens, streams.TOKEN), logits, sampling)  # position P's draw
  streamed = known_lens > prompt_lens  # a recomputed row: its last streamed token stands for the first token
  first = jnp.where(streamed, jnp.take_along_axis(tokens, prompt_lens[:, None], axis=1)[:, 0], first)
  want, mode = logprobs if logprobs is not None else (jnp.full((R,), -1, jnp.int32), jnp.zeros((R,), jnp.int32))
  lp = lps.record(lps.Logprobs.init(want, mode, capacity, spec.max_logprobs), raw, logits[:, None], sampling,
                  first[:, None], jnp.ones((R,), jnp.int32), prompt_lens)
  if controls.grammar is not None:
    g = controls.grammar
    if resume is not None:  # the grammar after the streamed tokens before the last one
      g = grammar_rows.advance_over(g, tokens, orig_lens, prompt_lens)
    g = grammar_rows.advance(g, first[:, None], jnp.ones((R,), jnp.int32))
    controls = controls.replace(grammar=g)
  tokens = tokens.at[rows, prompt_lens].set(first)
  lengths = prompt_lens + 1
  stop = ctl.is_stop(first[:, None], controls, spec.stop_ids)[:, 0]
  hit_len = lengths - orig_lens >= max_new
  finish = jnp.where(stop, FINISH_STOP, jnp.where(hit_len, FINISH_LENGTH, FINISH_NONE)).astype(jnp.int32)
  pre = PrefillOut(prompt_tokens=prompt_tokens, tokens=tokens, lengths=lengths, prompt_lens=prompt_lens,
                   prompt_hidden=prompt_hidden, last_hidden=feats, chunk=chunk, pages=cache.pages,
                   num_pages=cache.num_pages, block_size=cache.block_size, offsets=offsets, kv_dtype=cache.kv_dtype,
                   proposer_cache=None if resume is None else resume.proposer_cache)
  pstate = spec.proposer.init(params["proposer"], pre, capacity)
  return DecodeState(
      tokens=tokens, lengths=lengths, prompt_lens=orig_lens, max_new=max_new, cache=cache, pstate=pstate, keys=keys,
      done=stop | hit_len, finish=finish, draft_cap=draft_cap, sampling=sampling, controls=controls,
      stats=Stats.zeros(R, spec.k_max),
      adapt=adaptive.AdaptState.init(R, jnp.ones((1, len(spec.ks)), jnp.float32)), last_hidden=feats,
      spec_enabled=jnp.ones((), bool), step=jnp.zeros((), jnp.int32), done_step=jnp.zeros((R,), jnp.int32),
      logprobs=lp)
