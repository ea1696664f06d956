"""Medusa-1 heads on the frozen target: K residual SiLU blocks on the target's last hidden state.

Indexing. `ctx.last_hidden` is the target's final-normed hidden at position p = lengths-2 (the last token fed);
through the LM head it already predicted tokens[lengths-1], the last committed token. Head i reads that same
hidden and predicts the token at p + 2 + i, so head 0 gives the first draft (position lengths) and head i the
(i+1)-th. Training uses the same offsets (train/losses.py: hidden at t -> token t + 2 + i).

Each head is `h + SiLU(W_i h + b_i)`, projected with frozen rows of the target's output matrix (all V, or the
reduced draft vocabulary d2t). The heads are independent of each other's drafts, so the k drafts come from one
batched matmul, no loop.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.config import ModelConfig
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.proposers import vocab
from spec_jax.proposers.base import Draft, Stateless


def param_shapes(d_model: int, num_heads: int) -> dict:
  return {"w": (num_heads, d_model, d_model), "b": (num_heads, d_model)}


def init_params(key, d_model: int, num_heads: int, dtype=jnp.float32, scale: float = 0.0) -> dict:
  """W = 0 makes every head start as the identity map, i.e. the target's own next-token head (Medusa's init)."""
  w = scale * jax.random.normal(key, (num_heads, d_model, d_model)) / np.sqrt(d_model)
  return {"w": w.astype(dtype), "b": jnp.zeros((num_heads, d_model), dtype)}


def head_features(heads: dict, hidden: jax.Array) -> jax.Array:
  """hidden [..., D] -> [..., K, D]: every head's residual block."""
  h = hidden[..., None, :]
  z = jnp.einsum("...d,kde->...ke", hidden, heads["w"].astype(hidden.dtype),
                 preferred_element_type=jnp.float32) + heads["b"].astype(jnp.float32)
  return (h.astype(jnp.float32) + jax.nn.silu(z)).astype(hidden.dtype)


@dataclasses.dataclass(frozen=True)
class MedusaProposer(Stateless):
  vocab_size: int  # the target's V (drafts and q are returned over it)
  num_heads: int
  k: int = 4
  reduced: bool = False  # project to the d2t rows only
  name: str = "medusa"

  def __post_init__(self):
    if not 1 <= self.k <= self.num_heads:
      raise ValueError(f"medusa drafts at most {self.num_heads} tokens (one per head), got k={self.k}")

  def propose(self, params, state, ctx, k, key):
    feats = head_features(params["heads"], ctx.last_hidden)[:, :k]  # [B, k, D]
    logits = vocab.project(feats, params["rows"])
    tokens, q = vocab.draw(key, logits, ctx.sampling, params.get("d2t"), self.vocab_size)
    return Draft(tokens=tokens, probs=q), state


def runtime_params(heads: dict, target_params: dict, d2t: Optional[jax.Array] = None) -> dict:
  """The proposer's params: the trained heads plus the frozen output rows (shared with the target)."""
  out = {"heads": heads, "rows": vocab.output_rows(target_params, d2t)}
  if d2t is not None:
    out["d2t"] = jnp.asarray(d2t, jnp.int32)
  return out


def load_medusa(path: str, target_config: ModelConfig, target_params: dict, k: int):
  """-> (MedusaProposer, params) from a heads checkpoint, checked against the target."""
  dtype = target_params["final_norm"].dtype
  meta, heads, d2t = head_ckpt.load_heads(path, target_config, "medusa", dtype)
  K = int(meta.get("num_heads", 0))
  head_ckpt.check_shapes(heads, param_shapes(target_config.d_model, K), path)
  proposer = MedusaProposer(vocab_size=target_config.vocab_size, num_heads=K, k=k, reduced=d2t is not None)
  return proposer, runtime_params(heads, target_params, d2t)
