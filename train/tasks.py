"""What a training run fits: the task (frozen-target features, the loss), the initial trainable params and the
frozen pytree, for each head kind (medusa, eagle (EAGLE-1 and EAGLE-3), draft). train.main runs it; serve.aot
compiles its step from shapes alone."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.proposers import eagle, eagle3_layout, medusa, vocab
from spec_jax.proposers.draft import early_exit_params
from train import losses
from train.trainer import Task


def build_task(cfg, config, params, d2t):
  """-> (Task, initial trainable params, frozen pytree, export meta)."""
  key = jax.random.PRNGKey(cfg.train.seed)
  layers = tuple(cfg.feature_layers) if cfg.kind == "eagle" else ()
  if layers:
    eagle.check_feature_layers(layers, config, "config.feature_layers")
  # The feature pass computes [final hidden; cached layers] and the loss reads the first (1 + len(layers)) D
  # columns, so runs of every kind share one cache (an EAGLE-1 or Medusa run reads an EAGLE-3 run's features).
  cached = tuple(cfg.cached_feature_layers) or layers
  if cached:
    eagle.check_feature_layers(cached, config, "config.cached_feature_layers")
  if cached[:len(layers)] != layers:
    raise ValueError(f"config.feature_layers {list(layers)} must begin config.cached_feature_layers "
                     f"{list(cached)}: the loss reads a column prefix of the cached features")
  width = config.d_model * (1 + len(layers))
  features = lambda frozen, toks: losses.target_features(frozen["target"], config, toks, cached)
  # What the features are: the target's final-normed hidden states (and EAGLE-3's layers), of this target in
  # this dtype.
  features_id = (f"target_features:{config.name}:{cfg.model}:{cfg.dtype}:{cfg.tiny_seed}" +
                 (f":layers{list(cached)}" if cached else ""))

  def task_of(name, loss):  # loss(params, frozen, features, tokens, mask, key) on its own columns
    return Task(name, features, lambda p, fz, f, t, m, k: loss(p, fz, f[..., :width], t, m, k), features_id)
  rows = vocab.output_rows(params, None if d2t is None else jnp.asarray(d2t))
  if cfg.kind == "medusa":
    frozen = {"target": params, "rows": rows}
    if d2t is not None:
      frozen["t2d"] = jnp.asarray(head_ckpt.t2d(d2t, config.vocab_size))
    init = medusa.init_params(key, config.d_model, cfg.num_heads, jnp.float32)
    task = task_of("medusa", lambda p, fz, f, t, m, k: losses.medusa_loss(p, fz, f, t, m))
    return task, init, frozen, {"num_heads": cfg.num_heads}
  if cfg.kind == "eagle":
    layout = cfg.get("head_layout", "ours")
    frozen = {"target": params, "embed": params["embed"], "rows": rows}
    extra, published = {}, None
    if layout == "ours":
      ecfg = eagle.layer_config(config, cfg.mlp_dim or None)
      init = eagle.init_params(key, ecfg, jnp.float32, target_params=params, num_feature_layers=len(layers))
    elif layout == eagle3_layout.LAYOUT:  # the published EAGLE-3 layout: exported exactly (train/export_eagle3.py)
      if len(layers) < 2 or cfg.reg_weight:
        raise ValueError(f"head_layout='eagle3' needs 2 or more feature_layers (got {list(layers)}) and "
                         f"reg_weight=0 (its fed-back feature is not the target's; got {cfg.reg_weight})")
      ecfg = eagle3_layout.layer_config(config, cfg.mlp_dim or None)
      init = eagle3_layout.init_params(key, ecfg, len(layers), params)
      extra, published = {"head_layout": layout}, eagle.Published(layout)
    else:
      raise ValueError(f"head_layout must be 'ours' or 'eagle3', got {layout!r}")
    loss = functools.partial(losses.eagle_loss, cfg=ecfg, noise=cfg.noise, reg_weight=cfg.reg_weight,
                             ce_weight=cfg.ce_weight, passes=cfg.ttt_passes, published=published)
    task = task_of("eagle", lambda p, fz, f, t, m, k: loss(p, fz, f, t, m, key=k))
    return task, init, frozen, {"mlp_dim": ecfg.mlp_dim, "ttt_passes": cfg.ttt_passes,
                                "feature_layers": list(layers), **extra}
  if cfg.kind == "draft":
    if not 1 <= cfg.draft_layers < config.num_layers:
      raise ValueError(f"draft_layers must be in [1, {config.num_layers}), got {cfg.draft_layers}")
    dcfg = config.replace(num_layers=cfg.draft_layers, name=f"{config.name}-distill{cfg.draft_layers}")
    start = early_exit_params(params, cfg.draft_layers)  # starts as the early-exit self-draft
    init = {"layers": start["layers"], "final_norm": start["final_norm"]}
    frozen = {"target": params, "embed": params["embed"], "rows": rows}
    loss = functools.partial(losses.draft_kl_loss, cfg=dcfg)
    task = task_of("draft", lambda p, fz, f, t, m, k: loss(p, fz, f, t, m))
    return task, init, frozen, {"num_layers": cfg.draft_layers}
  raise ValueError(f"unknown kind {cfg.kind!r}: medusa, eagle or draft")
