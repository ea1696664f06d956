"""Weight-only quantization (spec_jax/quant.py) on tiny shapes: the tiled dequantize-dot against an einsum of the
dequantized matrix, the quantization error against the step, row gathers, the absence of a whole-matrix float
copy, quantized forward/generate against the same weights in float, the cache beside a GGUF, and qdraft."""

import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import quant
from spec_jax.checkpoints.load import load_params
from spec_jax.batch import generate
from spec_jax.models.transformer import forward, init_params, param_shapes
from spec_jax.proposers.draft import DraftModelProposer
from spec_jax.proposers.ngram import NgramProposer
from spec_jax.quant import QTensor, dequantize, qdot, quantize, quantize_params, take_rows
from tests.checkpoints.gguf_writer import write_tiny_gguf
from tests.conftest import tiny_gemma_config, tiny_llama_config
from tests.distribution import assert_same_distribution, sample_plain_and_speculative

CONFIG = tiny_gemma_config(eos_ids=(1,))
# The greedy runs share these prompts and length, so they share one compiled plain-decoding loop.
PROMPTS = [[2, 71, 5, 33, 18], [2, 9, 60, 41, 7, 88, 12, 50, 3, 26, 64], [2, 45, 90]]
N_NEW = 16


@functools.lru_cache(maxsize=None)
def _params(seed=0, config=CONFIG):
  return init_params(config, jax.random.PRNGKey(seed))


def _restore(qt: QTensor, shape, contract_last=False):
  """dequantize(qt) [..., N, K] back to the weight's own layout `shape` (inverse of quantize's reshapes)."""
  deq = dequantize(qt)
  if contract_last:
    return deq.reshape(shape)
  return jnp.swapaxes(deq, -1, -2).reshape(shape)


def _as_matrix(w, n_in, lead, contract_last=False):
  """The reference [..., N, K] (outputs x inputs) matrix of a weight in its own layout, written independently of
  quant.py."""
  body = w.shape[lead:]
  if contract_last:
    return w.reshape(*w.shape[:lead], math.prod(body[:-n_in]), math.prod(body[-n_in:]))
  k, n = math.prod(body[:n_in]), math.prod(body[n_in:])
  return np.swapaxes(w.reshape(*w.shape[:lead], k, n), -1, -2)


def _dequantized_params(qparams: dict, config) -> dict:
  """The float params whose every weight is exactly what the QTensor holds (norms untouched)."""
  shapes = param_shapes(config)
  layers = {name: _restore(v, shapes["layers"][name]) if isinstance(v, QTensor) else v
            for name, v in qparams["layers"].items()}
  out = {**qparams, "layers": layers, "embed": _restore(qparams["embed"], shapes["embed"], contract_last=True)}
  if "lm_head" in qparams:
    out["lm_head"] = _restore(qparams["lm_head"], shapes["lm_head"])
  assert not quant.is_quantized(out)
  return out


# name: (weight shape, n_in, stacked, contract_last, the model's einsum)
CASES = {
    "layer_qkv": ((3, 32, 4, 16), 1, True, False, "btd,dhk->bthk"),  # [L, D, H, d], scanned per layer
    "layer_o": ((2, 4, 16, 40), 2, True, False, "bthk,hkd->btd"),  # [L, H, d, D]: two contracted axes, K = 64
    "embed_head": ((50, 32), 1, False, True, "btd,vd->btv"),  # [V, D] read as the tied head
    "odd": ((40, 37), 1, False, False, "btd,dn->btn"),  # N = 37 odd; K = 40: int4 has one group per row
    "odd_head": ((37, 40), 1, False, True, "btd,vd->btv"),
}


@pytest.mark.parametrize("tile_rows", [None, 7], ids=["one_tile", "tiles_of_7"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_qdot_matches_einsum_of_dequantized(case, bits, tile_rows, monkeypatch):
  shape, n_in, stacked, contract_last, eq = CASES[case]
  lead = 1 if stacked else 0
  body = shape[lead:]
  in_shape = body[-n_in:] if contract_last else body[:n_in]
  n, k = math.prod(body) // math.prod(in_shape), math.prod(in_shape)
  if tile_rows:
    monkeypatch.setattr(quant, "TILE_BYTES", 4 * k * tile_rows)
  rng = np.random.default_rng(10 * sorted(CASES).index(case) + bits)
  w = rng.standard_normal(shape).astype(np.float32)
  w[..., 0] *= 5.0  # uneven magnitudes: some rows and groups get much larger scales than others
  q = quantize(w, n_in, bits, stacked=stacked, contract_last=contract_last)
  assert q.bits == bits and q.n_in == n_in and q.n == n and q.k == k

  tiles = q.values.shape[-3]
  if tile_rows:
    assert tiles >= 5, q.values.shape  # several tiles (37..50 rows in tiles of about 7)
  else:
    assert tiles == 1, q.values.shape
  assert tiles * q.tile >= n and (tiles - 1) * q.tile < n
  if case.startswith("odd") and tile_rows:
    assert n % q.tile != 0  # the last tile is padded
  if bits == 4:
    assert q.group == (32 if k % 32 == 0 else k)
    assert q.values.dtype == jnp.uint8 and q.values.shape[-2] * 2 == q.tile  # two rows a byte
  else:
    assert q.group == k and q.values.dtype == jnp.int8 and q.offset is None

  # The dequantized matrix is within half a step of the original, with the documented scales: int8 max|row| / 127
  # (float32); int4 (max - min) / 15 and offset min per group, stored in float16 (2^-11 relative rounding, which
  # may push the group's extreme values up to that much past half a step).
  ref = _as_matrix(w, n_in, lead, contract_last)  # [..., N, K]
  deq = np.asarray(dequantize(q))
  assert deq.shape == ref.shape and deq.dtype == np.float32
  g = q.group
  rows = lambda a: np.asarray(a, np.float32).reshape(*shape[:lead], -1, k // g)[..., :n, :]
  scale = rows(q.scale)
  groups = ref.reshape(*ref.shape[:-1], k // g, g)
  if bits == 8:
    np.testing.assert_allclose(scale[..., 0], np.abs(ref).max(-1) / 127, rtol=1e-6)
    slack = np.zeros_like(ref)
  else:
    offset = rows(q.offset)
    np.testing.assert_allclose(scale, (groups.max(-1) - groups.min(-1)) / 15, rtol=2**-10, atol=1e-6)
    np.testing.assert_allclose(offset, groups.min(-1), rtol=2**-10, atol=1e-7)
    slack = np.repeat(2**-11 * (np.abs(offset) + 16 * scale), g, axis=-1)
  step = np.repeat(scale, g, axis=-1)
  err = np.abs(deq - ref)
  bound = step / 2 + slack + 1e-6 * np.abs(ref) + 1e-7
  assert (err <= bound).all(), f"max err / bound {np.max(err / bound)}"
  assert np.max(err / step) > 0.3  # the error is real rounding, not a float copy smuggled through
  # The same holds back in the weight's own layout (the restore the forward tests below use).
  to_w = lambda m: m.reshape(shape) if contract_last else np.swapaxes(m, -1, -2).reshape(shape)
  assert (np.abs(np.asarray(_restore(q, shape, contract_last)) - w) <= to_w(bound)).all()

  x = jnp.asarray(rng.standard_normal((2, 3, *in_shape)).astype(np.float32))
  w_deq = _restore(q, shape, contract_last)
  for layer in range(shape[0] if stacked else 1):
    ql = jax.tree.map(lambda a: a[layer], q) if stacked else q
    got = qdot(x, ql)
    want = jnp.einsum(eq, x, w_deq[layer] if stacked else w_deq, precision=jax.lax.Precision.HIGHEST)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_qdot_rejects_a_stacked_or_mismatched_input():
  q = quantize(np.ones((2, 8, 6), np.float32), 1, 8, stacked=True)
  with pytest.raises(ValueError, match="stacked"):
    qdot(jnp.ones((1, 8)), q)
  with pytest.raises(ValueError, match="contract"):
    qdot(jnp.ones((1, 7)), jax.tree.map(lambda a: a[0], q))


@pytest.mark.parametrize("k", [64, 40])
@pytest.mark.parametrize("bits", [8, 4])
def test_take_rows_equals_rows_of_dequantize(bits, k, monkeypatch):
  monkeypatch.setattr(quant, "TILE_BYTES", 4 * k * 7)
  v = 45
  w = np.random.default_rng(bits + k).standard_normal((v, k)).astype(np.float32)
  q = quantize(w, 1, bits, contract_last=True)
  t = q.tile
  assert q.values.shape[0] >= 5 and v % t != 0  # several tiles, the last one padded
  full = np.asarray(dequantize(q))
  # First tile (both nibble halves for int4), the next tile's first row, rows of the padded last tile.
  idx = np.array([[0, 1, t // 2 - 1, t // 2, t - 1], [t, 2 * t + t // 2, v - 3, v - 2, v - 1]])
  take = jax.jit(take_rows, static_argnums=2)
  got = take(q, jnp.asarray(idx), jnp.float32)
  assert got.shape == (2, 5, k)
  np.testing.assert_allclose(np.asarray(got), full[idx], rtol=1e-6, atol=1e-7)
  all_rows = take(q, jnp.arange(v)[None].repeat(2, 0), jnp.float32)  # every row, as embed() gathers [B, T]
  np.testing.assert_allclose(np.asarray(all_rows), np.broadcast_to(full, (2, v, k)), rtol=1e-6, atol=1e-7)
  assert take_rows(q, jnp.asarray([3]), jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("bits", [8, 4])
def test_qdot_never_materializes_the_whole_float_matrix(bits):
  """65536 x 256 at the default tile size (8 tiles of 8 MB): XLA's temporaries stay near one tile, while the
  naive whole-matrix convert-then-dot needs the full 64 MB float copy (measured 8.9 MB against 67.1 MB)."""
  n, k = 65536, 256
  w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
  q = quantize(w, 1, bits, contract_last=True)
  assert q.values.shape[0] >= 4
  x = jnp.ones((2, k), jnp.float32)
  full = n * k * 4
  tiled = jax.jit(qdot).lower(x, q).compile().memory_analysis().temp_size_in_bytes
  naive = jax.jit(lambda x, q: x @ dequantize(q).T).lower(x, q).compile().memory_analysis().temp_size_in_bytes
  assert tiled < full / 4, (tiled, full)
  assert naive >= full, (naive, full)  # the measure tells the two forms apart


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("config", [CONFIG, tiny_llama_config(eos_ids=(1,))], ids=["gemma_tied", "llama_head"])
def test_forward_and_greedy_equal_the_dequantized_float_model(config, mode):
  params = _params(0, config)
  qparams = quantize_params(params, mode)
  bits = 8 if mode == "int8" else 4
  for name in quant.LAYER_CONTRACT:
    assert isinstance(qparams["layers"][name], QTensor) and qparams["layers"][name].bits == bits
  assert isinstance(qparams["embed"], QTensor)
  assert isinstance(qparams.get("lm_head"), QTensor) == ("lm_head" in params)
  for name in ("attn_norm", "mlp_norm"):
    assert qparams["layers"][name] is params["layers"][name]  # norms stay float
  assert quant.param_bytes(qparams) < quant.param_bytes(params) / (2.5 if mode == "int8" else 4)
  fparams = _dequantized_params(qparams, config)

  tokens = jnp.asarray(np.random.default_rng(1).integers(3, config.vocab_size, (2, 12)), jnp.int32)
  fwd = jax.jit(lambda p, t: forward(p, t, config=config)[0])
  got, want, orig = fwd(qparams, tokens), fwd(fparams, tokens), fwd(params, tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
  # ... and the quantization changed the model measurably (the comparison above is not float vs float).
  assert np.abs(np.asarray(got) - np.asarray(orig)).max() > 1e-3

  if config is not CONFIG:
    return  # greedy runs on one config: compiles dominate this file's time
  base = generate(fparams, config, PROMPTS, max_new_tokens=N_NEW)
  q = generate(qparams, config, PROMPTS, max_new_tokens=N_NEW)
  assert q.token_ids == base.token_ids
  if mode != "int8":
    return
  # The quantized target verifying speculative drafts (ngram): still its own greedy output.
  spec = generate(qparams, config, PROMPTS, max_new_tokens=N_NEW, proposer=NgramProposer(k=3), adaptive_k=False)
  assert spec.token_ids == base.token_ids
  assert spec.stats["accepted_tokens"] > 0  # measured 20 of 21 drafted


def _assert_same_quantized(a: dict, b: dict):
  aa, sa = quant.flatten(a)
  ab, sb = quant.flatten(b)
  assert sa == sb
  assert set(aa) == set(ab)
  for name in aa:
    assert aa[name].dtype == ab[name].dtype, name
    np.testing.assert_array_equal(aa[name], ab[name], err_msg=name)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_flatten_unflatten_and_expected_shapes(mode, monkeypatch):
  monkeypatch.setattr(quant, "TILE_BYTES", 4 * 32 * 10)  # several tiles, padded (97-row embedding)
  config = tiny_llama_config(eos_ids=(1,))  # untied: lm_head too
  qparams = quantize_params(_params(0, config), mode)
  assert qparams["embed"].values.shape[0] > 1
  arrays, statics = quant.flatten(qparams)
  assert "embed.values" in arrays and "embed.scale" in arrays and "layers.q.values" in arrays
  assert ("embed.offset" in arrays) == (mode == "int4")
  assert statics["layers.o"] == {"out_shape": [config.d_model], "n_in": 2, "bits": 8 if mode == "int8" else 4}
  back = quant.unflatten(arrays, statics)
  assert jax.tree.structure(back) == jax.tree.structure(qparams)
  _assert_same_quantized(back, qparams)
  # The shapes the cache is checked against are exactly what flatten writes.
  assert quant.expected_shapes(param_shapes(config), mode) == {k: v.shape for k, v in arrays.items()}
  # dtype converts float leaves only: a QTensor's scales and values keep theirs.
  b16 = quant.unflatten(arrays, statics, jnp.bfloat16)
  assert b16["final_norm"].dtype == jnp.bfloat16 and b16["layers"]["attn_norm"].dtype == jnp.bfloat16
  for name in ("embed", "lm_head"):
    for part in ("values", "scale", "offset"):
      assert getattr(getattr(b16[name], part), "dtype", None) == getattr(getattr(qparams[name], part), "dtype", None)


def test_quantize_params_rejects_bad_modes_and_quantized_params():
  params = _params(0)
  with pytest.raises(ValueError, match="int3"):
    quantize_params(params, "int3")
  assert quantize_params(params, "none") is params
  q = quantize_params(params, "int8")
  assert quant.is_quantized(q) and not quant.is_quantized(params)
  with pytest.raises(ValueError, match="already quantized"):
    quantize_params(q, "int4")
  with pytest.raises(ValueError, match="bits"):
    quant.quantize_matrix(np.ones((4, 4)), 2)


# --- the cache beside a GGUF ---------------------------------------------------------------------------------

GGUF_CONFIG = tiny_gemma_config(num_layers=2, global_every=2, eos_ids=(1, 106))


@pytest.fixture()
def counted(monkeypatch):
  """Counts quantize_params calls (the rebuilds); reference quantizations go through `real`."""
  real = quant.quantize_params
  calls = []

  def counting(params, mode):
    calls.append(mode)
    return real(params, mode)

  monkeypatch.setattr(quant, "quantize_params", counting)
  return calls, real


def _tiny_gguf(path, seed):
  params = jax.tree.map(np.asarray, init_params(GGUF_CONFIG, jax.random.PRNGKey(seed)))
  write_tiny_gguf(path, GGUF_CONFIG, params)
  return params


def _read_json(path):
  with open(path) as f:
    return json.load(f)


def _write(path, data, mode="w"):
  with open(path, mode) as f:
    f.write(data)


def test_quantized_cache_is_reused_and_rebuilt_when_invalid(tmp_path, counted):
  calls, real = counted
  path = str(tmp_path / "tiny.gguf")
  src = _tiny_gguf(path, 0)
  fresh = real(src, "int8")
  cfile = path + ".spec_jax.int8.safetensors"
  meta_file = cfile + ".json"

  def load_and_check(rebuilt, want=fresh):
    before = len(calls)
    config, params = load_params(path, "float32", "int8")
    assert config.num_layers == GGUF_CONFIG.num_layers
    assert len(calls) - before == int(rebuilt), ("served an invalid cache" if rebuilt
                                                 else "quantized again although the cache was valid")
    _assert_same_quantized(params, want)
    return params

  load_and_check(True)
  assert os.path.exists(cfile) and os.path.exists(meta_file)
  load_and_check(False)  # the cache is served: no second quantization
  with open(cfile, "rb") as f:
    good = f.read()

  def corrupt_and_reload(data):
    _write(cfile, data, "wb")
    load_and_check(True)
    load_and_check(False)  # the rebuild rewrote a valid cache

  flipped = bytearray(good)
  flipped[len(good) // 2] ^= 0x40
  corrupt_and_reload(bytes(flipped))
  corrupt_and_reload(good[: len(good) * 2 // 3])  # truncated
  corrupt_and_reload(b"")

  meta = _read_json(meta_file)
  for key, value in (("mode", "int4"), ("format", "0"), ("sha256", "0" * 64), ("source", "f" * 32)):
    _write(meta_file, json.dumps({**meta, key: value}))
    load_and_check(True)
    load_and_check(False)
  _write(meta_file, "{not json")
  load_and_check(True)
  os.remove(meta_file)
  load_and_check(True)

  # A well-formed file whose sha256 matches its record but whose tensors do not fit this config (one tensor of
  # the wrong shape; one missing): rebuilt, not served.
  from spec_jax.checkpoints import safetensors_io
  from spec_jax.checkpoints.quant_cache import _sha256
  for edit in ("shape", "missing", "dtype"):
    arrays = safetensors_io.read(cfile)
    if edit == "shape":
      arrays["layers.q.scale"] = arrays["layers.q.scale"][..., :1, :]
    elif edit == "missing":
      del arrays["embed.scale"]
    else:
      arrays["layers.up.values"] = arrays["layers.up.values"].astype(np.int16)
    safetensors_io.write(cfile, arrays)
    _write(meta_file, json.dumps({**_read_json(meta_file), "sha256": _sha256(cfile)}))
    load_and_check(True)

  # int4 has its own cache file beside int8's.
  _, p4 = load_params(path, "float32", "int4")
  _assert_same_quantized(p4, real(src, "int4"))
  assert os.path.exists(path + ".spec_jax.int4.safetensors")
  load_and_check(False)

  # The GGUF replaced by different weights: quantized again from the new file.
  other = _tiny_gguf(path, 1)
  load_and_check(True, real(other, "int8"))
  load_and_check(False, real(other, "int8"))


# --- qdraft ----------------------------------------------------------------------------------------------------

def test_qdraft_greedy_is_lossless():
  params = _params(0)
  base = generate(params, CONFIG, PROMPTS, max_new_tokens=N_NEW)
  for mode in ("int8", "int4"):
    proposer = DraftModelProposer(config=CONFIG, k=3, name="qdraft")
    spec = generate(params, CONFIG, PROMPTS, max_new_tokens=N_NEW, proposer=proposer,
                    proposer_params=quantize_params(params, mode), adaptive_k=False)
    assert spec.token_ids == base.token_ids
    # The target's own weights, slightly rounded, draft nearly always its greedy token (measured 1.0 for both).
    assert spec.stats["acceptance_rate"] > 0.8, (mode, spec.stats)


def test_qdraft_through_the_registry(tmp_path):
  """build_proposer("qdraft") loads the checkpoint quantized (cached beside it) into a draft of the target's own
  architecture; what such a draft generates is test_qdraft_greedy_is_lossless's subject."""
  from spec_jax.proposers.registry import Target, build_proposer
  from spec_jax.spec_config import SpecConfig
  path = str(tmp_path / "tiny.gguf")
  _tiny_gguf(path, 0)
  config, params = load_params(path, "float32")
  proposer, pparams = build_proposer(SpecConfig("qdraft", 3, quantization="int4"), Target(config, params, model_path=path, dtype="float32"))
  assert isinstance(proposer, DraftModelProposer) and proposer.name == "qdraft" and proposer.k == 3
  assert proposer.config == config.replace(name=proposer.config.name)  # the target's architecture, all layers
  assert isinstance(pparams["embed"], QTensor) and pparams["embed"].bits == 4
  _assert_same_quantized(pparams, quantize_params(params, "int4"))
  assert os.path.exists(path + ".spec_jax.int4.safetensors")  # cached like a quantized target

  with pytest.raises(ValueError, match="already quantized"):
    build_proposer(SpecConfig("qdraft", 3, quantization="int8"), Target(config, quantize_params(params, "int8"), model_path=path, dtype="float32"))
  with pytest.raises(ValueError, match="int8 or int4"):
    build_proposer(SpecConfig("qdraft", 3, quantization="int2"), Target(config, params, model_path=path, dtype="float32"))


@pytest.mark.full  # the draft-vocabulary case below samples the same int4 self-draft, accept and residual paths
def test_qdraft_sampling_matches_plain_sampling_distribution():
  """As test_decode's test for a draft model, with the target's own int4 weights drafting (acceptance high but
  not 1: both the accept and the residual-resample paths run)."""
  config = tiny_gemma_config(vocab_size=8, eos_ids=(99,))
  params = init_params(config, jax.random.PRNGKey(3))
  draft = DraftModelProposer(config=config, k=2, name="qdraft")
  plain, specd, rates = sample_plain_and_speculative(params, config, draft, quantize_params(params, "int4"), n=500,
                                                     calls=4)
  assert 0.4 < np.mean(rates) < 0.95, rates  # measured 0.71
  assert_same_distribution(plain, specd)


def _vocab_checkpoint(tmp_path, config, d2t, name="vocab"):
  from spec_jax.checkpoints.heads import save_heads
  stem = str(tmp_path / name)
  save_heads(stem, "vocab", {}, config, {}, np.asarray(d2t, np.int32))
  return stem


def test_qdraft_over_a_draft_vocabulary(tmp_path):
  """qdraft with a vocabulary checkpoint projects onto N rows of the int8 head and drafts target ids through d2t:
  greedy output unchanged, and acceptance as high as with all V rows when the N ids hold what the target says
  (draft ids not mapped back through d2t would be rejected nearly always). Without --heads it drafts over all
  V ids."""
  from spec_jax.proposers.registry import Target, build_proposer
  from spec_jax.spec_config import SpecConfig
  path = str(tmp_path / "tiny.gguf")
  _tiny_gguf(path, 0)
  config, params = load_params(path, "float32")
  config = config.replace(eos_ids=())
  base = generate(params, config, PROMPTS, max_new_tokens=N_NEW)
  said = sorted({t for row in base.token_ids for t in row})
  rest = [t for t in range(config.vocab_size) if t not in said][::7]
  d2t = np.sort(np.asarray(said + rest, np.int32))
  assert len(d2t) < config.vocab_size // 2
  stem = _vocab_checkpoint(tmp_path, config, d2t)
  target = Target(config, params, model_path=path, dtype="float32")
  proposer, pparams = build_proposer(SpecConfig("qdraft", 3, model=stem), target)
  assert pparams["rows"].shape == (len(d2t), config.d_model)
  np.testing.assert_array_equal(np.asarray(pparams["d2t"]), d2t)
  spec = generate(params, config, PROMPTS, max_new_tokens=N_NEW, proposer=proposer, proposer_params=pparams,
                  adaptive_k=False)
  assert spec.token_ids == base.token_ids
  assert spec.stats["acceptance_rate"] > 0.8, spec.stats

  _, full = build_proposer(SpecConfig("qdraft", 3), target)
  assert "rows" not in full and "d2t" not in full
  from spec_jax.checkpoints.heads import save_heads
  save_heads(str(tmp_path / "medusa"), "medusa", {"w": np.zeros((2, 2), np.float32)}, config, {}, d2t)
  with pytest.raises(ValueError, match="'vocab' head"):
    build_proposer(SpecConfig("qdraft", 3, model=str(tmp_path / "medusa")), target)
  other = tiny_gemma_config(vocab_size=config.vocab_size + 1)
  with pytest.raises(ValueError, match="fingerprint"):
    build_proposer(SpecConfig("qdraft", 3, model=_vocab_checkpoint(tmp_path, other, [1, 2], "other")), target)


def test_qdraft_over_a_draft_vocabulary_samples_the_targets_distribution():
  """The int4 self-draft over 5 of 8 ids: the 3 it cannot propose come only from the residual, and q is
  scattered into the full vocabulary (zero outside d2t), so the output distribution is still the target's."""
  from spec_jax.proposers import vocab
  config = tiny_gemma_config(vocab_size=8, eos_ids=(99,))
  params = init_params(config, jax.random.PRNGKey(3))
  d2t = jnp.asarray([0, 2, 3, 5, 6], jnp.int32)
  qp = quantize_params(params, "int4")
  qp = dict(qp, rows=vocab.output_rows(qp, d2t), d2t=d2t)
  draft = DraftModelProposer(config=config, k=2, name="qdraft")
  plain, specd, rates = sample_plain_and_speculative(params, config, draft, qp, n=500, calls=4)
  assert 0.2 < np.mean(rates) < 0.95, rates
  assert_same_distribution(plain, specd)


def test_spec_config_qdraft_quantization():
  from spec_jax.spec_config import parse
  sc = parse('{"method":"qdraft","num_speculative_tokens":3,"quantization":"int4"}')
  assert (sc.method, sc.k, sc.quantization) == ("qdraft", 3, "int4")
  assert parse('{"method":"qdraft","num_speculative_tokens":2}').quantization == "int8"
  for bad in ('"int3"', '"none"', "8"):
    with pytest.raises(ValueError, match="quantization"):
      parse('{"method":"qdraft","num_speculative_tokens":3,"quantization":%s}' % bad)
  with pytest.raises(ValueError, match="quantization differs"):
    parse('{"method":"qdraft","per_concurrency":{"1":{"num_speculative_tokens":4,'
          '"quantization":"int4"},"8":{"num_speculative_tokens":2,"quantization":"int8"}}}')


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape,n_in,stacked,contract_last", [
    ((3, 64, 4, 16), 1, True, False), ((3, 4, 16, 64), 2, True, False), ((300, 64), 1, False, True),
    ((64, 300), 1, False, False)])
def test_abstract_quantize_has_the_layout_of_the_real_one(bits, shape, n_in, stacked, contract_last):
  """serve.aot quantizes shapes (jax.ShapeDtypeStruct) for models whose weights are not here: the QTensor it gets
  has exactly the leaves, shapes, dtypes and statics of quantizing real weights of that shape."""
  w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
  real = quant.quantize(w, n_in, bits, stacked=stacked, contract_last=contract_last)
  abstract = quant.quantize(jax.ShapeDtypeStruct(shape, jnp.float32), n_in, bits, stacked=stacked,
                            contract_last=contract_last)
  assert jax.tree.structure(real) == jax.tree.structure(abstract)
  assert [(x.shape, x.dtype) for x in jax.tree.leaves(real)] == [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)]
