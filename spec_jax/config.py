"""Static configuration (frozen dataclasses, hashable so jit can take them as static) and the
per-row sampling parameters (a pytree of arrays, so one batch mixes requests)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


# Each family's flags (ModelConfig fields), written once: the loaders and models/shapes.py start from these and put a
# model's own sizes, RoPE bases and token ids over them (family_config). Gemma 3's are also ModelConfig's defaults.
# A family with parameters the transformer lacks also needs rows in models/schema.py.
GEMMA3 = dict(activation="gelu_tanh", post_norms=True, qk_norm=True, qkv_bias=False, rope_base=1_000_000.0,
              rope_base_local=10_000.0, sliding_window=512, global_every=6, query_pre_attn_scalar=256.0,
              embed_scale=True, tie_embeddings=True, bos_id=2, eos_ids=(1, 106), pad_id=0)
LLAMA = dict(activation="silu", post_norms=False, qk_norm=False, qkv_bias=False, sliding_window=None,
             query_pre_attn_scalar=None, embed_scale=False, tie_embeddings=False)
QWEN2 = dict(LLAMA, qkv_bias=True)
QWEN3 = dict(LLAMA, qk_norm=True)  # dense Qwen3: per-head RMS norms on q and k before RoPE, no QKV bias
FAMILIES = {"gemma3": GEMMA3, "llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer. Gemma 3 by default; Llama/Qwen2/Qwen3 through the flags (FAMILIES)."""

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  activation: str = GEMMA3["activation"]  # "gelu_tanh" (GeGLU) or "silu" (SwiGLU)
  norm_eps: float = 1e-6
  post_norms: bool = GEMMA3["post_norms"]  # Gemma's post-attention and post-MLP norms
  qk_norm: bool = GEMMA3["qk_norm"]
  qkv_bias: bool = GEMMA3["qkv_bias"]  # Qwen2
  rope_base: float = GEMMA3["rope_base"]  # global layers (or every layer when no window)
  rope_base_local: float = GEMMA3["rope_base_local"]  # sliding-window layers
  sliding_window: Optional[int] = GEMMA3["sliding_window"]  # None: every layer is global
  global_every: int = GEMMA3["global_every"]  # layer i is global when (i + 1) % global_every == 0
  # None: plain RoPE. ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
  # Llama 3.1's frequency scaling (models/transformer.rope_frequencies), applied to every layer's base.
  rope_scaling: Optional[tuple] = None
  # The attention scale is this ** -0.5; None: head_dim ** -0.5.
  query_pre_attn_scalar: Optional[float] = GEMMA3["query_pre_attn_scalar"]
  embed_scale: bool = GEMMA3["embed_scale"]  # multiply embeddings by sqrt(d_model)
  tie_embeddings: bool = GEMMA3["tie_embeddings"]
  max_seq_len: int = 32768
  bos_id: int = GEMMA3["bos_id"]
  eos_ids: tuple = GEMMA3["eos_ids"]
  pad_id: int = GEMMA3["pad_id"]
  name: str = "model"

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.activation not in ("gelu_tanh", "silu"):
      raise ValueError(f"unknown activation {self.activation!r}")

  def layer_is_global(self) -> np.ndarray:
    if self.sliding_window is None:
      return np.ones(self.num_layers, bool)
    return np.array([(i + 1) % self.global_every == 0 for i in range(self.num_layers)])

  def layer_windows(self) -> np.ndarray:
    """Per-layer window, 0 meaning none (global)."""
    return np.where(self.layer_is_global(), 0, self.sliding_window or 0).astype(np.int32)

  def layer_rope_bases(self) -> np.ndarray:
    return np.where(self.layer_is_global(), self.rope_base, self.rope_base_local).astype(np.float32)

  @property
  def attn_scale(self) -> float:
    s = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
    return float(s) ** -0.5

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)


def family_config(family: str, **fields) -> ModelConfig:
  """A config of a family in FAMILIES: its flags, with `fields` (sizes, and any flag a model changes) over them."""
  return ModelConfig(**{**FAMILIES[family], **fields})


@struct.dataclass
class SamplingParams:
  """Per-row sampling: temperature 0 is greedy, top_k 0 and top_p 1 switch those filters off."""

  temperature: jax.Array  # float32[B]
  top_k: jax.Array  # int32[B]
  top_p: jax.Array  # float32[B]

  @classmethod
  def make(cls, batch: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
    validate_sampling(temperature, top_k, top_p)
    return cls(
        temperature=jnp.full((batch,), temperature, jnp.float32),
        top_k=jnp.full((batch,), top_k, jnp.int32),
        top_p=jnp.full((batch,), top_p, jnp.float32),
    )

  @classmethod
  def stack(cls, rows: "list[tuple[float, int, float]]") -> "SamplingParams":
    for t, k, p in rows:
      validate_sampling(t, k, p)
    t, k, p = zip(*rows) if rows else ((), (), ())
    return cls(jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32))


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
  """Host-side check with an error that names the bad field."""
  # The library's own, for direct callers; the server checks a request once, in serve/engine/request_spec.py.
  if not np.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
  if int(top_k) != top_k or not 0 <= top_k < 2 ** 31:
    raise ValueError(f"top_k must be an integer in [0, 2^31) (0 is off), got {top_k}")
  if not (0.0 < top_p <= 1.0):
    raise ValueError(f"top_p must be in (0, 1] (1 is off), got {top_p}")
