"""EAGLE (chain): one decoder layer over [target feature_t ; embedding(token_{t+1})], then the frozen LM head.

Features are the target's final-normed hidden states (what its LM head reads). The pair (f_t, tok_{t+1}) sits at
slot/position t of the EAGLE layer's own KV cache; its output, after `out_norm`, is the predicted feature f_{t+1},
whose projection drafts token t+2. While drafting, each predicted feature is fed back with the token drafted
from it.

Cache bookkeeping, zero-copy like the draft model's: with L = lengths, the EAGLE cache is trusted for slots
0..L-3 (cache.lengths = L-2) and the state holds the pending pair (f_{L-2}, tok_{L-1}) for slot L-2.
- propose feeds the pending pair at L-2, then its own (feature, draft) pairs at L-1 .. ; all of them are stale
  once the step is verified.
- update feeds the pending pair and the k+1 verified pairs (hidden[:, j], out[:, j]) at slots L-2 .. L+k-1,
  overwriting the stale drafts, and keeps cache.lengths = new L - 2; the pair of the last committed token
  becomes the new pending pair. Slots past a row's length are stale and overwritten later, nothing is copied.
- prefill writes the prompt pairs from the prompt's hidden states (decode.py passes them when
  `needs_prompt_hidden`); `start` fills in the first sampled token of the pending pair.
The state has the same shape for every k, so adaptive speculation's branches agree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax.cache import KVCache
from spec_jax.config import ModelConfig
from spec_jax.models import transformer as tfm
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.proposers import vocab
from spec_jax.proposers.base import Draft


def layer_config(target: ModelConfig, mlp_dim: Optional[int] = None) -> ModelConfig:
  """The EAGLE layer: the target's layer conventions, one global layer, optionally a narrower MLP."""
  return target.replace(num_layers=1, mlp_dim=mlp_dim or target.mlp_dim, sliding_window=None,
                        name=f"{target.name}-eagle")


def param_shapes(cfg: ModelConfig) -> dict:
  D = cfg.d_model
  layer = {k: v[1:] for k, v in tfm.param_shapes(cfg)["layers"].items()}
  return {"fc": (2 * D, D), "feat_norm": (D,), "emb_norm": (D,), "out_norm": (D,), "layer": layer}


def init_params(key, cfg: ModelConfig, dtype=jnp.float32, target_params: Optional[dict] = None) -> dict:
  """Random layer (the transformer's init) and an FC that starts as the sum of both inputs' halves."""
  k1, k2 = jax.random.split(key)
  stacked = tfm.init_params(cfg, k1, dtype)["layers"]
  D = cfg.d_model
  fc = jnp.concatenate([jnp.eye(D), jnp.eye(D)], 0) * 0.5 + 0.02 * jax.random.normal(k2, (2 * D, D))
  out_norm = (target_params["final_norm"] if target_params is not None else jnp.ones((D,)))
  return {"fc": fc.astype(dtype), "feat_norm": jnp.ones((D,), dtype), "emb_norm": jnp.ones((D,), dtype),
          "out_norm": jnp.asarray(out_norm, dtype), "layer": jax.tree.map(lambda x: x[0], stacked)}


def layer_input(params: dict, cfg: ModelConfig, feats, toks):
  """FC over [rms_norm(feature) ; rms_norm(embedding(token))]: the decoder layer's input [B, T, D]."""
  # The target's embedding (and scale), in the EAGLE layer's dtype.
  e = tfm.embed({"embed": params["embed"], "final_norm": params["out_norm"]}, toks, cfg).astype(params["fc"].dtype)
  f = tfm.rms_norm(feats.astype(e.dtype), params["feat_norm"], cfg.norm_eps)
  e = tfm.rms_norm(e, params["emb_norm"], cfg.norm_eps)
  return tfm._dot("btd,de->bte", jnp.concatenate([f, e], axis=-1), params["fc"])


def eagle_forward(params: dict, cfg: ModelConfig, feats, toks, positions, cache: KVCache, impl: str = "xla"):
  """feats [B, T, D], toks [B, T] at positions [B, T], written at cache.lengths .. ->
  (predicted features [B, T, D] (final-normed, in the target's feature space), cache with the new K/V).

  params needs "embed" (the target's frozen token embedding) beside the EAGLE weights.
  """
  x = layer_input(params, cfg, feats, toks)
  x, k_new, v_new = tfm._layer(cfg, impl, x, params["layer"], cache.k[0], cache.v[0], jnp.int32(0),
                               jnp.float32(cfg.rope_base), positions, cache.lengths)
  cache = cache.replace(k=tfm.write_rows(cache.k, k_new[None], cache.lengths),
                        v=tfm.write_rows(cache.v, v_new[None], cache.lengths))
  return tfm.rms_norm(x, params["out_norm"], cfg.norm_eps), cache


@struct.dataclass
class EagleState:
  cache: KVCache  # one layer; lengths = L - 2 after update
  pend_feat: jax.Array  # [B, D] f_{L-2}
  pend_tok: jax.Array  # int32[B] tokens[L-1]


@dataclasses.dataclass(frozen=True)
class EagleProposer:
  config: ModelConfig  # the EAGLE layer's config (layer_config(target))
  vocab_size: int
  k: int = 4
  reduced: bool = False
  impl: str = "xla"
  name: str = "eagle"
  needs_prompt_hidden: bool = True

  def prefill(self, params, prompt_tokens, prompt_lens, max_len: int, chunk: int, prompt_hidden=None):
    if prompt_hidden is None:
      raise ValueError("the eagle proposer needs the prompt's hidden states")
    return _prefill(self, params, prompt_tokens, prompt_lens, prompt_hidden, max_len)

  def start(self, params, state: EagleState, ctx):
    """After the first token is sampled: it completes the pending pair."""
    tok = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)[:, 0]
    return state.replace(pend_tok=tok.astype(jnp.int32))

  def init(self, params, ctx):
    raise AssertionError("EagleProposer state comes from prefill()")

  def propose(self, params, state: EagleState, ctx, k, key):
    B = ctx.lengths.shape[0]
    d2t = params.get("d2t")
    run = functools.partial(eagle_forward, params, self.config, impl=self.impl)
    cache = state.cache.replace(lengths=ctx.lengths - 2)
    # The pending pair, read from ctx (identical to the state's after update).
    tok0 = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)
    feat, cache = run(ctx.last_hidden[:, None], tok0, cache.lengths[:, None], cache)
    keys = jax.random.split(key, k)

    def draw(feat, key):
      return vocab.draw(key, vocab.project(feat, params["rows"]), ctx.sampling, d2t, self.vocab_size)

    def step(carry, key):
      feat, cache = carry
      tok, q = draw(feat, key)
      cache = cache.replace(lengths=cache.lengths + 1)
      nxt, cache = run(feat[:, None], tok[:, None], cache.lengths[:, None], cache)
      return (nxt[:, 0], cache), (tok, q)

    (feat, cache), (toks, qs) = jax.lax.scan(step, (feat[:, 0], cache), keys[:k - 1])
    last_tok, last_q = draw(feat, keys[k - 1])
    tokens = jnp.concatenate([toks.T.reshape(B, k - 1), last_tok[:, None]], axis=1)
    probs = jnp.concatenate([jnp.swapaxes(qs, 0, 1), last_q[:, None]], axis=1)
    return Draft(tokens=tokens, probs=probs), state.replace(cache=cache)

  def update(self, params, state: EagleState, result):
    e = result.emitted
    L = result.new_lengths - e  # lengths before this step
    T = result.tokens.shape[1] + 1
    feats = jnp.concatenate([state.pend_feat[:, None].astype(result.hidden.dtype), result.hidden], axis=1)
    toks = jnp.concatenate([state.pend_tok[:, None], result.tokens], axis=1)
    pos = (L - 2)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    _, cache = eagle_forward(params, self.config, feats, toks, pos, state.cache.replace(lengths=L - 2),
                             impl=self.impl)
    last = jnp.clip(e - 1, 0, T - 2)
    new_feat = jnp.take_along_axis(result.hidden, last[:, None, None], axis=1)[:, 0]
    new_tok = jnp.take_along_axis(result.tokens, last[:, None], axis=1)[:, 0]
    live = e > 0
    return EagleState(
        cache=cache.replace(lengths=result.new_lengths - 2),
        pend_feat=jnp.where(live[:, None], new_feat.astype(state.pend_feat.dtype), state.pend_feat),
        pend_tok=jnp.where(live, new_tok, state.pend_tok).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("proposer", "max_len"))
def _prefill(proposer: EagleProposer, params, prompt_tokens, prompt_lens, prompt_hidden, max_len):
  """Pairs (f_t, tok_{t+1}) for every prompt position at slots t; cache.lengths = prompt_lens - 1."""
  B, P = prompt_tokens.shape
  cfg = proposer.config
  dtype = params["fc"].dtype
  cache = KVCache.init(cfg, B, max_len, dtype)
  nxt = jnp.concatenate([prompt_tokens[:, 1:], jnp.zeros((B, 1), prompt_tokens.dtype)], axis=1)
  pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  _, cache = eagle_forward(params, cfg, prompt_hidden, nxt, pos, cache, impl=proposer.impl)
  last = jnp.take_along_axis(prompt_hidden, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
  return EagleState(cache=cache.replace(lengths=(prompt_lens - 1).astype(jnp.int32)),
                    pend_feat=last.astype(dtype), pend_tok=jnp.zeros((B,), jnp.int32))


def runtime_params(weights: dict, target_params: dict, d2t: Optional[jax.Array] = None) -> dict:
  """The trained weights plus the target's frozen embedding and output rows."""
  out = dict(weights, embed=target_params["embed"], rows=vocab.output_rows(target_params, d2t))
  if d2t is not None:
    out["d2t"] = jnp.asarray(d2t, jnp.int32)
  return out


def load_eagle(path: str, target_config: ModelConfig, target_params: dict, k: int, impl: str = "xla"):
  dtype = target_params["final_norm"].dtype
  meta, weights, d2t = head_ckpt.load_heads(path, target_config, "eagle", dtype)
  cfg = layer_config(target_config, int(meta.get("mlp_dim", target_config.mlp_dim)))
  head_ckpt.check_shapes(weights, param_shapes(cfg), path)
  proposer = EagleProposer(config=cfg, vocab_size=target_config.vocab_size, k=k, reduced=d2t is not None,
                           impl=impl)
  return proposer, runtime_params(weights, target_params, d2t)
