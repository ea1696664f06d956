"""Prefill, the draft-verify-commit step and the generation loop (lax.while_loop), for every proposer.

Invariant: row b's committed tokens are tokens[b, :lengths[b]]; the KV cache holds all of them but the last
(cache.lengths == lengths - 1). A step feeds [last committed, draft_1..draft_k] at positions lengths-1 .. ,
verifies the k drafts against the target's k+1 next-token distributions, and commits the accepted drafts plus
one token from the target (correction or bonus), cut at a stop token or the max-token limit. Baseline decoding
is the same step with k = 0.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax import adaptive
from spec_jax.cache import KVCache
from spec_jax.config import ModelConfig, SamplingParams
from spec_jax.models.transformer import forward, lm_head
from spec_jax.proposers.base import NoneProposer, ProposeContext, VerifyResult
from spec_jax.sampling import sample
from spec_jax.stats import Stats, summarize
from spec_jax.verify import verify_chain

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = {FINISH_NONE: None, FINISH_STOP: "stop", FINISH_LENGTH: "length"}


@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """Everything static about a generation loop (hashable: a jit static argument)."""

  config: ModelConfig
  proposer: Any = NoneProposer()
  ks: tuple = (0,)  # the draft lengths the adaptive controller may pick from
  stop_ids: tuple = ()
  impl: str = "xla"
  probe_every: int = 16

  @property
  def k_max(self) -> int:
    return max(self.ks)


@struct.dataclass
class DecodeState:
  tokens: jax.Array  # int32[B, S] prompt + generated
  lengths: jax.Array  # int32[B] committed tokens per row
  prompt_lens: jax.Array  # int32[B]
  max_new: jax.Array  # int32[B] new-token limit per row
  cache: KVCache  # target KV cache, lengths == lengths - 1
  pstate: Any  # proposer state
  key: jax.Array
  done: jax.Array  # bool[B]
  finish: jax.Array  # int32[B] FINISH_*
  sampling: SamplingParams
  stats: Stats
  adapt: adaptive.AdaptState
  last_hidden: jax.Array  # [B, D] target hidden that predicted the last committed token
  step: jax.Array  # int32 scalar: verify steps so far
  done_step: jax.Array  # int32[B] step at which the row finished


# ---------------------------------------------------------------------------------------------------- prefill

@functools.partial(jax.jit, static_argnames=("config", "impl", "collect"), donate_argnames=("cache",))
def _prefill_chunk(params, chunk, start, cache, prompt_lens, last_hidden, *, config, impl, collect=False):
  B, C = chunk.shape
  positions = start + jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
  cache = cache.replace(lengths=jnp.full((B,), start, jnp.int32))
  _, hidden, cache = forward(params, chunk, positions, cache, config=config, impl=impl, compute_logits=False)
  idx = prompt_lens - 1 - start
  here = (idx >= 0) & (idx < C)
  h = jnp.take_along_axis(hidden, jnp.clip(idx, 0, C - 1)[:, None, None], axis=1)[:, 0]
  out = cache, jnp.where(here[:, None], h, last_hidden)
  return out + (hidden,) if collect else out


def prefill(params, tokens: jax.Array, prompt_lens: jax.Array, cache: KVCache, *, config: ModelConfig,
            impl: str = "xla", chunk: int = 512, return_all: bool = False):
  """Right-padded prompts [B, P] (P a multiple of `chunk`) -> (cache with lengths = prompt_lens, hidden[B, D]).

  With `return_all`, the hidden states of every prompt position [B, P, D] come back third (EAGLE reads them).
  """
  B, P = tokens.shape
  if P % chunk:
    raise ValueError(f"padded prompt length {P} is not a multiple of the prefill chunk {chunk}")
  last_hidden = jnp.zeros((B, config.d_model), params["final_norm"].dtype)
  every = []
  for start in range(0, P, chunk):
    out = _prefill_chunk(params, tokens[:, start:start + chunk], jnp.int32(start), cache, prompt_lens,
                         last_hidden, config=config, impl=impl, collect=return_all)
    cache, last_hidden = out[:2]
    every.extend(out[2:])
  cache = cache.replace(lengths=prompt_lens.astype(jnp.int32))
  if return_all:
    return cache, last_hidden, jnp.concatenate(every, axis=1)
  return cache, last_hidden


# ------------------------------------------------------------------------------------------------------- step

def _commit(state: DecodeState, spec: LoopSpec, out, n_acc):
  """Cut the verifier's output at stop tokens and the token limit, write it, and update done/finish."""
  B, T = out.shape
  active = ~state.done
  t = jnp.arange(T, dtype=jnp.int32)[None, :]
  n_emit = n_acc + 1
  is_stop = jnp.isin(out, jnp.asarray(spec.stop_ids or (-1,), jnp.int32)) & (t < n_emit[:, None])
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
  done_step = jnp.where(done & ~state.done, state.step + 1, state.done_step)
  return tokens, lengths, n_emit, finish, done, done_step


def spec_step(params, state: DecodeState, spec: LoopSpec, option: int) -> DecodeState:
  """One draft-verify-commit round for all rows, drafting k = spec.ks[option] tokens."""
  k = spec.ks[option]
  B = state.lengths.shape[0]
  active = ~state.done
  key, k_draft, k_verify = jax.random.split(state.key, 3)
  last = jnp.take_along_axis(state.tokens, (state.lengths - 1)[:, None], axis=1)  # [B, 1]
  pstate = state.pstate
  if k > 0:
    ctx = ProposeContext(state.tokens, state.lengths, state.sampling, state.last_hidden)
    draft, pstate = spec.proposer.propose(params["proposer"], pstate, ctx, k, k_draft)
    draft_tokens, draft_probs = draft.tokens.astype(jnp.int32), draft.probs
  else:
    draft_tokens, draft_probs = jnp.zeros((B, 0), jnp.int32), None
  feed = jnp.concatenate([last, jnp.maximum(draft_tokens, 0)], axis=1)  # no-draft slots feed a harmless 0
  positions = (state.lengths - 1)[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  logits, hidden, cache = forward(params["target"], feed, positions, state.cache, config=spec.config,
                                  impl=spec.impl)
  out, n_acc = verify_chain(logits, draft_tokens, draft_probs, k_verify, state.sampling)
  tokens, lengths, n_emit, finish, done, done_step = _commit(state, spec, out, n_acc)
  cache = cache.replace(lengths=state.cache.lengths + n_emit)
  pick = jnp.clip(n_emit - 1, 0, k)[:, None, None]
  new_hidden = jnp.take_along_axis(hidden, pick, axis=1)[:, 0]
  last_hidden = jnp.where((n_emit > 0)[:, None], new_hidden, state.last_hidden)

  pos = jnp.arange(k, dtype=jnp.int32)[None, :]
  stats = state.stats.record(active, draft_tokens >= 0, pos < n_acc[:, None], n_emit)
  adapt = adaptive.observe(state.adapt, option, k, active, n_acc)
  result = VerifyResult(out, n_acc, n_emit, lengths, hidden)
  pstate = spec.proposer.update(params["proposer"], pstate, result)
  return state.replace(tokens=tokens, lengths=lengths, cache=cache, pstate=pstate, key=key, done=done,
                       finish=finish, stats=stats, adapt=adapt, last_hidden=last_hidden, step=state.step + 1,
                       done_step=done_step)


def adaptive_step(params, state: DecodeState, spec: LoopSpec) -> DecodeState:
  if len(spec.ks) == 1:
    return spec_step(params, state, spec, 0)
  option = adaptive.choose(state.adapt, ~state.done, spec.ks, spec.probe_every)
  branches = [functools.partial(spec_step, spec=spec, option=i) for i in range(len(spec.ks))]
  return jax.lax.switch(option, branches, params, state)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def decode_loop(params, state: DecodeState, spec: LoopSpec) -> DecodeState:
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: adaptive_step(params, s, spec), state)


@functools.partial(jax.jit, static_argnames=("spec", "option"))
def _one_step(params, state, spec, option):
  return spec_step(params, state, spec, option)


# ------------------------------------------------------------------------------------------------- generate

@dataclasses.dataclass
class GenerationResult:
  token_ids: list  # list[list[int]] new tokens per prompt
  finish_reasons: list  # "stop" | "length"
  stats: dict  # summarize() over all real rows
  raw_stats: Stats  # the counters as numpy arrays, real rows only (for aggregating across batches)
  row_time_s: list  # per row: prefill plus the decode time until the row finished
  wall_s: float  # prefill + decode, excluding compile (the run is warmed unless warm=False)
  prefill_s: float
  decode_s: float
  steps: int
  option_uses: list  # steps taken with each k in ks
  ks: tuple
  costs: list


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _prefill_shape(max_prompt: int, chunk: int) -> tuple[int, int]:
  """(padded prompt length, chunk): powers of two below `chunk`, multiples of it above, so compiles stay few."""
  if max_prompt <= chunk:
    p = max(16, 1 << (max_prompt - 1).bit_length())
    return p, p
  return _round_up(max_prompt, chunk), chunk


_COST_CACHE: dict = {}


def measure_costs(params, make_state, batch: int, spec: LoopSpec, reps: int = 5) -> list:
  """Wall time of one step with each k in spec.ks, relative to the smallest: adaptive's cost model.

  `make_state()` builds a post-prefill state; it is only called (a prefill) when the costs are not cached.
  """
  # The ratio depends on the batch and dtype, hardly on the cache length: measure once per batch size.
  ckey = (spec, batch, params["target"]["final_norm"].dtype)
  if ckey in _COST_CACHE:
    return _COST_CACHE[ckey]
  state = make_state()
  for i in range(len(spec.ks)):
    jax.block_until_ready(_one_step(params, state, spec, i))  # compile
  # Round-robin and keep each option's best: a burst of other load then hits all options alike.
  times = [float("inf")] * len(spec.ks)
  for _ in range(reps):
    for i in range(len(spec.ks)):
      t0 = time.perf_counter()
      jax.block_until_ready(_one_step(params, state, spec, i).lengths)
      times[i] = min(times[i], time.perf_counter() - t0)
  costs = [t / times[0] for t in times]
  _COST_CACHE[ckey] = costs
  return costs


def generate(target_params, config: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens,
             sampling: Optional[SamplingParams] = None, proposer=NoneProposer(), proposer_params=None,
             adaptive_k: bool = True, costs: Optional[Sequence[float]] = None, stop_ids: Sequence[int] = (),
             seed: int = 0, impl: str = "xla", prefill_chunk: int = 512, probe_every: int = 16,
             warm: bool = True) -> GenerationResult:
  """Generate for a batch of token-id prompts (BOS included) of different lengths.

  `max_new_tokens` is an int or one per prompt. `stop_ids` add to the model's EOS ids. The batch is padded to
  at least 2 rows (a 1-row bfloat16 matmul is ~10x slower on XLA:CPU) and the padding rows never run.
  With `warm`, everything is compiled before the clock starts.
  """
  n = len(prompts)
  if n == 0:
    raise ValueError("no prompts given")
  lens = [len(p) for p in prompts]
  if min(lens) == 0:
    raise ValueError(f"prompt {lens.index(0)} is empty (it needs at least the BOS token)")
  max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (n,)).copy()
  if (max_new < 1).any():
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  ks = adaptive.option_set(proposer.k, adaptive_k)
  k_max = max(ks)
  need = max(l + m for l, m in zip(lens, max_new)) + k_max + 1
  if need > config.max_seq_len:
    worst = int(np.argmax([l + m for l, m in zip(lens, max_new)]))
    raise ValueError(f"prompt {worst} ({lens[worst]} tokens) plus {int(max_new[worst])} new tokens exceeds the "
                     f"model's context of {config.max_seq_len} tokens")
  sampling = sampling if sampling is not None else SamplingParams.make(n)
  if sampling.temperature.shape != (n,):
    raise ValueError(f"sampling params are for {sampling.temperature.shape[0]} rows, but there are {n} prompts")

  dtype = target_params["final_norm"].dtype  # activations and cache
  # XLA:CPU's 1-row bfloat16 dot is ~10x slow; float32 is fastest at 1 row (a matrix-vector product).
  any_bf16 = any(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(target_params))
  B = max(n, 2) if (any_bf16 and jax.default_backend() == "cpu") else n
  pad_rows = B - n
  P, chunk = _prefill_shape(max(lens), prefill_chunk)
  S = _round_up(max(P, need), 512)  # coarse buckets: each new S compiles the loop again
  buf = np.zeros((B, S), np.int32)
  for i, p in enumerate(prompts):
    buf[i, :len(p)] = p
  prompt_lens = np.array(lens + [lens[-1]] * pad_rows, np.int32)
  for i in range(n, B):
    buf[i] = buf[n - 1]
  max_new = np.concatenate([max_new, np.ones(pad_rows, np.int32)])
  sampling = jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], pad_rows)]), sampling)

  spec = LoopSpec(config=config, proposer=proposer, ks=ks,
                  stop_ids=tuple(sorted(set(config.eos_ids) | set(stop_ids))), impl=impl, probe_every=probe_every)
  params = {"target": target_params, "proposer": proposer_params if proposer_params is not None else {}}

  def start(max_new=max_new):
    cache = KVCache.init(config, B, S, dtype)
    prompts_dev, lens_dev = jnp.asarray(buf[:, :P]), jnp.asarray(prompt_lens)
    if getattr(proposer, "needs_prompt_hidden", False):  # EAGLE: hidden states of every prompt position
      cache, hidden, every = prefill(target_params, prompts_dev, lens_dev, cache, config=config, impl=impl,
                                     chunk=chunk, return_all=True)
      pstate0 = proposer.prefill(params["proposer"], prompts_dev, lens_dev, S, chunk, prompt_hidden=every)
    else:
      cache, hidden = prefill(target_params, prompts_dev, lens_dev, cache, config=config, impl=impl, chunk=chunk)
      pstate0 = (proposer.prefill(params["proposer"], prompts_dev, lens_dev, S, chunk)
                 if hasattr(proposer, "prefill") else None)
    return _start_state(params, spec, jnp.asarray(buf), lens_dev, jnp.asarray(max_new), cache, hidden, sampling,
                        jax.random.PRNGKey(seed), n, jnp.asarray(costs_now, jnp.float32), pstate0)

  def run(max_new=max_new):
    t0 = time.perf_counter()
    state = start(max_new)
    jax.block_until_ready(state.tokens)
    t1 = time.perf_counter()
    state = decode_loop(params, state, spec)
    jax.block_until_ready(state.tokens)
    return state, t1 - t0, time.perf_counter() - t1

  costs_now = list(costs) if costs is not None else [1.0 + 0.25 * k for k in ks]
  if len(ks) > 1 and costs is None:
    costs_now = measure_costs(params, start, B, spec)
  if warm:  # compile every program at these shapes; one new token per row keeps the warm-up short
    run(np.ones_like(max_new))
  state, prefill_s, decode_s = run()

  tokens, lengths = np.asarray(state.tokens), np.asarray(state.lengths)
  finish = np.asarray(state.finish)
  out = [tokens[i, lens[i]:lengths[i]].tolist() for i in range(n)]
  return GenerationResult(
      token_ids=out, finish_reasons=[FINISH_NAMES[int(f)] for f in finish[:n]],
      stats=summarize(state.stats, range(n)), raw_stats=jax.tree.map(lambda x: np.asarray(x)[:n], state.stats),
      row_time_s=[prefill_s + decode_s * int(d) / max(int(state.step), 1) for d in np.asarray(state.done_step)[:n]],
      wall_s=prefill_s + decode_s, prefill_s=prefill_s, decode_s=decode_s, steps=int(state.step),
      option_uses=np.asarray(state.adapt.uses).tolist(), ks=ks, costs=list(map(float, costs_now)))


@functools.partial(jax.jit, static_argnames=("spec", "n_real"))
def _start_state(params, spec: LoopSpec, buf, prompt_lens, max_new, cache, hidden, sampling, key, n_real, costs,
                 pstate0=None):
  """Sample the first token from the prefill hidden state and build the loop state."""
  B = buf.shape[0]
  key, k0 = jax.random.split(key)
  first = sample(k0, lm_head(params["target"], hidden), sampling)
  rows = jnp.arange(B)
  tokens = buf.at[rows, prompt_lens].set(first)
  lengths = prompt_lens + 1
  stop = jnp.isin(first, jnp.asarray(spec.stop_ids or (-1,), jnp.int32))
  is_pad = rows >= n_real
  hit_len = max_new <= 1
  finish = jnp.where(stop, FINISH_STOP, jnp.where(hit_len, FINISH_LENGTH, FINISH_NONE)).astype(jnp.int32)
  done = stop | hit_len | is_pad
  ctx = ProposeContext(tokens, lengths, sampling, hidden)
  if pstate0 is not None and hasattr(spec.proposer, "start"):  # a prefilled state learns the first token
    pstate0 = spec.proposer.start(params["proposer"], pstate0, ctx)
  state = DecodeState(
      tokens=tokens, lengths=lengths, prompt_lens=prompt_lens, max_new=max_new, cache=cache,
      pstate=pstate0 if pstate0 is not None else spec.proposer.init(params["proposer"], ctx), key=key, done=done, finish=finish, sampling=sampling,
      stats=Stats.zeros(B, spec.k_max), adapt=adaptive.AdaptState.init(B, costs), last_hidden=hidden,
      step=jnp.zeros((), jnp.int32), done_step=jnp.zeros((B,), jnp.int32))
  return state
