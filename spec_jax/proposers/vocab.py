"""Output projection and drafting over a (possibly reduced) draft vocabulary.

A head projects its hidden state to logits with frozen rows of the target's output matrix: all V rows, or only
the rows `d2t[N]` of a reduced draft vocabulary (EAGLE-3's most frequent tokens). Draws happen over the N draft
ids; the token goes back to its target id through d2t and the distribution q is scattered into the full
vocabulary (zero outside d2t), so the verifier still works over all V tokens and stays exact.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from spec_jax.kernels.common import gemm_rows
from spec_jax.quant import QTensor, qdot, take_rows
from spec_jax.sampling import sample, warped_probs


def output_rows(target_params: dict, d2t: Optional[jax.Array] = None) -> jax.Array:
  """[N, D] rows of the target's output projection (tied embedding or lm_head), restricted to d2t if given.
  A quantized target's rows stay quantized when all are taken, and are dequantized when d2t picks a few."""
  q = target_params.get("lm_head", target_params["embed"])
  if isinstance(q, QTensor):  # quantized output-major [V, D] either way
    return q if d2t is None else take_rows(q, d2t, target_params["final_norm"].dtype)
  w = target_params["lm_head"].T if "lm_head" in target_params else target_params["embed"]
  if d2t is None:
    return w
  # A reduced set is small (8192 x 640): keep it in the activations' dtype, once, so that project() never
  # converts it per drafted token (a bfloat16 table in a float32 head was a 21 MB convert per token on CPU).
  return jnp.take(w, d2t, axis=0).astype(target_params["final_norm"].dtype)


def project(hidden: jax.Array, rows: jax.Array) -> jax.Array:
  """hidden [..., D] -> float32 logits [..., N]. Casts the activations to the rows' dtype, never the rows (a
  262k-row bfloat16 table promoted to float32 would be copied whole on every call)."""
  if isinstance(rows, QTensor):
    return qdot(hidden, rows)
  return gemm_rows(lambda h: jnp.einsum("...d,nd->...n", h, rows, preferred_element_type=jnp.float32),
                   hidden.astype(rows.dtype), math.prod(hidden.shape[:-1]))


def draw(key, logits, sampling, d2t: Optional[jax.Array], vocab_size: int):
  """logits [B, ..., N] -> (target ids int32 [B, ...], q float32 [B, ..., V] over the full vocabulary)."""
  tok = sample(key, logits, sampling)
  q = warped_probs(logits, sampling)
  if d2t is None:
    return tok.astype(jnp.int32), q
  full = jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., d2t].set(q)
  return jnp.take(d2t, tok).astype(jnp.int32), full
