"""Published draft heads (EAGLE-3 as SafeAILab / SpecForge and vLLM's speculators publish it, EAGLE-1/2 as its
authors do, Medusa-1 as FasterDecoding does) load through the registry and compute the reference packages' own
draft logits (tests/fixtures/published_heads, made by its make_fixtures.py); greedy decoding with each is
identical to plain decoding; broken checkpoints fail with errors that name what is wrong."""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.batch import generate
from spec_jax.cache import KVCache
from spec_jax.checkpoints import published, safetensors_io
from spec_jax.checkpoints.safetensors_loader import load_hf
from spec_jax.models.transformer import forward
from spec_jax.proposers import eagle, medusa
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.rows import target_features
from spec_jax.spec_config import SpecConfig

HERE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "published_heads")
TARGET = os.path.join(HERE, "target")
TOL = 1e-4


@functools.lru_cache(maxsize=None)
def _target():
  return load_hf(TARGET)


@functools.lru_cache(maxsize=None)
def _ref():
  # speculators_eagle.npz: the speculators EAGLE/HASS heads' logits (make_speculators_eagle.py)
  return {**np.load(os.path.join(HERE, "reference.npz")), **np.load(os.path.join(HERE, "speculators_eagle.npz"))}


def _build(method, name, k=3):
  config, params = _target()
  return build_proposer(SpecConfig(method, k, model=os.path.join(HERE, name)), Target(config, params))


def _features(prop, prompt):
  config, params = _target()
  out = forward(params, jnp.asarray(prompt[None]), config=config, compute_logits=False,
                return_layers=prop.feature_layers)
  return target_features(out[1], out[3] if prop.feature_layers else None)  # [1, T, F]


def _chain_logits(prop, pp, prompt, ext, steps):
  """Step 0 over every prompt pair (feature_t, token_{t+1}), then `steps` chain steps from every start position
  t (row t of a batch of T), each feeding the head's own output with the continuation's next token."""
  cfg, pub = prop.config, prop.published
  T = len(prompt)
  feats = jnp.broadcast_to(_features(prop, prompt), (T, T, _features(prop, prompt).shape[-1]))
  toks = jnp.broadcast_to(jnp.asarray(ext[1:T + 1]), (T, T))
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (T, T))
  cache = KVCache.init(cfg, T, T + steps + 1, jnp.float32)
  out, cache = eagle.eagle_forward(pp, cfg, feats, toks, pos, cache, published=pub)
  logits = [np.asarray(eagle.head_logits(pp, cfg, out[0], pub))]
  feat, rows = out[0], jnp.arange(T, dtype=jnp.int32)
  for s in range(1, steps + 1):
    tok = jnp.asarray(ext)[rows + 1 + s]
    feat, cache = eagle.eagle_forward(pp, cfg, feat[:, None], tok[:, None], (rows + s)[:, None],
                                      cache.replace(lengths=rows + s), published=pub)
    feat = feat[:, 0]
    logits.append(np.asarray(eagle.head_logits(pp, cfg, feat, pub)))
  return np.stack(logits)


def _prompts():
  ref = _ref()
  return [(ref[f"prompt_p{i}"], np.concatenate([ref[f"prompt_p{i}"], ref[f"continuation_p{i}"]])) for i in range(3)]


def test_target_logits_match_transformers():
  """The tiny Llama 3 target (llama3 RoPE scaling) against transformers' float32 logits."""
  config, params = _target()
  assert config.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 16.0)
  for i, (prompt, _) in enumerate(_prompts()):
    logits, _, _ = forward(params, jnp.asarray(prompt[None]), config=config)
    np.testing.assert_allclose(np.asarray(logits[0]), _ref()[f"target_logits_p{i}"], atol=TOL, rtol=0)


@pytest.mark.parametrize("method,name,key", [("eagle3", "eagle3", "eagle3"), ("eagle3", "speculators_eagle3", "eagle3"),
                                             ("eagle", "eagle1", "eagle1"),
                                             ("eagle", "speculators_eagle", "speculators_eagle"),
                                             ("eagle", "speculators_eagle_ln", "speculators_eagle_ln")])
def test_eagle_draft_logits_match_the_reference(method, name, key):
  prop, pp = _build(method, name)
  assert published.detect(os.path.join(HERE, name)) == {"eagle3": "eagle3", "eagle1": "eagle1"}.get(name, "speculators")
  if name in ("speculators_eagle", "speculators_eagle_ln"):  # speculators EAGLE: the verifier's RoPE, not the layer config's
    assert prop.config.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 16.0) and prop.config.rope_base == 50000.0
    assert prop.published.layernorms == (name == "speculators_eagle_ln") and ("fc_bias" in pp) == (name != "speculators_eagle_ln")
  if key == "eagle3":
    assert prop.feature_layers == (1, 2, 3)  # aux ids (2, L // 2, L - 3) = inputs of those layers, L = 7
    assert pp["d2t"].shape == (160,)
  worst = 0.0
  for i, (prompt, ext) in enumerate(_prompts()):
    want = _ref()[f"{key}_p{i}"]
    got = _chain_logits(prop, pp, prompt, ext, want.shape[0] - 1)
    assert got.shape == want.shape
    worst = max(worst, float(np.abs(got - want).max()))
  print(f"{name}: max abs error {worst:.2e}")
  assert worst < TOL


def test_medusa_draft_logits_match_the_reference():
  prop, pp = _build("medusa", "medusa")
  assert prop.num_heads == 3 and prop.num_layers == 2
  config, params = _target()
  worst = 0.0
  for i, (prompt, _) in enumerate(_prompts()):
    _, hidden, _ = forward(params, jnp.asarray(prompt[None]), config=config, compute_logits=False)
    feats = medusa.head_features(pp["heads"], hidden[0])  # [T, K, D]
    got = np.moveaxis(np.asarray(medusa.project(feats, pp["rows"])), 1, 0)
    worst = max(worst, float(np.abs(got - _ref()[f"medusa_p{i}"]).max()))
  print(f"medusa: max abs error {worst:.2e}")
  assert worst < TOL


@pytest.mark.parametrize("method,name", [("eagle3", "eagle3"), ("eagle3", "speculators_eagle3"), ("eagle", "eagle1"),
                                         ("eagle", "speculators_eagle_ln"), ("medusa", "medusa")])
def test_greedy_with_a_published_head_equals_plain(method, name):
  config, params = _target()
  config = config.replace(eos_ids=())
  prompts = [p.tolist() for p, _ in _prompts()]
  base = generate(params, config, prompts, max_new_tokens=12)
  prop, pp = _build(method, name)
  res = generate(params, config, prompts, max_new_tokens=12, proposer=prop, proposer_params=pp, adaptive_k=False)
  assert res.token_ids == base.token_ids
  assert res.stats["drafted_tokens"] > 0


# ----------------------------------------------------------------------------------------- bad heads


def _copy(tmp_path, name):
  d = tmp_path / f"{name}_{len(os.listdir(tmp_path))}"
  shutil.copytree(os.path.join(HERE, name), d)
  return str(d)


def _edit_json(d, **kw):
  p = os.path.join(d, "config.json")
  with open(p) as f:
    cfg = json.load(f)
  cfg.update(kw)
  with open(p, "w") as f:
    json.dump(cfg, f)


def _edit_tensors(d, fn):
  p = os.path.join(d, "model.safetensors")
  t = safetensors_io.read(p)
  fn(t)
  safetensors_io.write(p, t)


def _load(d, method="eagle3"):
  config, params = _target()
  return build_proposer(SpecConfig(method, 3, model=d), Target(config, params))


def test_bad_published_heads_fail_clearly(tmp_path):
  d = _copy(tmp_path, "eagle3")
  _edit_json(d, hidden_size=64)  # a head made for a wider target
  with pytest.raises(ValueError, match="width 64, the target's hidden size is 48"):
    _load(d)
  d = _copy(tmp_path, "speculators_eagle3")
  _edit_json(d, target_hidden_size=64)
  with pytest.raises(ValueError, match="target's hidden size is 48"):
    _load(d)

  def far(t):
    t["d2t"] = t["d2t"].copy()
    t["d2t"][5] = 400
  d = _copy(tmp_path, "eagle3")
  _edit_tensors(d, far)
  with pytest.raises(ValueError, match="d2t is out of range: draft id 5"):
    _load(d)
  d = _copy(tmp_path, "eagle3")
  _edit_tensors(d, lambda t: t.pop("norm.weight"))
  with pytest.raises(ValueError, match="'norm.weight' is missing"):
    _load(d)
  d = _copy(tmp_path, "speculators_eagle3")
  with open(os.path.join(d, "model.safetensors"), "r+b") as f:
    f.truncate(os.path.getsize(os.path.join(d, "model.safetensors")) // 2)
  with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
    _load(d)
  d = _copy(tmp_path, "eagle1")
  with open(os.path.join(d, "pytorch_model.bin"), "r+b") as f:
    f.truncate(os.path.getsize(os.path.join(d, "pytorch_model.bin")) - 300)
  with pytest.raises(ValueError, match="pytorch_model.bin"):
    _load(d, "eagle")
  d = _copy(tmp_path, "medusa")
  _edit_json(d, hidden_size=64)
  with pytest.raises(ValueError, match="hidden_size is 64, the target's is 48"):
    _load(d, "medusa")
  # Method and format must agree; an unknown layout names what it looked for.
  with pytest.raises(ValueError, match="holds a eagle1 head"):
    _load(os.path.join(HERE, "eagle1"), "eagle3")
  d = tmp_path / "unknown"
  d.mkdir()
  (d / "config.json").write_text("{}")
  safetensors_io.write(str(d / "model.safetensors"), {"x": np.zeros(2, np.float32)})
  with pytest.raises(ValueError, match="not a known draft head format"):
    _load(str(d))


def test_bad_speculators_eagle_heads_fail_clearly(tmp_path):
  d = _copy(tmp_path, "speculators_eagle")
  _edit_json(d, transformer_layer_config={"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 80})
  with pytest.raises(ValueError, match="hidden_size 64 differs from the target's 48"):
    _load(d, "eagle")
  d = _copy(tmp_path, "speculators_eagle")
  _edit_tensors(d, lambda t: t.pop("fusion_fc.weight"))
  with pytest.raises(ValueError, match="'fusion_fc.weight' is missing"):
    _load(d, "eagle")
  d = _copy(tmp_path, "speculators_eagle")
  _edit_json(d, layernorms=True)  # the flag without its norms
  with pytest.raises(ValueError, match="'transformer.input_layernorm.weight' is missing"):
    _load(d, "eagle")
  d = _copy(tmp_path, "speculators_eagle_ln")
  _edit_json(d, layernorms=False)  # norms the config does not use
  with pytest.raises(ValueError, match="unexpected tensors"):
    _load(d, "eagle")
  d = _copy(tmp_path, "speculators_eagle")
  _edit_json(d, speculators_model_type="mlp")
  with pytest.raises(ValueError, match="speculators_model_type 'mlp' is not supported"):
    _load(d, "eagle")
  with pytest.raises(ValueError, match="holds a eagle1 head"):
    _load(os.path.join(HERE, "speculators_eagle"), "eagle3")


@pytest.mark.full  # sampled exactness over a draft vocabulary: test_quant.py's qdraft case, in make test
def test_sampled_distribution_with_a_published_eagle3_head():
  """Exactness under sampling with a loaded EAGLE-3 head (its 160-id draft vocabulary mapped through d2t): the
  first 3 tokens of plain and speculative runs agree by chi-square (tests/distribution.py)."""
  from spec_jax.config import SamplingParams
  from tests.distribution import assert_same_distribution, sample_plain_and_speculative
  config, params = _target()
  config = config.replace(eos_ids=())
  prop, pp = _build("eagle3", "eagle3", k=2)
  # Untruncated T 1: the random head's and target's top-k sets barely meet (top-k 6 accepted nothing).
  samp = SamplingParams.make(500, temperature=1.0)
  plain, specd, rates = sample_plain_and_speculative(params, config, prop, pp, n=500, calls=6, sampling=samp)
  print(f"published EAGLE-3 acceptance rate {np.mean(rates):.3f}")
  assert 0.02 < np.mean(rates) < 0.95  # both accept and reject paths are exercised
  assert_same_distribution(plain, specd)
