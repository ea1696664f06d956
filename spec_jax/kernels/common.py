"""What the GPU (Triton) and TPU (Mosaic) attention kernels share: the query-row layout, slot visibility, the KV
block bounds and the backend check. Plain JAX: importing it pulls in neither Triton nor Mosaic.

Row r of the query tile is token t = r // G, query head g = r % G of one kv head. Verify and decode fit all T*G
rows in one row block, so each K/V block is read once; prefill-sized T is cut into row blocks.

Slot visibility, as in reference.attention_mask, with key position = slot index for committed slots:
  chain: new slot j holds position j too (q_positions[b, t] = kv_lengths[b] - T + t), so query row r sees
         exactly j <= lim[r] (its own slot) and pos[r] - j < window;
  tree:  committed slots as above, new slot t' when bit t' of row r's mask words is set; the words already
         fold in the window between the two tokens' own positions (tree positions are depths, not slots).
"""

from __future__ import annotations

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


def row_inputs(q_positions, kv_lengths, tree_mask, win, G: int, R: int):
  """Per-row inputs for R (padded) rows: pos [B,R], and lim [B,R] (chain) or mask words [B,R,W] (tree).

  Padding rows repeat the last token's position (so block bounds stay those of real rows) and see no slot.
  """
  B, T = q_positions.shape
  r = jnp.arange(R, dtype=jnp.int32)
  real = r < T * G
  t = jnp.minimum(r // G, T - 1)
  pos = q_positions.astype(jnp.int32)[:, t]
  if tree_mask is None:
    start = kv_lengths.astype(jnp.int32)[:, None] - T
    lim = jnp.where(real[None, :], start + t[None, :], -1)
    return pos, lim
  bits = tree_bits(tree_mask, q_positions, win)[:, t, :]
  return pos, jnp.where(real[None, :, None], bits, 0)


def block_bounds(pos, lim, kv_lengths, T: int, S: int, block_rows: int, block_k: int, win, tree: bool):
  """Flat int32[B*NR] first and end KV block per (row, row block) that can hold a visible slot."""
  B, R = pos.shape
  nr = R // block_rows
  lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, S)
  first = jnp.min(pos.reshape(B, nr, block_rows), axis=2) - win + 1
  if tree:
    # New slots are not ordered by position, so every one of them stays in range.
    end = jnp.broadcast_to(lengths[:, None], (B, nr))
    first = jnp.clip(first, 0, jnp.maximum(lengths - T, 0)[:, None])
  else:
    # Causal: nothing past the block's last own slot (padding rows have lim -1).
    end = jnp.minimum(lengths[:, None], jnp.max(lim.reshape(B, nr, block_rows), axis=2) + 1)
    first = jnp.clip(first, 0, jnp.maximum(end, 0))
  lo = first // block_k
  hi = jnp.maximum((end + block_k - 1) // block_k, lo)
  return lo.reshape(-1).astype(jnp.int32), hi.reshape(-1).astype(jnp.int32)


def to_rows(q, Hkv: int, R: int, Dp: int):
  """q[B,T,Hq,D] -> [B,Hkv,R,Dp] with row r = t*G + g, zero padded."""
  B, T, Hq, D = q.shape
  G = Hq // Hkv
  x = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, D)
  return jnp.pad(x, ((0, 0), (0, 0), (0, R - T * G), (0, Dp - D)))


def from_rows(o, T: int, Hq: int, D: int):
  B, Hkv = o.shape[:2]
  G = Hq // Hkv
  o = o[:, :, :T * G, :D].reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4)
  return o.reshape(B, T, Hq, D)


def visible(j, pos, aux, length, win, T: int, tree: bool):
  """bool mask of cache slots j (int32, broadcastable against the [rows, 1] row inputs).

  pos is [rows, 1]; aux is lim [rows, 1] (chain) or the list of mask words, each [rows, 1] (tree); length
  and win are scalars. Slots past length, including the padding past S, are never visible.
  """
  if not tree:
    return (j <= aux) & (pos - j < win)
  start = length - T
  committed = (j < start) & (pos - j < win)
  new_idx = jnp.clip(j - start, 0, T - 1)
  word = aux[0]
  for i in range(1, len(aux)):
    word = jnp.where(jnp.right_shift(new_idx, 5) == i, aux[i], word)
  bit = jnp.right_shift(word, new_idx & 31) & 1
  return committed | ((j >= start) & (j < length) & (bit != 0))


def require_backend(name: str, platform: str, interpret) -> None:
  if interpret:
    return
  backend = jax.default_backend()
  if backend != platform:
    raise RuntimeError(
        f"{name} needs a {platform.upper()} backend (jax.default_backend() is {backend!r}); "
        f"pass interpret=True to run it in the Pallas interpreter, or use impl='xla'")
