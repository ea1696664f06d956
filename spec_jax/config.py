"""Static configuration (frozen dataclasses, hashable so jit can take them as static) and the
per-row sampling parameters (a pytree of arrays, so one batch mixes requests)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer. Gemma 3 by default; Llama/Qwen2 through the flags."""

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  activation: str = "gelu_tanh"  # "gelu_tanh" (GeGLU) or "silu" (SwiGLU)
  norm_eps: float = 1e-6
  post_norms: bool = True  # Gemma's post-attention and post-MLP norms
  qk_norm: bool = True
  qkv_bias: bool = False  # Qwen2
  rope_base: float = 1_000_000.0  # global layers (or every layer when no window)
  rope_base_local: float = 10_000.0  # sliding-window layers
  sliding_window: Optional[int] = 512  # None: every layer is global
  global_every: int = 6  # layer i is global when (i + 1) % global_every == 0
  query_pre_attn_scalar: Optional[float] = 256.0  # scale = this ** -0.5; None: head_dim ** -0.5
  embed_scale: bool = True  # multiply embeddings by sqrt(d_model)
  tie_embeddings: bool = True
  max_seq_len: int = 32768
  bos_id: int = 2
  eos_ids: tuple = (1, 106)
  pad_id: int = 0
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
  if not np.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
  if int(top_k) != top_k or top_k < 0:
    raise ValueError(f"top_k must be an integer >= 0 (0 is off), got {top_k}")
  if not (0.0 < top_p <= 1.0):
    raise ValueError(f"top_p must be in (0, 1] (1 is off), got {top_p}")
