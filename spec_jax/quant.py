"""Weight-only quantization: int8 with one scale per output channel, int4 with a scale and an offset per 32
inputs.

A decode step reads every weight once, so bytes per weight set its speed. A quantized matrix is a `QTensor`:
its rows are output channels (the contraction axes moved last, as [N, K]), cut into tiles of `t` rows.
`qdot` runs over the tiles: each tile is dequantized (convert, scale) and multiplied at once, so the float copy
that exists at any time is one tile (a few MB, in cache), never the whole matrix. Written as one
convert-then-dot on the whole matrix, XLA:CPU materializes a float copy of all of it every step (262k x 640
head: 300 ms against 20 ms tiled; measured in BENCHMARKS section 11).

int4 is asymmetric, w = scale * q + offset with q in 0..15 over each group of 32 inputs: the GGUF's Q4_K
blocks are exactly of that form (a scale and a min per 32 weights), so re-quantizing them loses little (the
symmetric form measured a 50x larger KL on Gemma 3 270M). It packs two rows of a tile in one byte: the low nibble
is row r, the high nibble row r + t/2. Unpacking then makes two half tiles without a concatenate of the weights
(packing adjacent values and concatenating cost 10x). Activations stay in float; the dot accumulates in float32.
"""

from __future__ import annotations

import math
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.backend import on_cpu
from spec_jax.models import schema

MODES = ("none", "int8", "int4")
GROUP_INT4 = 32  # inputs per int4 scale
TILE_BYTES = 8 << 20  # float bytes of one dequantized tile

# Contraction axes of each layer weight, after the stacked layer axis: the schema's matmuls (models/schema.py).
LAYER_CONTRACT = {r.name: r.contract for r in schema.LAYER if r.contract}


@jax.tree_util.register_pytree_node_class
class QTensor:
  """A quantized [..., N, K] matrix. values: int8 [..., N/t, t, K] (int4: uint8 [..., N/t, t/2, K]); scale:
  float32 [..., N/t, t, 1] (int8), or int4's scale and offset: float16 [..., N/t, t, K/g]. Static: the output
  shape (N = prod(out_shape), padded up to whole tiles), how many trailing input axes the dot contracts, and the
  bit width."""

  def __init__(self, values, scale, offset, out_shape: tuple, n_in: int, bits: int):
    self.values, self.scale, self.offset = values, scale, offset
    self.out_shape, self.n_in, self.bits = tuple(out_shape), int(n_in), int(bits)

  def tree_flatten(self):
    return (self.values, self.scale, self.offset), (self.out_shape, self.n_in, self.bits)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)

  @property
  def n(self) -> int:
    return math.prod(self.out_shape)

  @property
  def tile(self) -> int:
    return self.scale.shape[-2]

  @property
  def k(self) -> int:
    return self.values.shape[-1]

  @property
  def group(self) -> int:
    return self.k // self.scale.shape[-1]

  @property
  def nbytes(self) -> int:
    parts = [a for a in (self.values, self.scale, self.offset) if a is not None]
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in parts)

  def __repr__(self):
    return f"QTensor(int{self.bits}, out={self.out_shape}, values={getattr(self.values, 'shape', None)})"


def is_quantized(params) -> bool:
  return any(isinstance(x, QTensor) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QTensor)))


def _layout(n: int, k: int, bits: int) -> tuple[int, int]:
  """(rows per tile, inputs per scale) of an [N, K] matrix: tiles of about TILE_BYTES of float and equal size,
  an even row count for int4's row pairs; int8 scales whole rows, int4 groups of GROUP_INT4 (whole rows when K
  is not a multiple of it)."""
  t = max(2, min(n, TILE_BYTES // (4 * k)))
  t = -(-n // -(-n // t))
  if bits == 8:
    return t, k
  return t + t % 2, (k if k % GROUP_INT4 else GROUP_INT4)


def quantize_matrix(w: np.ndarray, bits: int):
  """w float [N, K] -> (values, scale, offset or None) numpy arrays in the tiled layout above."""
  if bits not in (4, 8):
    raise ValueError(f"bits must be 4 or 8, got {bits}")
  w = np.asarray(w, np.float32)
  n, k = w.shape
  t, g = _layout(n, k, bits)
  pad = -n % t
  if pad:
    w = np.concatenate([w, np.zeros((pad, k), np.float32)])
  wg = w.reshape(-1, k // g, g)
  if bits == 8:
    amax = np.abs(wg).max(-1)
    scale = np.where(amax > 0, amax / 127, 1.0).astype(np.float32)
    q = np.clip(np.rint(wg / scale[..., None]), -127, 127).astype(np.int8).reshape(-1, t, k)
    return q, scale.reshape(-1, t, k // g), None
  # float16 scale and offset: 1 bit per weight on top of the 4 (float32 would add 2).
  lo = wg.min(-1).astype(np.float16)
  scale = np.maximum((wg.max(-1) - lo.astype(np.float32)) / 15, 1e-6).astype(np.float16)  # never 0
  s32, lo32 = scale.astype(np.float32)[..., None], lo.astype(np.float32)[..., None]
  q = np.clip(np.rint((wg - lo32) / s32), 0, 15).astype(np.uint8).reshape(-1, t, k)
  h = t // 2
  return q[:, :h] | (q[:, h:] << 4), scale.reshape(-1, t, k // g), lo.reshape(-1, t, k // g)


def _abstract_quantize(w, n_in: int, bits: int, stacked: bool, contract_last: bool) -> QTensor:
  """quantize() of a jax.ShapeDtypeStruct: the QTensor's layout from shapes alone (serve.aot compiles qdraft
  for models whose weights are not here)."""
  lead = w.shape[:1] if stacked else ()
  body = w.shape[len(lead):]
  out_shape, in_shape = (body[:-n_in], body[-n_in:]) if contract_last else (body[n_in:], body[:n_in])
  n, k = math.prod(out_shape), math.prod(in_shape)
  t, g = _layout(n, k, bits)
  tiles = -(-n // t)
  sds = jax.ShapeDtypeStruct
  if bits == 8:
    return QTensor(sds(lead + (tiles, t, k), jnp.int8), sds(lead + (tiles, t, k // g), jnp.float32), None,
                   out_shape, n_in, bits)
  return QTensor(sds(lead + (tiles, t // 2, k), jnp.uint8), sds(lead + (tiles, t, k // g), jnp.float16),
                 sds(lead + (tiles, t, k // g), jnp.float16), out_shape, n_in, bits)


def quantize(w, n_in: int, bits: int, *, stacked: bool = False, contract_last: bool = False) -> QTensor:
  """A float weight -> QTensor. Its first `n_in` axes (after the stacked layer axis) are the inputs, or its
  last `n_in` with contract_last (the tied embedding [V, D] read as a head). A jax.ShapeDtypeStruct gives the
  QTensor's abstract layout."""
  if isinstance(w, jax.ShapeDtypeStruct):
    return _abstract_quantize(w, n_in, bits, stacked, contract_last)
  w = np.asarray(w, np.float32)
  lead = w.shape[:1] if stacked else ()
  body = w.shape[len(lead):]
  if contract_last:
    out_shape, in_shape = body[:-n_in], body[-n_in:]
    mats = w.reshape(*lead, math.prod(out_shape), math.prod(in_shape))
  else:
    in_shape, out_shape = body[:n_in], body[n_in:]
    mats = np.swapaxes(w.reshape(*lead, math.prod(in_shape), math.prod(out_shape)), -1, -2)
  if stacked:
    parts = [quantize_matrix(m, bits) for m in mats]
    values, scale, offset = (None if parts[0][i] is None else np.stack([p[i] for p in parts]) for i in range(3))
  else:
    values, scale, offset = quantize_matrix(mats, bits)
  return QTensor(jnp.asarray(values), jnp.asarray(scale), None if offset is None else jnp.asarray(offset),
                 out_shape, n_in, bits)


def _dequant_tile(values, scale, offset, bits: int, dtype) -> list:
  """One tile -> its dequantized rows, as one [t, K] matrix (int8) or two [t/2, K] halves (int4)."""
  t, k = scale.shape[0], values.shape[-1]
  g = k // scale.shape[-1]

  def scaled(v, s, o=None):
    v = v.reshape(v.shape[0], k // g, g) * s[..., None].astype(dtype)
    return (v if o is None else v + o[..., None].astype(dtype)).reshape(v.shape[0], k)

  if bits == 8:
    return [scaled(values.astype(dtype), scale)]
  h = t // 2
  return [scaled((values & 15).astype(dtype), scale[:h], offset[:h]),
          scaled((values >> 4).astype(dtype), scale[h:], offset[h:])]


def dequantize(qt: QTensor, dtype=jnp.float32):
  """The whole float matrix [..., N, K] (tests, quality checks; never on the decode path)."""
  lead = qt.values.shape[:-3]
  flat = lambda a: None if a is None else a.reshape(-1, *a.shape[-2:])
  rows = jax.vmap(lambda v, s, o: jnp.concatenate(_dequant_tile(v, s, o, qt.bits, dtype), 0))(
      flat(qt.values), flat(qt.scale), flat(qt.offset))
  return rows.reshape(*lead, -1, qt.k)[..., :qt.n, :]


def qdot(x, qt: QTensor):
  """x [..., *in] . W -> float32 [..., *out_shape]: the tiles dequantized one at a time, each dotted at once."""
  if qt.values.ndim != 3:
    raise ValueError(f"qdot takes one matrix; got values of shape {qt.values.shape} (a stacked QTensor?)")
  lead = x.shape[:x.ndim - qt.n_in]
  if math.prod(x.shape[len(lead):]) != qt.k:
    raise ValueError(f"qdot: input {x.shape} does not contract with {qt}")
  dtype = jnp.float32 if on_cpu() else x.dtype  # XLA:CPU's float32 dots are its fast ones
  x2 = x.reshape(-1, qt.k).astype(dtype)
  dims = (((1,), (1,)), ((), ()))

  def one(tile):
    parts = _dequant_tile(*tile, qt.bits, dtype)
    outs = [jax.lax.dot_general(p, x2, dims, preferred_element_type=jnp.float32) for p in parts]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, 0)

  out = jax.lax.map(one, (qt.values, qt.scale, qt.offset))  # [N/t, t, M]
  out = out.reshape(-1, x2.shape[0])[:qt.n].T
  return out.reshape(*lead, *qt.out_shape)


def take_rows(qt: QTensor, idx, dtype=jnp.float32):
  """Rows idx of an output-major QTensor (the embedding table) -> float [..., K]."""
  t = qt.tile
  idx = jnp.asarray(idx)
  flat = idx.reshape(-1)
  tile, row = flat // t, flat % t
  scale = qt.scale[tile, row]  # [M, K/g]
  g = qt.group
  if qt.bits == 8:
    v = qt.values[tile, row].astype(dtype)
  else:
    h = t // 2
    byte = qt.values[tile, row % h]
    v = jnp.where((row < h)[:, None], byte & 15, byte >> 4).astype(dtype)
  v = v.reshape(-1, qt.k // g, g) * scale[..., None].astype(dtype)
  if qt.offset is not None:
    v = v + qt.offset[tile, row][..., None].astype(dtype)
  out = v.reshape(-1, qt.k)
  return out.reshape(*idx.shape, qt.k)


def quantize_params(params: dict, mode: str) -> dict:
  """A target's params with the layer matrices, the embedding and any untied head quantized (`mode` int8 or
  int4); norms and biases stay float. Float leaves keep their dtype."""
  if mode not in MODES:
    raise ValueError(f"quantize must be one of {MODES}, got {mode!r}")
  if mode == "none":
    return params
  if is_quantized(params):
    raise ValueError("these params are already quantized")
  bits = 8 if mode == "int8" else 4
  layers = dict(params["layers"])
  for name, n_in in LAYER_CONTRACT.items():
    layers[name] = quantize(layers[name], n_in, bits, stacked=True)
  out = {**params, "layers": layers, "embed": quantize(params["embed"], 1, bits, contract_last=True)}
  if "lm_head" in params:
    out["lm_head"] = quantize(params["lm_head"], 1, bits)
  return out


def cast_floats(params, dtype):
  """params with every float leaf (not the QTensors) cast to dtype."""
  return jax.tree.map(lambda x: x if isinstance(x, QTensor) else x.astype(dtype), params,
                      is_leaf=lambda x: isinstance(x, QTensor))


def param_bytes(params) -> int:
  """Bytes of a params pytree as held on the device (QTensor values and scales, float leaves)."""
  total = 0
  for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QTensor)):
    total += x.nbytes if isinstance(x, QTensor) else int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
  return total


def flatten(params: dict, prefix: str = "") -> tuple[dict, dict]:
  """-> ({name: array}, {name: QTensor statics}) for a safetensors file: a QTensor becomes name.values and
  name.scale."""
  arrays, statics = {}, {}
  for k, v in params.items():
    name = f"{prefix}{k}"
    if isinstance(v, dict):
      a, s = flatten(v, name + ".")
      arrays.update(a)
      statics.update(s)
    elif isinstance(v, QTensor):
      arrays[name + ".values"], arrays[name + ".scale"] = np.asarray(v.values), np.asarray(v.scale)
      if v.offset is not None:
        arrays[name + ".offset"] = np.asarray(v.offset)
      statics[name] = {"out_shape": list(v.out_shape), "n_in": v.n_in, "bits": v.bits}
    else:
      arrays[name] = np.asarray(v)
  return arrays, statics


def unflatten(arrays: dict, statics: dict, dtype=None) -> dict:
  """flatten's inverse. Float arrays take `dtype` when given."""
  out: dict = {}

  def put(name, value):
    node = out
    *path, last = name.split(".")
    for p in path:
      node = node.setdefault(p, {})
    node[last] = value

  for name, st in statics.items():
    off = arrays.get(name + ".offset")
    put(name, QTensor(jnp.asarray(arrays[name + ".values"]), jnp.asarray(arrays[name + ".scale"]),
                      None if off is None else jnp.asarray(off), tuple(st["out_shape"]), st["n_in"], st["bits"]))
  taken = {n + s for n in statics for s in (".values", ".scale", ".offset")}
  for name, a in arrays.items():
    if name not in taken:
      put(name, jnp.asarray(a, dtype) if dtype is not None else jnp.asarray(a))
  return out


def expected_shapes(shapes: dict, mode: str) -> dict:
  """name -> shape of every array flatten() writes for params of these float shapes quantized with `mode`
  (a cache is checked against it)."""
  if mode == "none":
    raise ValueError("no quantization")
  bits = 8 if mode == "int8" else 4

  out = {}

  def mat(name, n, k, lead=()):
    t, g = _layout(n, k, bits)
    tiles = -(-n // t)
    out[name + ".values"] = (*lead, tiles, t if bits == 8 else t // 2, k)
    out[name + ".scale"] = (*lead, tiles, t, k // g)
    if bits == 4:
      out[name + ".offset"] = out[name + ".scale"]

  for name, shape in shapes["layers"].items():
    if name in LAYER_CONTRACT:
      n_in = LAYER_CONTRACT[name]
      mat(f"layers.{name}", math.prod(shape[1 + n_in:]), math.prod(shape[1:1 + n_in]), shape[:1])
    else:
      out[f"layers.{name}"] = tuple(shape)
  mat("embed", shapes["embed"][0], shapes["embed"][1])
  if "lm_head" in shapes:
    mat("lm_head", shapes["lm_head"][1], shapes["lm_head"][0])
  out["final_norm"] = tuple(shapes["final_norm"])
  return out
