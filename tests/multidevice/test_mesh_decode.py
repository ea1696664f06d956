"""The decode loop sharded over a ('data', 'model') mesh of 8 simulated CPU devices: greedy output is token for
token the one-device output for every proposer, at batch 1 and 8, on meshes 8x1, 4x2 and 2x4; sampled output
has the one-device distribution; and the arrays really are laid out as spec_jax/sharding.py's table says."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spec_jax import sharding, slots
from spec_jax.decode import decode_loop, make_spec
from spec_jax.batch import generate, result, start
from spec_jax.models.transformer import init_params
from spec_jax.proposers import eagle
from spec_jax.proposers.draft import DraftModelProposer
from tests.conftest import tiny_gemma_config
from tests.test_slots import _proposer as slots_proposer
from tests.distribution import assert_same_distribution, sample_plain_and_speculative

# Vocabulary, heads and MLP divide by every `model` size used here, so all of them really split.
CONFIG = tiny_gemma_config(vocab_size=128, eos_ids=(1,))
MESHES = ("data:8", "data:4,model:2", "data:2,model:4")
MAX_NEW = 12


@functools.lru_cache(maxsize=None)
def _params():
  return init_params(CONFIG, jax.random.PRNGKey(0))


def _proposer(name):
  return slots_proposer(name, _params(), CONFIG)


def _prompts(n):
  rng = np.random.default_rng(n)
  out = []
  for L in rng.integers(4, 20, n):  # different lengths; a repeated span so that copying proposers get accepted
    span = rng.integers(3, CONFIG.vocab_size, max(int(L) // 3, 1)).tolist()
    out.append(([2] + span * 3)[:int(L)])
  return out


@functools.lru_cache(maxsize=None)
def _alone(name, batch):
  prop, pp = _proposer(name)
  return generate(_params(), CONFIG, _prompts(batch), max_new_tokens=MAX_NEW, proposer=prop, proposer_params=pp,
                  adaptive_k=False)


# Each case is a compile of the whole loop (two with its one-device reference), the cost of this file. make test
# runs a stateful chain (the draft model's cache) and a tree (EAGLE's layer, its tree mask) on the mesh that splits
# both axes, and batch 1 (prompts padded to the data axis, spec_jax/batch.py, before any proposer state exists) on
# data:8; the EAGLE chain runs below, on data:4,model:2 with an 8-bit cache and through the TPU kernel. The other
# proposers and batch 1 on data:4,model:2 share those paths: make test-full (marked full; tests/test_multidevice.py
# passes the mark on).
FULL = pytest.mark.full
CASES = ([("data:2,model:4", "draft", 8), ("data:2,model:4", "eagle_tree", 8), ("data:8", "none", 1)]
         + [pytest.param("data:2,model:4", name, 8, marks=FULL) for name in ("none", "ngram", "suffix", "medusa",
                                                                              "eagle")]
         + [pytest.param("data:4,model:2", "draft", 1, marks=FULL)])


@pytest.mark.parametrize("mesh_text,name,batch", CASES)
def test_greedy_identical_to_one_device(mesh_text, name, batch):
  mesh = sharding.make_mesh(mesh_text)
  prop, pp = _proposer(name)
  out = generate(_params(), CONFIG, _prompts(batch), max_new_tokens=MAX_NEW, proposer=prop, proposer_params=pp,
                 adaptive_k=False, mesh=mesh)
  ref = _alone(name, batch)
  assert out.token_ids == ref.token_ids
  assert out.finish_reasons == ref.finish_reasons
  if name != "none":
    assert out.stats["drafted_tokens"] == ref.stats["drafted_tokens"] > 0
    assert out.stats["accepted_tokens"] == ref.stats["accepted_tokens"]


def test_an_8_bit_cache_on_a_mesh_is_identical_to_one_device():
  """EAGLE on an int8 cache (the target's and the layer's) over data:4,model:2: the scales split like the pages,
  the same tokens and counters as one device."""
  prop, pp = _proposer("eagle")
  run = lambda mesh: generate(_params(), CONFIG, _prompts(8), max_new_tokens=MAX_NEW, proposer=prop,
                              proposer_params=pp, adaptive_k=False, mesh=mesh, kv_cache_dtype="int8")
  out, ref = run(sharding.make_mesh("data:4,model:2")), run(None)
  assert out.token_ids == ref.token_ids
  assert out.stats["drafted_tokens"] == ref.stats["drafted_tokens"] > 0
  assert out.stats["accepted_tokens"] == ref.stats["accepted_tokens"]


def test_layout_follows_the_table():
  """Parameters, the target cache, the decode state and the proposer states carry the table's shardings, in the
  arrays the compiled loop takes and gives back."""
  mesh = sharding.make_mesh("data:2,model:4")
  prop, pp = _proposer("eagle")
  spec = make_spec(CONFIG, prop, adaptive_k=False, mesh=mesh)
  both = sharding.shard_params({"target": _params(), "proposer": pp}, mesh)
  t = both["target"]
  assert sharding.spec_of(t["embed"]) == P("model", None)  # the tied embedding / LM head split by vocabulary
  assert sharding.spec_of(t["layers"]["q"]) == P(None, None, "model", None)  # query heads
  assert sharding.spec_of(t["layers"]["k"]) == P(None, None, None, None)  # one KV head: whole on every shard
  assert sharding.spec_of(t["layers"]["o"]) == P(None, "model", None, None)
  assert sharding.spec_of(t["layers"]["gate"]) == P(None, None, "model")  # MLP
  assert sharding.spec_of(t["layers"]["down"]) == P(None, "model", None)
  assert sharding.spec_of(t["final_norm"]) == P(None)
  assert sharding.spec_of(both["proposer"]["layer"]["gate"]) == P(None, "model")  # EAGLE's own layer
  assert sharding.spec_of(both["proposer"]["fc"]) == P(None, "model")  # its input projection, on output features
  # Each device holds a quarter of the embedding rows.
  assert t["embed"].addressable_shards[0].data.shape == (CONFIG.vocab_size // 4, CONFIG.d_model)
  state = start(both, spec, _prompts(3), max_new_tokens=MAX_NEW)
  state = decode_loop(both, state, spec)  # what the compiled loop gives back
  kv = (None, "data", None, None, None)
  for arr, want in ((state.cache.k, kv), (state.tokens, ("data",)), (state.lengths, ("data",)),
                    (state.last_hidden, ("data",)), (state.stats.accepted_at, ("data",)), (state.keys, ("data",)),
                    (state.adapt.costs, ()), (state.step, ()), (state.pstate.cache.k, kv),
                    (state.pstate.pend_feat, ("data",))):
    assert _full(sharding.spec_of(arr), arr.ndim) == _full(want, arr.ndim), (arr.shape, sharding.spec_of(arr), want)
  assert state.cache.k.addressable_shards[0].data.shape[1] == state.cache.k.shape[1] // 2  # rows split in 2


def test_eagle3_splits_fc_and_fuse_and_its_state_follows_the_table():
  """EAGLE-3's fc [2D, D] and fuse [3D, D] split over 'model' on their output features (no chip holds either
  whole), yet the loop gives the head's state back in the table's layout, and greedy output is one device's."""
  mesh = sharding.make_mesh("data:2,model:4")
  ecfg = eagle.layer_config(CONFIG)
  w = eagle.init_params(jax.random.PRNGKey(4), ecfg, target_params=_params(), num_feature_layers=3)
  prop = eagle.EagleProposer(config=ecfg, vocab_size=CONFIG.vocab_size, k=3, feature_layers=(0, 1, 3))
  pp = eagle.runtime_params(w, _params())
  spec = make_spec(CONFIG, prop, adaptive_k=False, mesh=mesh)
  both = sharding.shard_params({"target": _params(), "proposer": pp}, mesh)
  for name in ("fc", "fuse"):
    assert sharding.spec_of(both["proposer"][name]) == P(None, "model"), name
    assert both["proposer"][name].addressable_shards[0].data.shape[1] == CONFIG.d_model // 4
  prompts = _prompts(8)
  state = decode_loop(both, start(both, spec, prompts, max_new_tokens=MAX_NEW), spec)
  for arr in (state.pstate.pend_feat, state.last_hidden, state.pstate.pend_tok):
    assert _full(sharding.spec_of(arr), arr.ndim) == _full(("data",), arr.ndim), (arr.shape, sharding.spec_of(arr))
  out = result(state, len(prompts), spec)
  ref = generate(_params(), CONFIG, prompts, max_new_tokens=MAX_NEW, proposer=prop, proposer_params=pp,
                 adaptive_k=False)
  assert out.token_ids == ref.token_ids
  assert out.stats["drafted_tokens"] == ref.stats["drafted_tokens"] > 0
  assert out.stats["accepted_tokens"] == ref.stats["accepted_tokens"]


def _full(spec, ndim):
  return tuple(spec) + (None,) * (ndim - len(spec))


def test_slots_on_a_mesh_equal_the_request_alone():
  """The server's path: empty slots split over `data`, a request inserted mid-decode equals it alone."""
  mesh = sharding.make_mesh("data:4,model:2")
  prop, pp = _proposer("draft")
  spec = make_spec(CONFIG, prop, adaptive_k=False, mesh=mesh)
  both = sharding.shard_params({"target": _params(), "proposer": pp}, mesh)
  prompts = _prompts(3)
  alone = [generate(_params(), CONFIG, [p], max_new_tokens=MAX_NEW, proposer=prop, proposer_params=pp,
                    adaptive_k=False).token_ids[0] for p in prompts]
  state = slots.empty_state(both, spec, batch=4, capacity=128)
  req = lambda p: slots.make_request(p, max_new=MAX_NEW, spec=spec, capacity=128)
  state = slots.insert(both, state, 0, req(prompts[0]), spec)
  state = decode_loop(both, state, spec, 3)
  state = slots.insert(both, state, 3, req(prompts[1]), spec)
  state = slots.insert(both, state, 1, req(prompts[2]), spec)
  while not bool(np.all(np.asarray(state.done))):
    state = decode_loop(both, state, spec, 4)
  snap = slots.snapshot(state)
  toks, pl, ln = np.asarray(snap.tokens), np.asarray(snap.prompt_lens), np.asarray(snap.lengths)
  assert [toks[s, pl[s]:ln[s]].tolist() for s in (0, 3, 1)] == alone
  assert sharding.spec_of(state.cache.k)[1] == "data"
  assert sharding.spec_of(state.pstate.k)[1] == "data"  # the draft model's own cache
  with pytest.raises(ValueError, match="data axis"):
    slots.empty_state(both, spec, batch=3, capacity=128)


def test_sampled_distribution_matches_one_device():
  """The first 3 sampled tokens of a speculative run on a 4x2 mesh have the distribution of plain sampling on
  one device (the one-device test of tests/test_decode.py, on a mesh)."""
  config = tiny_gemma_config(vocab_size=8, eos_ids=(99,))  # vocabulary 8: split over `model` = 2
  params = init_params(config, jax.random.PRNGKey(3))
  dcfg = config.replace(num_layers=1)
  draft = DraftModelProposer(config=dcfg, k=2)
  dparams = init_params(dcfg, jax.random.PRNGKey(4))
  plain, specd, rates = sample_plain_and_speculative(params, config, draft, dparams, n=400, calls=3,
                                                     mesh=sharding.make_mesh("data:4,model:2"))  # 1200 each
  assert 0.1 < np.mean(rates) < 0.95
  assert_same_distribution(plain, specd)


@pytest.mark.parametrize("impl", ["pallas_tpu:interpret", pytest.param("pallas_gpu:interpret", marks=FULL)])
def test_pallas_kernels_run_per_shard(impl):
  """Under a mesh a Pallas kernel runs inside a shard_map (XLA cannot partition a Mosaic or Triton call): query
  heads split over `model` with the one KV head whole on every shard, rows over `data`, for the target and for
  EAGLE's own layer. Greedy output equals the XLA path on one device."""
  import dataclasses
  mesh = sharding.make_mesh("data:2,model:4")
  prop, pp = _proposer("eagle")
  prop = dataclasses.replace(prop, impl=impl)
  out = generate(_params(), CONFIG, _prompts(8), max_new_tokens=MAX_NEW, proposer=prop, proposer_params=pp,
                 adaptive_k=False, mesh=mesh, impl=impl)
  ref = _alone("eagle", 8)
  assert out.token_ids == ref.token_ids
  assert out.stats["accepted_tokens"] == ref.stats["accepted_tokens"] > 0
