"""EAGLE heads trained here in the published EAGLE-3 layout (`head_layout="eagle3"` in train/), so that export is an
exact write of the trained parameters (train/export_eagle3.py) and vLLM, SGLang and published.py read them.

The layout is the one spec_jax/checkpoints/published.py loads, computed by the same forward
(eagle.layer_inputs / out_feature / head_logits with Published("eagle3")): a fusing FC over the aux layers side by
side (no per-part norms), one Llama decoder layer whose q/k/v read [input_layernorm(embedding); hidden_norm(h)]
(2 D wide) with h as the residual, the raw output fed back, logits = lm_head(norm(output)) over the draft
vocabulary. The layer's config is built from the very Llama config dict the export writes, through the loader's
own reader (safetensors_loader.llama_layer_config), so the trained and the loaded layer cannot differ. The lm_head is the
target's output rows over the draft vocabulary (frozen while training; the export writes them), so a head stores
only the layer, the FC and the norms.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from spec_jax.checkpoints.safetensors_loader import llama_layer_config
from spec_jax.config import ModelConfig
from spec_jax.models import transformer as tfm

LAYOUT = "eagle3"


def layer_dict(target: ModelConfig, mlp_dim: Optional[int] = None) -> dict:
  """The head's decoder layer as a Llama config (what config.json holds): the target's width and attention shape,
  a SiLU MLP of `mlp_dim`, the target's global RoPE base without scaling."""
  return {"model_type": "llama", "hidden_act": "silu", "hidden_size": target.d_model,
          "num_attention_heads": target.num_heads, "num_key_value_heads": target.num_kv_heads,
          "head_dim": target.head_dim, "intermediate_size": int(mlp_dim or target.mlp_dim),
          "rms_norm_eps": float(target.norm_eps), "rope_theta": float(target.rope_base),
          "attention_bias": False, "num_hidden_layers": 1}


def layer_config(target: ModelConfig, mlp_dim: Optional[int] = None) -> ModelConfig:
  return llama_layer_config(layer_dict(target, mlp_dim), target, f"{target.name} EAGLE-3 layer")


def default_feature_layers(config: ModelConfig) -> tuple:
  """EAGLE-3's fused target layers, the convention of its published heads: low, middle and high."""
  L = config.num_layers
  return (1, L // 2 - 1, L - 4)


def param_shapes(cfg: ModelConfig, num_feature_layers: int) -> dict:
  D = cfg.d_model
  layer = {k: v[1:] for k, v in tfm.param_shapes(cfg)["layers"].items()}
  for name in ("q", "k", "v"):  # they read [embedding; hidden], 2 D wide
    layer[name] = (2 * D,) + tuple(layer[name][1:])
  layer["hidden_norm"] = (D,)
  return {"fuse": (num_feature_layers * D, D), "layer": layer, "out_norm": (D,)}


def init_params(key, cfg: ModelConfig, num_feature_layers: int, target_params: Optional[dict] = None,
                dtype=jnp.float32) -> dict:
  """A random layer (fan-in scaled, norms near 1), a fusing FC that starts as the aux layers' mean, the final norm
  starting as the target's."""
  if num_feature_layers < 2:
    raise ValueError(f"the EAGLE-3 layout fuses 2 or more target layers, got {num_feature_layers}")
  shapes = param_shapes(cfg, num_feature_layers)
  k1, k2 = jax.random.split(key)
  keys = iter(jax.random.split(k1, len(shapes["layer"])))
  layer = {}
  for name, shape in sorted(shapes["layer"].items()):
    k = next(keys)
    if "norm" in name:
      layer[name] = jnp.ones(shape, dtype)
    else:
      fan_in = shape[0] * (shape[1] if name == "o" else 1)
      layer[name] = (jax.random.normal(k, shape) / jnp.sqrt(fan_in)).astype(dtype)
  n, D = num_feature_layers, cfg.d_model
  fuse = jnp.tile(jnp.eye(D), (n, 1)) / n + 0.02 * jax.random.normal(k2, (n * D, D))
  out_norm = target_params["final_norm"] if target_params is not None else jnp.ones((D,))
  return {"fuse": fuse.astype(dtype), "layer": layer, "out_norm": jnp.asarray(out_norm, dtype)}
