"""The batch API over the loop: prefill a batch of prompts into a fresh state (`start`), run `decode_loop` to the
end, and read each prompt's tokens, finish reason and counters (`result`); `generate` does all three.

The server instead fills and empties one slot at a time (`spec_jax.slots`); both run the same loop.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import adaptive, sharding, streams
from spec_jax.cache import KVCache
from spec_jax.config import ModelConfig, SamplingParams
from spec_jax.controls import Controls
from spec_jax.admit import prefill_rows
from spec_jax.decode import FINISH_NAMES, DecodeState, LoopSpec, decode_loop, make_spec
from spec_jax.prefill import DEFAULT_CHUNK, bucket
from spec_jax.proposers.base import NoneProposer
from spec_jax.stats import Stats, summarize


@dataclasses.dataclass
class GenerationResult:
  token_ids: list  # list[list[int]] new tokens per prompt
  finish_reasons: list  # "stop" | "length"
  stats: dict  # summarize() over all rows
  raw_stats: Stats  # the counters as numpy arrays, one row per prompt (for aggregating across batches)
  steps: int
  done_step: list  # per prompt: the loop step at which it finished
  option_uses: list  # steps taken with each k in ks
  ks: tuple


def check_fits(config: ModelConfig, prompt_len: int, max_new: int, k_max: int, capacity: Optional[int] = None,
               what: str = "prompt") -> None:
  """Host-side: the prompt, its new tokens and one step's k_max + 1 cache writes fit the context."""
  if prompt_len < 1:
    raise ValueError(f"{what} is empty (it needs at least the BOS token)")
  if max_new < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
  limit = config.max_seq_len if capacity is None else min(capacity, config.max_seq_len)
  if prompt_len + max_new + k_max + 1 > limit:
    raise ValueError(f"{what} ({prompt_len} tokens) plus {max_new} new tokens exceeds the context of {limit} "
                     f"tokens" + (f" (speculation needs {k_max + 1} more)" if k_max else ""))


def capacity_for(prompt_bucket: int, need: int) -> int:
  """Cache capacity in coarse buckets of 512: each new capacity compiles the loop again."""
  return -(-max(prompt_bucket, need) // 512) * 512


def start(params, spec: LoopSpec, prompts: Sequence[Sequence[int]], *, max_new_tokens,
          sampling: Optional[SamplingParams] = None, costs=None, seed: int = 0, num_slots: Optional[int] = None,
          prefill_chunk: int = DEFAULT_CHUNK, controls: Optional[Controls] = None,
          logprobs: Optional[tuple] = None, seeds: Optional[Sequence[int]] = None) -> DecodeState:
  """Prefill a batch of token-id prompts (BOS included) of different lengths into a fresh state.

  `max_new_tokens` is an int or one per prompt. Slots past the prompts (`num_slots` > len(prompts)) stay free.
  `costs`: the adaptive controller's step costs (see adaptive.AdaptState); None is the default model.
  `controls`: per-prompt sampling controls (spec_jax/controls.py), None: none. `logprobs`: (want, mode), one
  int each per prompt (spec_jax/logprobs.py; the spec's max_logprobs bounds want), None: no prompt asks.
  `seeds`: one per prompt, each row's random stream as a server request with that seed (spec_jax/streams.py);
  None: row i's stream is `seed`'s key folded with i (independent of every other seed's rows).
  """
  n = len(prompts)
  if n == 0:
    raise ValueError("no prompts given")
  B = num_slots or n
  if B < n:
    raise ValueError(f"num_slots={B} is fewer than the {n} prompts")
  B = sharding.pad_rows(B, spec.mesh)  # rows split evenly over the mesh's `data` axis
  config = spec.config
  lens = [len(p) for p in prompts]
  max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (n,)).copy()
  for i, (l, m) in enumerate(zip(lens, max_new)):
    check_fits(config, l, int(m), spec.lookahead, what=f"prompt {i}")
  sampling = sampling if sampling is not None else SamplingParams.make(n)
  if sampling.temperature.shape != (n,):
    raise ValueError(f"sampling params are for {sampling.temperature.shape[0]} rows, but there are {n} prompts")
  P, chunk = bucket(max(lens), prefill_chunk)
  S = capacity_for(P, max(l + int(m) for l, m in zip(lens, max_new)) + spec.lookahead + 1)
  buf = np.zeros((B, P), np.int32)
  for i, p in enumerate(prompts):
    buf[i, :len(p)] = p
  prompt_lens = np.array(lens + [1] * (B - n), np.int32)
  max_new = np.concatenate([max_new, np.ones(B - n, np.int32)])
  pad = lambda x: np.concatenate([np.asarray(x), np.repeat(np.asarray(x)[-1:], B - n, axis=0)])
  sampling = jax.tree.map(pad, sampling)
  controls = jax.tree.map(pad, controls if controls is not None else Controls.make(n))
  if controls.presence.shape != (B,):
    raise ValueError(f"controls are for {controls.presence.shape[0] - (B - n)} rows, but there are {n} prompts")
  params_t = params["target"]
  mesh = spec.mesh
  cache = init_cache(config, B, S, params_t["final_norm"].dtype, mesh, kv_dtype=spec.kv_cache_dtype)
  # Host inputs become arrays split over `data` (global arrays on a multi-host mesh; plain ones without a mesh).
  buf, prompt_lens, max_new, sampling, controls = sharding.rows((buf, prompt_lens, max_new, sampling, controls), mesh)
  costs = np.asarray(adaptive.default_costs(spec.ks) if costs is None else costs, np.float32)
  if seeds is None:
    keys = streams.batch_keys(seed, B)
  elif len(seeds) != n:
    raise ValueError(f"{len(seeds)} seeds for {n} prompts")
  else:
    keys = streams.seed_keys([int(x) for x in seeds] + [0] * (B - n))
  keys = sharding.rows(keys, mesh)
  costs = sharding.replicated(costs, mesh)
  draft_cap, live = sharding.rows((np.full((B,), spec.k_max, np.int32), np.arange(B) < n), mesh)
  if logprobs is not None:
    logprobs = sharding.rows(tuple(np.concatenate([np.asarray(a, np.int32), np.full(B - n, -1 if i == 0 else 0,
                                                                                     np.int32)])
                                   for i, a in enumerate(logprobs)), mesh)
  return prefill_rows(params, spec, jnp.asarray(buf), jnp.asarray(prompt_lens), jnp.asarray(max_new), sampling,
                      jnp.asarray(draft_cap), jnp.asarray(keys), cache, capacity=S, chunk=chunk,
                      live=jnp.asarray(live), costs=jnp.asarray(costs), controls=controls,
                      logprobs=None if logprobs is None else tuple(jnp.asarray(a) for a in logprobs))


def init_cache(config: ModelConfig, batch: int, capacity: int, dtype, mesh=None, kv_dtype: str = "auto") -> KVCache:
  """An empty target cache, created directly in its shards when there is a mesh (no full copy on one device)."""
  shards = sharding.axis_size(mesh, "data")
  make = lambda: KVCache.init(config, batch, capacity, dtype, shards=shards, kv_dtype=kv_dtype)
  if mesh is None:
    return make()
  return sharding.settle(jax.jit(make, out_shardings=sharding.state_shardings(jax.eval_shape(make), mesh))())


def result(state: DecodeState, n: int, spec: LoopSpec) -> GenerationResult:
  """Host-side: the first n rows' new tokens, finish reasons and counters (gathered from every host on a
  multi-host mesh, so each process gets the whole batch)."""
  host = sharding.to_host
  tokens, lengths = host(state.tokens), host(state.lengths)
  prompt_lens, finish = host(state.prompt_lens), host(state.finish)
  raw = jax.tree.map(lambda x: host(x)[:n], state.stats)
  return GenerationResult(
      token_ids=[tokens[i, prompt_lens[i]:lengths[i]].tolist() for i in range(n)],
      finish_reasons=[FINISH_NAMES[int(f)] for f in finish[:n]],
      stats=summarize(raw, range(n)), raw_stats=raw,
      steps=int(host(state.step)), done_step=host(state.done_step)[:n].tolist(),
      option_uses=host(state.adapt.uses).tolist(), ks=spec.ks)


def generate(target_params, config: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens,
             sampling: Optional[SamplingParams] = None, proposer=NoneProposer(), proposer_params=None,
             adaptive_k: bool = True, costs=None, stop_ids: Sequence[int] = (), seed: int = 0, impl: str = "xla",
             prefill_chunk: int = DEFAULT_CHUNK, probe_every: int = 16, num_slots: Optional[int] = None,
             mesh=None, controls: Optional[Controls] = None, kv_cache_dtype: str = "auto") -> GenerationResult:
  """Prefill plus the loop to the end: tokens, finish reasons and acceptance counters for each prompt.

  A seeded run is reproducible: nothing here reads a clock (the adaptive controller's step costs are an input).
  """
  spec = make_spec(config, proposer, adaptive_k=adaptive_k, stop_ids=stop_ids, impl=impl, probe_every=probe_every,
                   mesh=mesh, kv_cache_dtype=kv_cache_dtype)
  params = {"target": target_params, "proposer": proposer_params if proposer_params is not None else {}}
  params = sharding.shard_params(params, mesh)  # a no-op when already placed
  state = start(params, spec, prompts, max_new_tokens=max_new_tokens, sampling=sampling, costs=costs, seed=seed,
                num_slots=num_slots, prefill_chunk=prefill_chunk, controls=controls)
  state = decode_loop(params, state, spec)
  return result(state, len(prompts), spec)
