"""XLA:CPU policy in one place: what this backend needs that the algorithm does not. Each rule names its
measurement; on GPU/TPU none of them applies.

- Batch rows: a 1-row bfloat16 dot is ~10x slower than a 2-row one on XLA:CPU (float32 is fastest at one row,
  a matrix-vector product), so a bfloat16 batch of one runs with a second, free slot.
- The draft model re-feeds the last two committed tokens (T = 2) for its cache bookkeeping, which also keeps it
  off the 1-row path; its catch-up after k = 0 steps feeds CATCH_UP tokens per forward (proposers/draft.py).
- Rows of similar prompt lengths share a batch (serve/jobs/runner.py), so padding stays small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def on_cpu() -> bool:
  return jax.default_backend() == "cpu"


def batch_rows(params: dict, n: int) -> int:
  """Slots to run n requests in: n, or 2 for a bfloat16 batch of one on CPU."""
  any_bf16 = any(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  return max(n, 2) if (any_bf16 and on_cpu()) else n
