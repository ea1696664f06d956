"""What the GPU (Triton) and TPU (Mosaic) attention kernels share: the query-row layout, slot visibility, the KV
block bounds, the cost estimate and the target-platform check. Plain JAX: importing it pulls in neither Triton nor
Mosaic.

Row r of the query tile is token t = r // G, query head g = r % G of one kv head. Verify and decode fit all T*G
rows in one row block, so each K/V block is read once; prefill-sized T is cut into row blocks.

Visibility, as in reference.visibility: committed slot j (position j) when j < length and pos[r] - j < window;
new token t' when t' <= t (chain) or bit t' of row r's mask words is set (tree; the words already fold in the
window between the two tokens' positions), and pos[r] - new_pos[t'] < window.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite: a row that sees nothing never makes NaN, and exp(m_old - m_new) never sees inf - inf
NO_WINDOW = 1 << 30  # stands in for "no window": q_pos - j < NO_WINDOW always holds


def next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def round_up(n: int, m: int) -> int:
  return -(-int(n) // m) * m


def effective_window(window):
  """int32 scalar; a window <= 0 (or None) becomes NO_WINDOW so the kernel needs no branch on it."""
  if window is None:
    return jnp.int32(NO_WINDOW)
  w = jnp.asarray(window, jnp.int32)
  return jnp.where(w > 0, w, jnp.int32(NO_WINDOW))


def per_row_tree(tree_mask, B: int):
  """bool [B, T, T] from a tree mask shared by all rows ([T, T]) or given per row ([B, T, T])."""
  tm = jnp.asarray(tree_mask, bool)
  return jnp.broadcast_to(tm, (B,) + tm.shape[-2:]) if tm.ndim == 2 else tm


def tree_bits(tree_mask, q_positions, win):
  """int32[B, T, W], W = ceil(T/32): bit t' of word t'//32 says token t sees new slot t'."""
  B, T = q_positions.shape
  pos = q_positions.astype(jnp.int32)
  vis = per_row_tree(tree_mask, B) & ((pos[:, :, None] - pos[:, None, :]) < win)
  W = -(-T // 32)
  vis = jnp.pad(vis.astype(jnp.int32), ((0, 0), (0, 0), (0, 32 * W - T))).reshape(B, T, W, 32)
  weights = jnp.left_shift(jnp.int32(1), jnp.arange(32, dtype=jnp.int32))  # bit 31 wraps to INT_MIN: fine
  return jnp.sum(vis * weights, axis=-1, dtype=jnp.int32)


def row_inputs(q_positions, tree_mask, win, G: int, R: int):
  """Per-row inputs for R (padded) rows: pos [B,R], and the token index [B,R] (chain; -1 on padding rows) or the
  new-token mask words [B,R,W] (tree; 0 on padding rows). Padding rows repeat the last token's position, so the
  block bounds stay those of real rows; they read nothing new."""
  B, T = q_positions.shape
  r = jnp.arange(R, dtype=jnp.int32)
  real = r < T * G
  t = jnp.minimum(r // G, T - 1)
  pos = q_positions.astype(jnp.int32)[:, t]
  if tree_mask is None:
    return pos, jnp.broadcast_to(jnp.where(real, t, -1)[None, :], (B, R))
  bits = tree_bits(tree_mask, q_positions, win)[:, t, :]
  return pos, jnp.where(real[None, :, None], bits, 0)


def block_bounds(pos, lengths, S: int, block_rows: int, block_k: int, win):
  """Flat int32[B*NR] first and end committed KV block per (row, row block) that can hold a visible slot: slots
  below the length, and within the window of the block's earliest query."""
  B, R = pos.shape
  nr = R // block_rows
  end = jnp.broadcast_to(jnp.clip(lengths.astype(jnp.int32), 0, S)[:, None], (B, nr))
  first = jnp.min(pos.reshape(B, nr, block_rows), axis=2) - win + 1
  first = jnp.clip(first, 0, end)
  lo = first // block_k
  hi = jnp.maximum((end + block_k - 1) // block_k, lo)
  return lo.reshape(-1).astype(jnp.int32), hi.reshape(-1).astype(jnp.int32)


def to_rows(q, Hkv: int, R: int, Dp: int):
  """q[B,T,Hq,D] -> [B,Hkv,R,Dp] with row r = t*G + g, zero padded."""
  B, T, Hq, D = q.shape
  G = Hq // Hkv
  x = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, D)
  return jnp.pad(x, ((0, 0), (0, 0), (0, R - T * G), (0, Dp - D)))


def new_tokens(k_new, Tp: int, Dp: int):
  """k_new[B,T,Hkv,D] -> [B,Hkv,Tp,Dp], zero padded: the new tokens of each kv head, one tile."""
  B, T, Hkv, D = k_new.shape
  return jnp.pad(k_new.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Tp - T), (0, Dp - D)))


def from_rows(o, T: int, Hq: int, D: int):
  B, Hkv = o.shape[:2]
  G = Hq // Hkv
  o = o[:, :, :T * G, :D].reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4)
  return o.reshape(B, T, Hq, D)


def committed_visible(j, pos, length, win):
  """bool mask of committed cache slots j (int32, broadcastable against the [rows, 1] positions)."""
  return (j < length) & (pos - j < win)


def new_visible(tn, pos, new_pos, aux, win, tree: bool):
  """bool mask of new tokens tn ([1, n] lane indices, positions new_pos [1, n]) for rows at pos [rows, 1].

  aux is the token index [rows, 1] (chain) or the list of mask words, each [rows, 1] (tree)."""
  if not tree:
    return (tn <= aux) & (pos - new_pos < win)
  word = aux[0]
  for i in range(1, len(aux)):
    word = jnp.where(jnp.right_shift(tn, 5) == i, aux[i], word)
  # Lanes past the last word (a padded tile) would wrap around to its bits.
  return (jnp.right_shift(word, tn & 31) & 1 != 0) & (tn < 32 * len(aux))


def cost_estimate(q, k_new, layer_cache_shape, cache_dtype, scales: bool = False):
  """(flops, transcendentals, bytes accessed) of one call, as if every slot up to the capacity were read: the
  compiler's estimate of a program holding the kernel is then a bound for a full cache (BENCHMARKS.md says so
  where the AOT report's numbers are used). scales: an 8-bit cache's float32 scale per slot and KV head, read
  too."""
  B, T, Hq, D = q.shape
  _, Hkv, S, _ = layer_cache_shape
  keys = S + T
  flops = 4 * B * Hq * T * keys * D
  transcendentals = B * Hq * T * keys
  itemsize = jnp.dtype(cache_dtype).itemsize
  bytes_accessed = (2 * B * Hkv * S * (D * itemsize + (4 if scales else 0)) + 2 * k_new.size * k_new.dtype.itemsize
                    + 2 * q.size * q.dtype.itemsize)
  return int(flops), int(transcendentals), int(bytes_accessed)


_LOWERING_FOR = contextvars.ContextVar("spec_jax_lowering_for", default=None)


@contextlib.contextmanager
def lowering_for(platform: str):
  """Build programs for `platform` ("gpu" or "tpu") whatever this host runs: `jax.export` to CUDA from a CPU host
  lowers the Pallas kernels without a GPU (serve.aot, the export tests)."""
  token = _LOWERING_FOR.set(platform)
  try:
    yield
  finally:
    _LOWERING_FOR.reset(token)


def target_platform() -> str:
  """The platform programs are built for: `lowering_for`'s, else the default device's (`with
  jax.default_device(d)`, as an AOT compile for a TPU topology sets it on a CPU host), else the default backend."""
  if _LOWERING_FOR.get() is not None:
    return _LOWERING_FOR.get()
  device = jax.config.jax_default_device
  if device is not None and not isinstance(device, str):
    return device.platform
  return jax.default_backend()


def gemm_rows(product, x, rows: int):
  """product(x) for a matrix product reading `rows` rows of x (its leading axes). On GPU one row goes in as two:
  XLA:GPU rewrites a one-row bfloat16 product with a float32 result as multiply + reduce over a float32 copy of the
  whole weight (every MLP weight, every batch-1 step); two rows stay a GEMM on the bfloat16 weight."""
  if rows != 1 or x.ndim < 2 or target_platform() != "gpu":
    return product(x)
  return product(jnp.concatenate([x, x]))[:1]


def require_backend(name: str, platform: str, interpret) -> None:
  if interpret:
    return
  backend = target_platform()
  if backend != platform:
    raise RuntimeError(
        f"{name} needs a {platform.upper()} backend (the target platform is {backend!r}); "
        f"pass interpret=True to run it in the Pallas interpreter, or use impl='xla'")
