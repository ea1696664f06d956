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
- init writes the prompt pairs from the prompt's hidden states (`needs_prompt_hidden`), and the pending pair is
  (f of the last prompt token, the first sampled token).
The state has the same shape for every k, so adaptive speculation's branches agree.

EAGLE-3 features (`feature_layers`, e.g. a low, a middle and a high layer): the target feature of a committed
position is then the outputs of those target layers side by side [n * D] (the loop's `target_features`), each
RMS-normed with its own weight and fused by an FC (`fuse`, [n * D, D]) into the D-wide feature the layer reads.
A drafted position's feature is still the layer's own prediction (D wide), fed back unfused: EAGLE-3's
training-time test trains exactly that mix. A head without `fuse` reads the final-normed hidden state (EAGLE-1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax import kernels, scopes, sharding
from spec_jax.cache import KVCache
from spec_jax.config import ModelConfig
from spec_jax.models import transformer as tfm
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.proposers import vocab
from spec_jax.proposers import eagle3_layout, tree_expand
from spec_jax.proposers.base import PrefillOut
from spec_jax.rows import write_row
from spec_jax.proposers.tree_expand import DynamicTree
from spec_jax.proposers.chain import draft_chain


def layer_config(target: ModelConfig, mlp_dim: Optional[int] = None) -> ModelConfig:
  """The EAGLE layer: the target's layer conventions, one global layer, optionally a narrower MLP."""
  return target.replace(num_layers=1, mlp_dim=mlp_dim or target.mlp_dim, sliding_window=None,
                        name=f"{target.name}-eagle")


def param_shapes(cfg: ModelConfig, num_feature_layers: int = 0) -> dict:
  D = cfg.d_model
  layer = {k: v[1:] for k, v in tfm.param_shapes(cfg)["layers"].items()}
  out = {"fc": (2 * D, D), "feat_norm": (D,), "emb_norm": (D,), "out_norm": (D,), "layer": layer}
  if num_feature_layers:
    out.update(fuse=(num_feature_layers * D, D), fuse_norm=(num_feature_layers, D))
  return out


def check_feature_layers(layers, target: ModelConfig, where: str) -> tuple:
  layers = tuple(int(l) for l in layers)
  if any(not 0 <= l < target.num_layers for l in layers) or len(set(layers)) != len(layers):
    raise ValueError(f"{where}: feature layers {list(layers)} must be distinct target layers in "
                     f"[0, {target.num_layers})")
  return layers


def init_params(key, cfg: ModelConfig, dtype=jnp.float32, target_params: Optional[dict] = None,
                num_feature_layers: int = 0) -> dict:
  """Random layer (the transformer's init) and an FC that starts as the sum of both inputs' halves; with feature
  layers, a fusing FC that starts as their mean."""
  k1, k2, k3 = jax.random.split(key, 3)
  stacked = tfm.init_params(cfg, k1, dtype)["layers"]
  D = cfg.d_model
  fc = jnp.concatenate([jnp.eye(D), jnp.eye(D)], 0) * 0.5 + 0.02 * jax.random.normal(k2, (2 * D, D))
  out_norm = (target_params["final_norm"] if target_params is not None else jnp.ones((D,)))
  out = {"fc": fc.astype(dtype), "feat_norm": jnp.ones((D,), dtype), "emb_norm": jnp.ones((D,), dtype),
         "out_norm": jnp.asarray(out_norm, dtype), "layer": jax.tree.map(lambda x: x[0], stacked)}
  if num_feature_layers:
    n = num_feature_layers
    fuse = jnp.tile(jnp.eye(D), (n, 1)) / n + 0.02 * jax.random.normal(k3, (n * D, D))
    out.update(fuse=fuse.astype(dtype), fuse_norm=jnp.ones((n, D), dtype))
  return out


def fuse_features(params: dict, cfg: ModelConfig, feats):
  """EAGLE-3: target layer outputs side by side [..., n * D] -> [..., D]: each RMS-normed with its own weight
  (the residual stream's scale grows with depth), then the fusing FC."""
  n = params["fuse_norm"].shape[0]
  D = cfg.d_model
  parts = feats.astype(params["fuse"].dtype).reshape(feats.shape[:-1] + (n, D))
  parts = tfm.rms_norm(parts, params["fuse_norm"], cfg.norm_eps)
  return tfm.dot("...f,fd->...d", parts.reshape(feats.shape[:-1] + (n * D,)), params["fuse"])


def layer_input(params: dict, cfg: ModelConfig, feats, toks):
  """FC over [rms_norm(feature) ; rms_norm(embedding(token))]: the decoder layer's input [B, T, D]. A feature
  wider than D is a committed position's fused target layers (EAGLE-3), fused first."""
  # The target's embedding (and scale), in the EAGLE layer's dtype.
  e = tfm.embed({"embed": params["embed"], "final_norm": params["out_norm"]}, toks, cfg).astype(params["fc"].dtype)
  if feats.shape[-1] != cfg.d_model:
    feats = fuse_features(params, cfg, feats)
  f = tfm.rms_norm(feats.astype(e.dtype), params["feat_norm"], cfg.norm_eps)
  e = tfm.rms_norm(e, params["emb_norm"], cfg.norm_eps)
  return tfm.dot("btd,de->bte", jnp.concatenate([f, e], axis=-1), params["fc"])


@dataclasses.dataclass(frozen=True)
class Published:
  """A head in a published layout (spec_jax/checkpoints/published.py loads them), computing that layout's forward
  exactly; None on the proposer is this project's own layout (above).
  - kind "eagle1" (EAGLE-1/2 as its authors publish it, speculators' EAGLE/HASS): x = fc([embedding; feature])
    (+ bias), one decoder layer whose attention reads x without an input norm; x is fed back as it is and
    projected by the target's head. `layernorms` (speculators): the embedding through `emb_norm` first, the
    layer's own input norm, and `out_norm` before the head.
  - kind "eagle3" (SafeAILab / SpecForge / speculators): a committed position's feature is the aux layers side by
    side through `fuse` (after per-part norms when `fuse_norm` is present); the layer's attention reads
    [input_layernorm(embedding); hidden_norm(h)] (2 D wide) and its residual is h (hidden_norm(h) with
    `norm_before_residual`); the output is fed back before the final norm (after it with `norm_output`), and the
    draft logits are lm_head(norm(output)) over the draft vocabulary."""
  kind: str
  norm_before_residual: bool = False
  norm_output: bool = False
  layernorms: bool = False


def _embed(params: dict, cfg: ModelConfig, toks, dtype):
  return tfm.embed({"embed": params["embed"], "final_norm": jnp.zeros((), dtype)}, toks, cfg).astype(dtype)


def cache_read(cache: KVCache, impl: str, mesh=None):
  """What the head's attention reads: (pool k, pool v, page table, an 8-bit pool's (k_scale, v_scale) or None) for
  a kernel that reads pages, else each row's pages gathered and dequantized ([B, Hkv, S, D] each, no table)."""
  if kernels.reads_pages(impl, cache.block_size):
    return cache.k, cache.v, cache.pages, tfm.pool_scales(cache)
  return (*cache.layer_view(jnp.int32(0), mesh), None, None)


def layer_step(params: dict, cfg: ModelConfig, feats, toks, positions, k_cache, v_cache, lengths, *,
               published: Optional[Published] = None, impl: str = "xla", tree_mask=None, mesh=None, pages=None,
               kv_dtype: str = "auto", kv_scales=None):
  """The head's layer over (feature, token) pairs -> (the layer's output x [B, T, D], k_new, v_new). With
  `pages`, k_cache/v_cache are the head's page pools (cache_read), kv_scales their scales if 8-bit; kv_dtype: the
  head cache's."""
  run = functools.partial(tfm.decoder_layer, cfg, p=params["layer"], k_cache=k_cache, v_cache=v_cache,
                          layer=None if pages is None else jnp.int32(0), pages=pages, window=jnp.int32(0),
                          base=jnp.float32(cfg.rope_base),
                          positions=positions, lengths=lengths, impl=impl, tree_mask=tree_mask, mesh=mesh,
                          kv_dtype=kv_dtype, kv_scales=kv_scales)
  x, attn_in = layer_inputs(params, cfg, feats, toks, published)
  # fc and fuse are split over 'model' on their output features (param_axes): gather their products back to the
  # table's row layout here, or the split reaches the layer's output and through it the loop's carried features.
  x, attn_in = sharding.constrain_state((x, attn_in), mesh)
  return run(x, attn_input=attn_in)


def layer_inputs(params: dict, cfg: ModelConfig, feats, toks, published: Optional[Published] = None):
  """(feature, token) pairs -> (the layer's residual input x, what its q/k/v read: None = attn_norm(x)). The one
  input computation of each layout, shared by drafting (layer_step) and training (train/losses.py)."""
  if published is None:
    return layer_input(params, cfg, feats, toks), None
  dtype = params["layer"]["q"].dtype
  e = _embed(params, cfg, toks, dtype)
  if published.kind == "eagle1":
    if published.layernorms:
      e = tfm.rms_norm(e, params["emb_norm"], cfg.norm_eps)
    x = tfm.dot("btd,de->bte", jnp.concatenate([e, feats.astype(dtype)], axis=-1), params["fc"])
    if "fc_bias" in params:
      x = x + params["fc_bias"].astype(x.dtype)
    return (x, None) if published.layernorms else (x, x)
  h = feats.astype(dtype)
  if h.shape[-1] != cfg.d_model:  # a committed position: the aux layers, fused
    if "fuse_norm" in params:
      h = fuse_features(params, cfg, h)
    else:
      h = tfm.dot("...f,fd->...d", h, params["fuse"])
  hn = tfm.rms_norm(h, params["layer"]["hidden_norm"], cfg.norm_eps)
  attn_in = jnp.concatenate([tfm.rms_norm(e, params["layer"]["attn_norm"], cfg.norm_eps), hn], axis=-1)
  return (hn if published.norm_before_residual else h), attn_in


def out_feature(params: dict, cfg: ModelConfig, x, published: Optional[Published] = None):
  """The layer's output -> the feature fed back at the next drafted position."""
  if published is None or (published.kind == "eagle3" and published.norm_output):
    return tfm.rms_norm(x, params["out_norm"], cfg.norm_eps)
  return x


def head_logits(params: dict, cfg: ModelConfig, feat, published: Optional[Published] = None):
  """A fed-back feature -> float32 draft logits over the draft vocabulary (params["rows"])."""
  if published is not None and ((published.kind == "eagle3" and not published.norm_output) or published.layernorms):
    feat = tfm.rms_norm(feat, params["out_norm"], cfg.norm_eps)
  with scopes.scope(scopes.LM_HEAD):
    return vocab.project(feat, params["rows"])


def eagle_forward(params: dict, cfg: ModelConfig, feats, toks, positions, cache: KVCache, impl: str = "xla",
                  mesh=None, published: Optional[Published] = None):
  """feats [B, T, D], toks [B, T] at positions [B, T], written at cache.lengths .. ->
  (predicted features [B, T, D] (what is fed back: final-normed in this project's layout, in the target's
  feature space), cache with the new K/V).

  params needs "embed" (the target's frozen token embedding, or a published head's own) beside the EAGLE weights.
  """
  kc, vc, pages, scales = cache_read(cache, impl, mesh)
  x, k_new, v_new = layer_step(params, cfg, feats, toks, positions, kc, vc, cache.lengths,
                               published=published, impl=impl, mesh=mesh, pages=pages, kv_dtype=cache.kv_dtype,
                               kv_scales=scales)
  # The rows are written after the layer has read the cache: with nothing ordering the attention call and the
  # row loop, XLA:GPU's copy insertion copied the whole cache around the loop (7 copies a step on an H200).
  x, pools = jax.lax.optimization_barrier((x, cache.pools()))
  cache = cache.with_pools(pools).write(k_new[None], v_new[None], mesh)
  return out_feature(params, cfg, x, published), cache


@struct.dataclass
class EagleState:
  """cache: the EAGLE layer's KVCache (k, v [1, B, S, Hkv, D]; lengths int32[B] = L - 2 after update);
  pend_feat [B, D] the feature f_{L-2}; pend_tok int32[B] the token tokens[L-1]."""

  cache: KVCache
  pend_feat: jax.Array
  pend_tok: jax.Array


@dataclasses.dataclass(frozen=True)
class EagleProposer:
  config: ModelConfig  # the EAGLE layer's config (layer_config(target))
  vocab_size: int
  k: int = 4
  reduced: bool = False
  impl: str = "xla"
  name: str = "eagle"
  tree: Optional[DynamicTree] = None  # EAGLE-2 dynamic trees (k = tree.depth); None: chains
  feature_layers: tuple = ()  # EAGLE-3: the target layers it reads, fused; () = the final-normed hidden
  mesh: Any = None  # set by the loop (LoopSpec): where a Pallas kernel runs per shard
  published: Optional[Published] = None  # a published layout's forward; None: this project's
  needs_prompt_hidden: ClassVar[bool] = True

  def __post_init__(self):
    if self.tree is not None and self.k != self.tree.depth:
      raise ValueError(f"an EAGLE tree of depth {self.tree.depth} drafts k = {self.tree.depth}, got k={self.k}")

  def init(self, params, prefill: PrefillOut, capacity: int) -> EagleState:
    """Pairs (f_t, tok_{t+1}) for every prompt position at slots t (cache.lengths = prompt_lens - 1); the pending
    pair is the last prompt token's feature with the first sampled token."""
    prompt, lens, hidden = prefill.prompt_tokens, prefill.prompt_lens, prefill.prompt_hidden
    B, P = prompt.shape
    dtype = params["layer"]["q"].dtype
    off = jnp.zeros((B,), jnp.int32) if prefill.offsets is None else prefill.offsets
    cache = prefill.cache_for(self.config, dtype, capacity).replace(lengths=off)
    nxt = jnp.concatenate([prompt[:, 1:], jnp.zeros((B, 1), prompt.dtype)], axis=1)
    pos = off[:, None] + jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    _, cache = eagle_forward(params, self.config, hidden, nxt, pos, cache, impl=self.impl, mesh=self.mesh,
                             published=self.published)
    last = jnp.take_along_axis(hidden, (lens - 1 - off)[:, None, None], axis=1)[:, 0]
    first = jnp.take_along_axis(prefill.tokens, (prefill.lengths - 1)[:, None], axis=1)[:, 0]
    return EagleState(cache=cache.replace(lengths=(lens - 1).astype(jnp.int32)), pend_feat=last.astype(dtype),
                      pend_tok=first.astype(jnp.int32))

  def insert(self, state: EagleState, slot, row: EagleState) -> EagleState:
    return EagleState(cache=state.cache.insert_row(row.cache, slot),
                      pend_feat=write_row(state.pend_feat, row.pend_feat, slot),
                      pend_tok=write_row(state.pend_tok, row.pend_tok, slot))

  def propose(self, params, state: EagleState, ctx, k, key):
    d2t = params.get("d2t")
    run = functools.partial(eagle_forward, params, self.config, impl=self.impl, mesh=self.mesh,
                            published=self.published)
    cache = state.cache.replace(lengths=ctx.lengths - 2)
    # The pending pair, read from ctx (identical to the state's after update).
    tok0 = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)
    feat, cache = run(ctx.last_hidden[:, None], tok0, cache.lengths[:, None], cache)

    def draw(carry, key):
      logits = head_logits(params, self.config, carry[0], self.published)
      with scopes.scope(scopes.SAMPLING):
        return vocab.draw(key, logits, ctx.sampling, d2t, self.vocab_size)

    def advance(carry, tok):
      feat, cache = carry
      cache = cache.replace(lengths=cache.lengths + 1)
      nxt, cache = run(feat[:, None], tok[:, None], cache.lengths[:, None], cache)
      return nxt[:, 0], cache

    draft, (_, cache) = draft_chain(draw, advance, (feat[:, 0], cache), key, k)
    return draft, state.replace(cache=cache)

  def propose_tree(self, params, state: EagleState, ctx, key):
    """EAGLE-2: the pending pair's forward predicts f_{L-1} (its children are depth 1); an expansion feeds each
    frontier node as the pair (its parent's predicted feature, its token) at slot L - 2 + depth, under the tree
    mask, without writing the cache (tree_expand.grow)."""
    d2t = params.get("d2t")
    cache = state.cache.replace(lengths=ctx.lengths - 2)
    tok0 = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)
    feat, cache = eagle_forward(params, self.config, ctx.last_hidden[:, None], tok0, cache.lengths[:, None], cache,
                                impl=self.impl, mesh=self.mesh, published=self.published)
    cache = cache.replace(lengths=ctx.lengths - 1)
    def logp(f):
      with scopes.scope(scopes.LM_HEAD):
        return jax.nn.log_softmax(head_logits(params, self.config, f, self.published), axis=-1)
    kc, vc, pages, scales = cache_read(cache, self.impl, self.mesh)  # read once for every expansion

    def score(tokens, parent_feat, depths, mask):
      x, _, _ = layer_step(params, self.config, parent_feat, tokens, (ctx.lengths - 2)[:, None] + depths, kc,
                           vc, cache.lengths, published=self.published, impl=self.impl, tree_mask=mask, pages=pages,
                           mesh=self.mesh, kv_dtype=cache.kv_dtype, kv_scales=scales)
      out = out_feature(params, self.config, x, self.published)
      return logp(out[:, -self.tree.topk:]), out  # the head over the frontier alone: grow reads only its logp

    to_target = None if d2t is None else (lambda i: jnp.take(d2t, i))
    # The state keeps the cache just written (update rewrites from slot L - 2 on, that pair included): keeping the
    # old one made XLA copy the whole cache every step, to hold both.
    return tree_expand.grow(logp(feat[:, 0]), feat[:, 0], score, self.tree, to_target), state.replace(cache=cache)

  def update(self, params, state: EagleState, result):
    e = result.emitted
    L = result.new_lengths - e  # lengths before this step
    T = result.tokens.shape[1] + 1
    feats = jnp.concatenate([state.pend_feat[:, None].astype(result.hidden.dtype), result.hidden], axis=1)
    toks = jnp.concatenate([state.pend_tok[:, None], result.tokens], axis=1)
    pos = (L - 2)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    _, cache = eagle_forward(params, self.config, feats, toks, pos, state.cache.replace(lengths=L - 2),
                             impl=self.impl, mesh=self.mesh, published=self.published)
    last = jnp.clip(e - 1, 0, T - 2)
    new_feat = jnp.take_along_axis(result.hidden, last[:, None, None], axis=1)[:, 0]
    new_tok = jnp.take_along_axis(result.tokens, last[:, None], axis=1)[:, 0]
    live = e > 0
    return EagleState(
        cache=cache.replace(lengths=result.new_lengths - 2),
        pend_feat=jnp.where(live[:, None], new_feat.astype(state.pend_feat.dtype), state.pend_feat),
        pend_tok=jnp.where(live, new_tok, state.pend_tok).astype(jnp.int32))


def runtime_params(weights: dict, target_params: dict, d2t: Optional[jax.Array] = None) -> dict:
  """The trained weights plus the target's frozen embedding and output rows."""
  out = dict(weights, embed=target_params["embed"], rows=vocab.output_rows(target_params, d2t))
  if d2t is not None:
    out["d2t"] = jnp.asarray(d2t, jnp.int32)
  return out


def load_eagle(path: str, target_config: ModelConfig, target_params: dict, k: int, impl: str = "xla",
               tree: Optional[DynamicTree] = None):
  dtype = target_params["final_norm"].dtype
  meta, weights, d2t = head_ckpt.load_heads(path, target_config, "eagle", dtype)
  layers = check_feature_layers(meta.get("feature_layers") or (), target_config, path)
  if meta.get("head_layout") == eagle3_layout.LAYOUT:  # trained in the published EAGLE-3 layout
    cfg = eagle3_layout.layer_config(target_config, int(meta["mlp_dim"]))
    head_ckpt.check_shapes(weights, eagle3_layout.param_shapes(cfg, len(layers)), path)
    proposer = EagleProposer(config=cfg, vocab_size=target_config.vocab_size, k=k, reduced=d2t is not None,
                             impl=impl, tree=tree, feature_layers=layers, published=Published(eagle3_layout.LAYOUT))
    return proposer, runtime_params(weights, target_params, d2t)
  cfg = layer_config(target_config, int(meta.get("mlp_dim", target_config.mlp_dim)))
  if ("fuse" in weights) != bool(layers):
    raise ValueError(f"{path}: its metadata says feature layers {list(layers)} (EAGLE-{3 if layers else 1} "
                     f"features) but its weights {'have no' if layers else 'have a'} fusing FC: a head trained "
                     "for another feature layout")
  head_ckpt.check_shapes(weights, param_shapes(cfg, len(layers)), path)
  proposer = EagleProposer(config=cfg, vocab_size=target_config.vocab_size, k=k, reduced=d2t is not None,
                           impl=impl, tree=tree, feature_layers=layers)
  return proposer, runtime_params(weights, target_params, d2t)
