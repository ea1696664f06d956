"""models/schema.py against the model and the files: one row per parameter, with the right shape, axes and names."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import param_axes, quant, sharding
from spec_jax.checkpoints.gguf_loader import load_gguf
from spec_jax.checkpoints.safetensors_loader import NAME_PREFIXES, load_hf
from spec_jax.config import FAMILIES, ModelConfig, family_config
from spec_jax.models import schema
from spec_jax.models.shapes import MODEL_SHAPES
from spec_jax.models.transformer import forward, init_params, param_shapes
from tests.checkpoints.gguf_writer import write_tiny_gguf
from tests.checkpoints.hf_writer import hf_tensors, write_hf
from tests.conftest import ROOT, tiny_gemma_config, tiny_llama_config

CONFIGS = {
    "gemma": tiny_gemma_config(),
    "llama": tiny_llama_config(),
    "qwen2": tiny_llama_config(qkv_bias=True, tie_embeddings=True, rope_base=1e6, rope_base_local=1e6),
    "every_flag": tiny_gemma_config(qkv_bias=True, tie_embeddings=False),
}


def _leaves(tree):
  """{(name, stacked): array} of a params (or shapes) tree."""
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, tuple)):
    keys = [p.key for p in path]
    out[(keys[-1], keys[0] == "layers")] = x
  return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_param_has_one_row(name):
  c = CONFIGS[name]
  leaves = _leaves(init_params(c, jax.random.PRNGKey(0)))
  rows = {(r.name, r.per_layer): r for r in schema.ROWS if r.when(c)}
  assert set(leaves) == set(rows)  # none missing, none extra, each in its place (top level or stacked)
  for (leaf, stacked), x in leaves.items():
    r = rows[(leaf, stacked)]
    lead = (c.num_layers,) if stacked else ()
    assert x.shape == lead + r.shape(c), leaf
    assert len(param_axes.param_axes(leaf, x.ndim)) == x.ndim == len(r.axes) + stacked, leaf
    if stacked:
      assert param_axes.param_axes(leaf, x.ndim) == ("layers",) + r.axes
  assert _leaves(param_shapes(c)).keys() == leaves.keys()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_forward_reads_every_row(name):
  """The rows against the model itself: the forward runs on their shapes, and each of them moves the logits (a row
  the config should not have, or a wrong shape, fails here)."""
  c = CONFIGS[name]
  params = init_params(c, jax.random.PRNGKey(0))
  tokens = jnp.array([[3, 5, 7, 11, 13]], jnp.int32)
  mix = jax.random.normal(jax.random.PRNGKey(1), (1, 5, c.vocab_size))
  grads = jax.grad(lambda p: jnp.sum(forward(p, tokens, config=c)[0] * mix))(params)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert np.any(np.asarray(g) != 0), jax.tree_util.keystr(path)


def test_rows_are_consistent():
  names = [r.name for r in schema.ROWS]
  assert len(set(names)) == len(names)
  for r in schema.ROWS:
    assert all(a in schema.DIMS and a in sharding.LOGICAL_RULES for a in r.axes), r.name
    assert r.layout in ("same", "linear", "flat"), r.name
    assert (r.layout == "linear") == (r.contract > 0), r.name  # a matmul's file layout is torch's [out, in]
    assert 0 <= r.contract < len(r.axes), r.name
  # The readers' tables are views of the rows; the proposers' own names never shadow a target's.
  assert quant.LAYER_CONTRACT == {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
  assert {n: param_axes.PARAM_AXES[n] for n in schema.AXES} == schema.AXES
  assert set(param_axes._PROPOSER_AXES).isdisjoint(schema.AXES)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_names_are_unique(name):
  c = CONFIGS[name]
  for fmt in (lambda r: r.gguf, lambda r: schema.hf_name(r, c)):
    names = [fmt(r).format(i=i) for r in schema.layer_rows(c) for i in range(c.num_layers)]
    names += [fmt(r) for r in schema.top_rows(c)]
    assert len(set(names)) == len(names)
  assert all(r.gguf.startswith("blk.{i}.") and r.hf.startswith("layers.{i}.") for r in schema.LAYER)


def test_torch_layout_round_trips():
  c = CONFIGS["every_flag"]
  rng = np.random.default_rng(0)
  for r in schema.ROWS:
    w = rng.standard_normal(r.shape(c)).astype(np.float32)
    t = schema.to_torch(r, w)
    assert t.shape == schema.torch_shape(r, w.shape), r.name
    np.testing.assert_array_equal(schema.from_torch(r, t, w.shape), w, err_msg=r.name)
    if t.ndim == 2 and t.shape[0] != t.shape[1]:
      assert schema.from_torch(r, t.T, w.shape) is None, r.name  # a transposed file is refused, not reshaped
  q = rng.standard_normal((c.d_model, c.num_heads, c.head_dim))
  # torch's q_proj [H*d, D]: row h*d + j is head h's output j
  np.testing.assert_array_equal(schema.to_torch(schema.BY_NAME["q"], q)[3], q[:, 0, 3])


@pytest.mark.parametrize("name,model_type", [("llama", "llama"), ("qwen2", "qwen2"), ("gemma", "gemma3_text"),
                                             ("every_flag", "llama")])
def test_hf_names_match_the_writer_and_round_trip(tmp_path, name, model_type):
  """The test writer spells HF's names on its own: the schema's must be exactly those it writes."""
  c = CONFIGS[name]
  if model_type == "llama":
    c = c.replace(post_norms=False, qk_norm=False, activation="silu", sliding_window=None,
                  query_pre_attn_scalar=None, embed_scale=False)
  params = jax.tree.map(np.asarray, init_params(c, jax.random.PRNGKey(1)))
  written = set()
  for key in hf_tensors(c, params, model_type):
    written.add(next((key[len(p):] for p in NAME_PREFIXES if key.startswith(p)), key))
  ours = {schema.hf_name(r, c).format(i=i) for r in schema.layer_rows(c) for i in range(c.num_layers)}
  ours |= {schema.hf_name(r, c) for r in schema.top_rows(c)}
  assert ours == written
  loaded_config, loaded = load_hf(write_hf(tmp_path / "ckpt", c, params, model_type))
  assert param_shapes(loaded_config) == param_shapes(c)
  for (leaf, _), x in _leaves(params).items():
    got = loaded["layers"][leaf] if leaf in loaded["layers"] else loaded[leaf]
    np.testing.assert_allclose(np.asarray(got), x, rtol=0, atol=1e-6, err_msg=leaf)  # Gemma's norms: w - 1 + 1


@pytest.mark.parametrize("name,arch", [("gemma", "gemma3"), ("qwen2", "qwen2")])
def test_gguf_round_trip(tmp_path, name, arch):
  c = CONFIGS[name]
  if arch == "qwen2":
    c = c.replace(tie_embeddings=False)
  params = jax.tree.map(np.asarray, init_params(c, jax.random.PRNGKey(2)))
  write_tiny_gguf(tmp_path / "m.gguf", c, params, arch=arch)
  _, loaded = load_gguf(str(tmp_path / "m.gguf"), use_cache=False)
  for (leaf, _), x in _leaves(params).items():
    got = loaded["layers"][leaf] if leaf in loaded["layers"] else loaded[leaf]
    np.testing.assert_array_equal(np.asarray(got), x, err_msg=leaf)


def test_families_in_one_place():
  small = dict(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
  assert family_config("gemma3", **small) == ModelConfig(**small)  # Gemma 3's flags are the defaults
  for fam, flags in FAMILIES.items():
    c = family_config(fam, **small)
    assert all(getattr(c, k) == v for k, v in flags.items()), fam
  assert MODEL_SHAPES["qwen2.5-7b"].qkv_bias and not MODEL_SHAPES["llama3-8b"].qkv_bias
  assert MODEL_SHAPES["gemma3-270m"].rope_base_local == FAMILIES["gemma3"]["rope_base_local"]


def test_schema_imports_no_reader():
  """sharding, quant and the loaders import the schema, never the reverse (nor the transformer)."""
  code = ("import sys, spec_jax.models.schema; "
          "bad = [m for m in ('spec_jax.sharding', 'spec_jax.quant', 'spec_jax.models.transformer', "
          "'spec_jax.checkpoints.safetensors_loader', 'spec_jax.checkpoints.gguf_loader') if m in sys.modules]; "
          "assert not bad, bad; import spec_jax.sharding, spec_jax.quant")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)
