"""The trainer on a ('data', 'model') mesh of 8 simulated CPU devices: a few EAGLE training steps on a 4x2 mesh
give the one-device params and optimizer state, laid out as spec_jax/sharding.py's table says; and the sharded
checkpoint that run wrote restores onto a 2x4 mesh and onto one device, with equal values and the new layout."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs.train_tiny_test import get_config
from spec_jax import sharding
from train import data as data_lib
from train.main import build_task, load_target
from train.trainer import Trainer, TrainSpec

STEPS = 6
# float32. The mesh run sums the same numbers in another order (the gradient over 4 data shards, the matmuls
# split over 2 model shards), so each step differs from the one-device step by rounding: measured after 6 AdamW
# steps, at most 6e-7 in absolute value on params of size ~1 and 4e-6 relative to a leaf's largest entry
# (mu, nu). Adam's normalised update can grow such differences, so the bound leaves ~25x room (not bitwise).
RTOL = 1e-4


def _setup():
  cfg = get_config("eagle")
  cfg.tiny.vocab_size = 128  # divides by every `model` size here, so the frozen embedding really splits
  cfg.noise = 0.05  # the step's random key is used
  config, params, _ = load_target(cfg)
  task, init, frozen, _ = build_task(cfg, config, params, np.arange(3, 51, dtype=np.int32))  # 48 draft rows
  rng = np.random.default_rng(0)
  toks = rng.integers(3, config.vocab_size, (24, 24)).astype(np.int32)
  toks[:, 0] = config.bos_id
  mask = np.ones_like(toks, bool)
  mask[::3, 18:] = False  # some padded rows
  toks[~mask] = 0
  return task, init, frozen, data_lib.Dataset(toks[:16], mask[:16], toks[16:], mask[16:])


def _trainer(task, workdir, mesh_text):
  spec = TrainSpec(steps=STEPS, batch_size=8, lr=1e-2, warmup=2, eval_every=STEPS, eval_batches=1,
                   save_every=STEPS, log_every=STEPS, workdir=str(workdir), progress=False)
  return Trainer(task, spec, mesh=sharding.make_mesh(mesh_text) if mesh_text else None, log=lambda s: None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The same training run on one device and on a 4x2 mesh -> {mesh: (trainer, final state)}, plus the task."""
  task, init, frozen, data = _setup()
  out = {}
  for mesh_text in ("", "data:4,model:2"):
    tr = _trainer(task, tmp_path_factory.mktemp("run"), mesh_text)
    tr.fit(init, frozen, data)
    out[mesh_text] = (tr, tr.state)
  return task, init, frozen, out


def _leaves(tree):
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def _assert_close(a, b):
  for (path, x), y in zip(_leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    scale = float(np.abs(x).max()) if x.size else 0.0
    np.testing.assert_allclose(y, x, rtol=RTOL, atol=RTOL * scale, err_msg=jax.tree_util.keystr(path))


def _assert_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(_leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=jax.tree_util.keystr(path))


def _adam(state):
  return state.opt[1][0]  # optax.chain(clip, adamw): adamw's ScaleByAdamState (count, mu, nu)


def _has(x, mesh, spec):
  return isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh and \
      x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


def test_mesh_steps_match_one_device_and_are_sharded(runs):
  task, init, frozen, out = runs
  (_, alone), (tr, meshed) = out[""], out["data:4,model:2"]
  assert int(meshed.step) == int(alone.step) == STEPS
  _assert_close(alone, meshed)  # params, mu, nu, counts, rng

  mesh = tr.mesh
  layer, adam = meshed.params["layer"], _adam(meshed)
  # EAGLE's layer splits its query heads and its MLP over 'model' (4 heads / 2, mlp 32 / 2) ...
  for x in (layer["q"], adam.mu["layer"]["q"], adam.nu["layer"]["q"]):  # [embed, heads, head_dim]
    assert _has(x, mesh, P(None, "model", None)), x.sharding
    assert x.addressable_shards[0].data.shape == (32, 2, 8)
  for x in (layer["gate"], adam.mu["layer"]["gate"], adam.nu["layer"]["gate"]):  # [embed, mlp]
    assert _has(x, mesh, P(None, "model")), x.sharding
  assert _has(layer["down"], mesh, P("model", None)) and _has(adam.nu["layer"]["down"], mesh, P("model", None))
  # ... its [2D, D] input projection on its output features (each chip reads its share, not all of it) ...
  for x in (meshed.params["fc"], adam.mu["fc"], adam.nu["fc"]):
    assert _has(x, mesh, P(None, "model")), x.sharding
  # ... while its single K/V head, norms and the Adam count stay whole.
  for x in (layer["k"], meshed.params["out_norm"], adam.count, meshed.rng):
    assert _has(x, mesh, P()), x.sharding
  # The frozen target: vocabulary and heads split over 'model'; a batch splits over 'data'.
  placed = tr.place_frozen(frozen)
  assert _has(placed["target"]["embed"], mesh, P("model", None))
  assert _has(placed["target"]["layers"]["q"], mesh, P(None, None, "model", None))
  assert _has(placed["rows"], mesh, P("model", None))
  batch = tr._put_batch(np.zeros((8, 24), np.int32))
  assert _has(batch, mesh, P("data")) and batch.addressable_shards[0].data.shape == (2, 24)


@pytest.mark.parametrize("target", ["data:2,model:4", ""])
def test_checkpoint_restores_on_another_mesh(runs, target):
  task, init, _, out = runs
  src, saved = out["data:4,model:2"]
  tr = _trainer(task, src.spec.workdir, target)  # reads the 4x2 run's checkpoints
  assert tr.ckpt.latest_step() == STEPS
  restored = tr.restore_latest(tr.init_state(init))  # an unplaced template: structure, shapes and dtypes only
  _assert_equal(saved, restored)

  if tr.mesh is None:  # one device: every array whole on the default device
    for path, x in _leaves(restored):
      assert x.sharding.device_set == {jax.local_devices()[0]}, jax.tree_util.keystr(path)
      assert x.addressable_shards[0].data.shape == x.shape
    return
  mesh = tr.mesh
  assert dict(mesh.shape) == {"data": 2, "model": 4}
  q, adam = restored.params["layer"]["q"], _adam(restored)
  for x in (q, adam.mu["layer"]["q"], adam.nu["layer"]["q"]):
    assert _has(x, mesh, P(None, "model", None)), x.sharding
    assert x.addressable_shards[0].data.shape == (32, 1, 8)  # 4 heads over model:4
  assert _has(restored.params["layer"]["gate"], mesh, P(None, "model"))
  assert _has(adam.count, mesh, P()) and _has(restored.params["fc"], mesh, P(None, "model"))
  # Every restored leaf has the layout this trainer would give it.
  for (path, x), s in zip(_leaves(restored), jax.tree.leaves(tr.state_shardings(restored))):
    assert x.sharding.is_equivalent_to(s, x.ndim), jax.tree_util.keystr(path)


def test_medusa_heads_and_their_adam_state_split_over_model(tmp_path):
  """Medusa's heads [K, D, D] (split by the table, as in serving) and Adam's two copies of them are split over
  'model' on the output dimension in training, so a 70B target's heads are not replicated on every chip."""
  cfg = get_config("medusa")
  config, params, _ = load_target(cfg)
  task, init, _, _ = build_task(cfg, config, params, None)
  tr = _trainer(task, tmp_path, "data:4,model:2")
  state = tr.place_state(tr.init_state(init))
  mesh, adam = tr.mesh, _adam(state)
  k, d, _ = state.params["w"].shape
  for x in (state.params["w"], adam.mu["w"], adam.nu["w"]):
    assert _has(x, mesh, P(None, None, "model")), x.sharding
    assert x.addressable_shards[0].data.shape == (k, d, d // 2)
  for x in (state.params["b"], adam.mu["b"], adam.count):  # vectors and counts stay whole
    assert _has(x, mesh, P()), x.sharding
