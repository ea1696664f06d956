"""Shared fixtures: tiny random models of the Gemma 3 and Llama layouts, and the real Gemma 3 270M."""

import os

import jax
import jax.numpy as jnp
import pytest

from spec_jax.config import ModelConfig

jax.config.update("jax_default_matmul_precision", "highest")


# For subprocesses that run only tiny models: compiling, not running, is their cost, so LLVM's optimizations are
# off (the 8-device decode file: 266 -> 201 s, one run each, 2026-12-02).
TINY_MODEL_XLA_FLAGS = "--xla_backend_optimization_level=0"


def tiny_gemma_config(**kw) -> ModelConfig:
  base = dict(vocab_size=97, d_model=32, num_layers=4, num_heads=4, num_kv_heads=1, head_dim=16, mlp_dim=64,
              sliding_window=8, global_every=2, query_pre_attn_scalar=16.0, max_seq_len=256, bos_id=2,
              eos_ids=(1,), pad_id=0, name="tiny-gemma")
  base.update(kw)
  return ModelConfig(**base)


def tiny_llama_config(**kw) -> ModelConfig:
  base = dict(vocab_size=97, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
              activation="silu", post_norms=False, qk_norm=False, qkv_bias=False, rope_base=10000.0,
              sliding_window=None, query_pre_attn_scalar=None, embed_scale=False, tie_embeddings=False,
              max_seq_len=256, bos_id=2, eos_ids=(1,), pad_id=0, name="tiny-llama")
  base.update(kw)
  return ModelConfig(**base)


@pytest.fixture(scope="session")
def gemma3_gguf_path():
  from spec_jax.checkpoints.gguf_loader import default_model_path
  return default_model_path()


@pytest.fixture(scope="session")
def gemma3_f32(gemma3_gguf_path):
  from spec_jax.checkpoints.gguf_loader import load_gguf
  return load_gguf(gemma3_gguf_path, dtype=jnp.float32)


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_gguf_path):
  from spec_jax.checkpoints.load import load_tokenizer
  return load_tokenizer(gemma3_gguf_path)


def _memory_map_count() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux: nothing to count
    return 0


@pytest.fixture(autouse=True)
def _free_compiled_programs():
  """Drop JAX's compiled programs once the process holds many memory maps.

  XLA:CPU JIT-compiles every kernel into its own few pages, and the maps stay until the executable is freed. The
  full suite compiles thousands of programs; at Linux's default vm.max_map_count (65530) the next compile
  segfaults. Clearing JAX's caches frees them (measured: 6542 maps -> 605)."""
  yield
  if _memory_map_count() > 20000:
    jax.clear_caches()
    import gc
    gc.collect()
