import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.checkpoints import gguf_loader
from spec_jax.checkpoints.gguf_loader import load_gguf
from spec_jax.models.transformer import init_params
from tests.checkpoints.gguf_writer import write_tiny_gguf
from tests.conftest import tiny_gemma_config

CONFIG = tiny_gemma_config(num_layers=6, global_every=6)


@pytest.fixture()
def tiny(tmp_path):
  params = jax.tree.map(np.asarray, init_params(CONFIG, jax.random.PRNGKey(0)))
  path = tmp_path / "tiny.gguf"
  write_tiny_gguf(path, CONFIG, params)
  return path, params


def _assert_params_equal(a, b):
  for (pa, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(pa))


def test_round_trip_config_and_params(tiny):
  path, params = tiny
  config, loaded = load_gguf(str(path), use_cache=False)
  for field in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                "sliding_window", "global_every", "query_pre_attn_scalar", "rope_base", "bos_id", "eos_ids"):
    assert getattr(config, field) == getattr(CONFIG, field), field
  _assert_params_equal(loaded, params)


def test_cache_is_exact_and_notices_a_changed_file(tiny, tmp_path):
  path, params = tiny
  load_gguf(str(path))  # builds the cache
  cache_file = str(path) + gguf_loader.CACHE_SUFFIX
  assert os.path.exists(cache_file)
  _, cached = load_gguf(str(path))
  _assert_params_equal(cached, params)
  # Replace the GGUF with different weights: the cache must not be served.
  other = jax.tree.map(np.asarray, init_params(CONFIG, jax.random.PRNGKey(1)))
  write_tiny_gguf(path, CONFIG, other)
  _, reloaded = load_gguf(str(path))
  _assert_params_equal(reloaded, other)


def _load_racing(path, barrier, results):
  """A spawned process: load_gguf with its cache, holding the cache's last rename (the record's) until the other
  process reaches its own, so that both builds overlap where the race was (one shared temporary name: the second
  rename found nothing to rename). -> (None or the error, sha256 of the params) on `results`."""
  import hashlib
  import threading
  real = os.replace

  def replace(src, dst):
    if str(dst).endswith(".json"):
      try:
        barrier.wait(timeout=30)
      except threading.BrokenBarrierError:  # a writer that serializes the two (a lock) never meets the other here
        pass
    real(src, dst)

  os.replace = replace
  try:
    _, params = load_gguf(path)
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
      h.update(np.asarray(leaf).tobytes())
    results.put((None, h.hexdigest()))
  except Exception as e:  # reported to the test, not lost in the child
    results.put((f"{type(e).__name__}: {e}", None))


def test_two_processes_loading_a_new_file_at_once_both_succeed(tiny, tmp_path):
  import hashlib
  import multiprocessing
  path, params = tiny
  ctx = multiprocessing.get_context("spawn")  # not fork: JAX's threads are running in this process
  barrier, results = ctx.Barrier(2), ctx.Queue()
  procs = [ctx.Process(target=_load_racing, args=(str(path), barrier, results)) for _ in range(2)]
  for p in procs:
    p.start()
  got = [results.get(timeout=300) for _ in procs]
  for p in procs:
    p.join(timeout=60)
  want = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    want.update(np.asarray(leaf, np.float32).tobytes())
  assert got == [(None, want.hexdigest())] * 2, got
  assert sorted(os.listdir(tmp_path)) == ["tiny.gguf", "tiny.gguf" + gguf_loader.CACHE_SUFFIX,
                                          "tiny.gguf" + gguf_loader.CACHE_SUFFIX + ".json"]  # no temporary left
  cache_file = str(path) + gguf_loader.CACHE_SUFFIX
  built = os.stat(cache_file).st_mtime_ns
  _, cached = load_gguf(str(path))  # the cache they left is whole: read, not rebuilt
  assert os.stat(cache_file).st_mtime_ns == built
  _assert_params_equal(cached, params)


def test_bfloat16_load(tiny):
  path, params = tiny
  _, p16 = load_gguf(str(path), dtype=jnp.bfloat16, use_cache=False)
  assert p16["embed"].dtype == jnp.bfloat16


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.gguf"):
    load_gguf(str(tmp_path / "nope.gguf"))


def test_corrupt_file(tmp_path):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGUF" + os.urandom(200))
  with pytest.raises(ValueError, match="bad.gguf"):
    load_gguf(str(bad), use_cache=False)
  trunc = tmp_path / "trunc.gguf"
  trunc.write_bytes(b"not a gguf at all")
  with pytest.raises(ValueError, match="trunc.gguf"):
    load_gguf(str(trunc), use_cache=False)


def test_unknown_architecture(tmp_path):
  params = jax.tree.map(np.asarray, init_params(CONFIG, jax.random.PRNGKey(0)))
  path = tmp_path / "mamba.gguf"
  write_tiny_gguf(path, CONFIG, params, arch="mamba")
  with pytest.raises(ValueError, match="unknown architecture 'mamba'"):
    load_gguf(str(path), use_cache=False)


def test_missing_tensor(tmp_path):
  params = jax.tree.map(np.asarray, init_params(CONFIG, jax.random.PRNGKey(0)))
  path = tmp_path / "missing.gguf"
  write_tiny_gguf(path, CONFIG, params, drop=("blk.3.ffn_up.weight",))
  with pytest.raises(ValueError, match="blk.3.ffn_up.weight.*missing"):
    load_gguf(str(path), use_cache=False)


def test_misshapen_tensor(tmp_path):
  params = jax.tree.map(np.asarray, init_params(CONFIG, jax.random.PRNGKey(0)))
  path = tmp_path / "shape.gguf"
  n = CONFIG.d_model
  write_tiny_gguf(path, CONFIG, params, reshape={"blk.2.attn_norm.weight": (n // 2, 2)})
  with pytest.raises(ValueError, match="blk.2.attn_norm.weight.*shape"):
    load_gguf(str(path), use_cache=False)


def _with_tokens(tokens):
  def extra(w):
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([1] * len(tokens))
  return extra


def test_end_of_turn_and_the_layer_pattern_come_from_the_file(tmp_path):
  """The chat turn's end token is looked up in the file's vocabulary (not assumed to be id 106), and a per-layer
  sliding-window pattern in the metadata sets which layers are global (6 when the file has none, llama.cpp's
  rule for Gemma 3)."""
  config = tiny_gemma_config(num_layers=4, global_every=2)
  params = jax.tree.map(np.asarray, init_params(config, jax.random.PRNGKey(0)))
  tokens = ["<pad>", "<eos>", "<bos>"] + [f"t{i}" for i in range(3, config.vocab_size)]
  tokens[40] = "<end_of_turn>"
  path = tmp_path / "turn.gguf"
  write_tiny_gguf(path, config, params, extra=_with_tokens(tokens))
  loaded, _ = load_gguf(str(path), use_cache=False)
  assert loaded.eos_ids == (1, 40) and loaded.global_every == 6

  def with_pattern(w):
    _with_tokens(tokens)(w)
    w.add_array("gemma3.attention.sliding_window_pattern", [True, False, True, False])
  write_tiny_gguf(path, config, params, extra=with_pattern)
  loaded, _ = load_gguf(str(path), use_cache=False)
  assert loaded.global_every == 2
  np.testing.assert_array_equal(loaded.layer_is_global(), config.layer_is_global())

  def bad_pattern(w):
    _with_tokens(tokens)(w)
    w.add_array("gemma3.attention.sliding_window_pattern", [True, False, False, True])
  write_tiny_gguf(path, config, params, extra=bad_pattern)
  with pytest.raises(ValueError, match="not one global layer every N"):
    load_gguf(str(path), use_cache=False)
