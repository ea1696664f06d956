"""The target model's parameters, one row each: the one table that says what a model family's weights are.

A row gives our name, its logical axes (one layer's array for a per-layer row; the stack adds a leading `layers`
axis) and so its shape, how many leading input axes its matmul contracts (0: not a matmul), its tensor names in
Hugging Face safetensors and in GGUF ("{i}" is the layer), how the torch layout both formats store becomes ours,
and when a config has it. Everything that knows parameter names reads it:
  transformer.param_shapes   shapes, in the order below;
  param_axes.PARAM_AXES      the logical axes (plus the proposers' own parameters, which live there);
  quant.LAYER_CONTRACT       which layer weights are quantized, over which input axes;
  the safetensors and GGUF loaders: names, layout conversion and the shape a file must hold.
What one format does differently for one family is one named function here (`hf_name`, `hf_norm_offset`).

Adding a family means: its flags in config.FAMILIES, and rows here only for parameters the transformer does not
have yet (with the code in transformer.py that uses them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from spec_jax.config import ModelConfig

# Logical axis -> its size in a config. sharding.LOGICAL_RULES maps the same names to mesh axes.
DIMS = {
    "vocab": lambda c: c.vocab_size, "embed": lambda c: c.d_model, "heads": lambda c: c.num_heads,
    "kv_heads": lambda c: c.num_kv_heads, "head_dim": lambda c: c.head_dim, "mlp": lambda c: c.mlp_dim,
}


def _always(c: ModelConfig) -> bool:
  return True


def _untied(c: ModelConfig) -> bool:
  return not c.tie_embeddings


def _qk_norm(c: ModelConfig) -> bool:
  return c.qk_norm


def _qkv_bias(c: ModelConfig) -> bool:
  return c.qkv_bias


def _post_norms(c: ModelConfig) -> bool:
  return c.post_norms


@dataclasses.dataclass(frozen=True)
class Param:
  """One parameter. layout, torch -> ours: "same" (as stored), "linear" (a torch Linear [out, in] whose `in` is
  our first `contract` axes: transposed and split into ours), "flat" (a flat vector split into heads)."""

  name: str
  axes: tuple
  per_layer: bool
  hf: str
  gguf: str
  layout: str = "same"
  contract: int = 0
  when: Callable[[ModelConfig], bool] = _always

  def shape(self, c: ModelConfig) -> tuple:
    """One layer's shape (the whole array's for a top-level row)."""
    return tuple(DIMS[a](c) for a in self.axes)

  @property
  def is_norm(self) -> bool:
    return self.name.endswith("norm")


def _layer(name, axes, hf, gguf, layout="same", contract=0, when=_always):
  return Param(name, axes, True, f"layers.{{i}}.{hf}", f"blk.{{i}}.{gguf}", layout, contract, when)


_E, _H, _K, _D, _F = "embed", "heads", "kv_heads", "head_dim", "mlp"
# Top level, then the layer's: the weights every family has first, then each flag's (param_shapes keeps this order).
TOP = (
    Param("embed", ("vocab", _E), False, "embed_tokens.weight", "token_embd.weight"),
    Param("final_norm", (_E,), False, "norm.weight", "output_norm.weight"),
    Param("lm_head", (_E, "vocab"), False, "lm_head.weight", "output.weight", "linear", 1, _untied),
)
LAYER = (
    _layer("attn_norm", (_E,), "input_layernorm.weight", "attn_norm.weight"),
    _layer("q", (_E, _H, _D), "self_attn.q_proj.weight", "attn_q.weight", "linear", 1),
    _layer("k", (_E, _K, _D), "self_attn.k_proj.weight", "attn_k.weight", "linear", 1),
    _layer("v", (_E, _K, _D), "self_attn.v_proj.weight", "attn_v.weight", "linear", 1),
    _layer("o", (_H, _D, _E), "self_attn.o_proj.weight", "attn_output.weight", "linear", 2),
    _layer("mlp_norm", (_E,), "pre_feedforward_layernorm.weight", "ffn_norm.weight"),  # see hf_name
    _layer("gate", (_E, _F), "mlp.gate_proj.weight", "ffn_gate.weight", "linear", 1),
    _layer("up", (_E, _F), "mlp.up_proj.weight", "ffn_up.weight", "linear", 1),
    _layer("down", (_F, _E), "mlp.down_proj.weight", "ffn_down.weight", "linear", 1),
    _layer("q_norm", (_D,), "self_attn.q_norm.weight", "attn_q_norm.weight", when=_qk_norm),
    _layer("k_norm", (_D,), "self_attn.k_norm.weight", "attn_k_norm.weight", when=_qk_norm),
    _layer("q_bias", (_H, _D), "self_attn.q_proj.bias", "attn_q.bias", "flat", when=_qkv_bias),
    _layer("k_bias", (_K, _D), "self_attn.k_proj.bias", "attn_k.bias", "flat", when=_qkv_bias),
    _layer("v_bias", (_K, _D), "self_attn.v_proj.bias", "attn_v.bias", "flat", when=_qkv_bias),
    _layer("post_attn_norm", (_E,), "post_attention_layernorm.weight", "post_attention_norm.weight",
           when=_post_norms),
    _layer("post_mlp_norm", (_E,), "post_feedforward_layernorm.weight", "post_ffw_norm.weight", when=_post_norms),
)
ROWS = TOP + LAYER
BY_NAME = {r.name: r for r in ROWS}
AXES = {r.name: r.axes for r in ROWS}  # one layer's (or a top-level array's) logical axes


def top_rows(c: ModelConfig) -> tuple:
  return tuple(r for r in TOP if r.when(c))


def layer_rows(c: ModelConfig) -> tuple:
  return tuple(r for r in LAYER if r.when(c))


def shapes(c: ModelConfig) -> dict:
  """{top-level name: shape, "layers": {name: [L, ...]}}: the params tree of a config, as shapes."""
  out = {r.name: r.shape(c) for r in top_rows(c)}
  out["layers"] = {r.name: (c.num_layers,) + r.shape(c) for r in layer_rows(c)}
  return out


# ------------------------------------------------------------------------------------------- torch layout


def torch_shape(row: Param, want: tuple) -> tuple:
  """The shape a file stores for our array of shape `want` (one layer's)."""
  if row.layout == "linear":
    return (math.prod(want[row.contract:]), math.prod(want[:row.contract]))
  if row.layout == "flat":
    return (math.prod(want),)
  return tuple(want)


def from_torch(row: Param, w: np.ndarray, want: tuple) -> np.ndarray | None:
  """A stored tensor -> ours of shape `want`, or None when it does not have torch_shape (nothing is guessed)."""
  if tuple(w.shape) != torch_shape(row, want):
    return None
  if row.layout == "linear":
    return w.T.reshape(want)
  if row.layout == "flat":
    return w.reshape(want)
  return w


def to_torch(row: Param, w: np.ndarray) -> np.ndarray:
  """from_torch's inverse (for writers: tests, conversions). Not C-contiguous for linear rows."""
  w = np.asarray(w)
  if row.layout == "linear":
    return w.reshape(math.prod(w.shape[:row.contract]), -1).T
  if row.layout == "flat":
    return w.reshape(-1)
  return w


# ------------------------------------------------------------------------------- family differences
# Not here because there are none: llama.cpp permutes Q/K only for its `llama` architecture, which the GGUF loader
# does not read (gemma3 and qwen2 keep rotate-half order, as ours); Gemma's embedding scale is a flag (embed_scale).


def hf_name(row: Param, c: ModelConfig) -> str:
  """The row's HF name. Llama-style checkpoints (no post norms) name their pre-MLP norm
  post_attention_layernorm; in Gemma that name is the post-attention norm and the pre-MLP one has its own."""
  if row.name == "mlp_norm" and not c.post_norms:
    return "layers.{i}.post_attention_layernorm.weight"
  return row.hf


def hf_norm_offset(c: ModelConfig) -> float:
  """What to add to HF norm weights for ours: Gemma stores w for a (1 + w) multiplier, ours are plain multipliers
  (llama.cpp's Gemma GGUFs already hold 1 + w). Only the Gemma family has post norms."""
  return 1.0 if c.post_norms else 0.0
