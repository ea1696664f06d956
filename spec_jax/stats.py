"""Acceptance counters (per row, on device) and the metrics derived from them on the host.

Mean acceptance length is emitted tokens over verify steps, the bonus/correction token included (as vLLM and
Spec-Bench count it). Acceptance rate is accepted drafts over drafted tokens. The first token, which prefill
produces, is in neither.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Stats:
  """Per-row counters since the row started (K = max(k_max, 1)).

  steps int32[B]: verify steps the row took part in; drafted int32[B]: valid draft tokens proposed for it (tree
  nodes for trees);
  accepted int32[B]: drafts committed (accepted by the verifier and not cut by a stop token or the token limit);
  emitted int32[B]: tokens committed by verify steps; drafted_at, accepted_at int32[B, K]: the same per position.
  """

  steps: jax.Array
  drafted: jax.Array
  accepted: jax.Array
  emitted: jax.Array
  drafted_at: jax.Array
  accepted_at: jax.Array

  @classmethod
  def zeros(cls, batch: int, k_max: int) -> "Stats":
    z = jnp.zeros((batch,), jnp.int32)
    zk = jnp.zeros((batch, max(k_max, 1)), jnp.int32)
    return cls(z, z, z, z, zk, zk)

  def record(self, active, drafted_mask, accepted_mask, emitted, drafted_count=None) -> "Stats":
    """active bool[B]; drafted/accepted_mask bool[B, k] (k <= K); emitted int32[B]. drafted_count int32[B]: the
    tokens drafted when it is not the mask's count (a tree drafts several nodes per depth)."""
    a = active.astype(jnp.int32)
    k = drafted_mask.shape[1]
    dm = drafted_mask.astype(jnp.int32) * a[:, None]
    am = accepted_mask.astype(jnp.int32) * a[:, None]
    n = dm.sum(1) if drafted_count is None else drafted_count.astype(jnp.int32) * a
    pad = lambda m: jnp.pad(m, ((0, 0), (0, self.drafted_at.shape[1] - k)))
    return Stats(self.steps + a, self.drafted + n, self.accepted + am.sum(1), self.emitted + emitted * a,
                 self.drafted_at + pad(dm), self.accepted_at + pad(am))


def summarize(stats: Stats, rows=None) -> dict:
  """Host-side metrics over the chosen rows (all by default)."""
  s = jax.tree.map(np.asarray, stats)
  sel = slice(None) if rows is None else np.asarray(rows)
  steps, emitted = int(s.steps[sel].sum()), int(s.emitted[sel].sum())
  drafted, accepted = int(s.drafted[sel].sum()), int(s.accepted[sel].sum())
  d_at, a_at = s.drafted_at[sel].sum(0), s.accepted_at[sel].sum(0)
  return {
      "verify_steps": steps,
      "emitted_tokens": emitted,
      "drafted_tokens": drafted,
      "accepted_tokens": accepted,
      "mean_acceptance_length": emitted / steps if steps else 0.0,
      "acceptance_rate": accepted / drafted if drafted else 0.0,
      "per_position_acceptance": [float(a / d) if d else 0.0 for a, d in zip(a_at, d_at)],
      "per_position_drafted": [int(d) for d in d_at],  # the drafts behind each position's figure
      # Tokens drafted per drafting step: k for chains, the tree's size (nodes past the root) for trees.
      "mean_draft_tokens_per_step": drafted / int(d_at[0]) if len(d_at) and d_at[0] else 0.0,
  }
