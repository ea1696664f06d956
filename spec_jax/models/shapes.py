"""Published model shapes, by name: what `serve.aot` compiles for when no weights are at hand.

Each entry is the text model's ModelConfig as its public config.json gives it (vocabulary, width, layers, heads,
KV heads, head size, MLP width, RoPE bases, sliding window). Shapes are all the compiler needs: abstract
parameters (jax.ShapeDtypeStruct) stand in for weights.
"""

from __future__ import annotations

import json
import os

from spec_jax.config import ModelConfig, family_config

# A model's own values over its family's flags (config.FAMILIES).
_LLAMA3 = dict(rope_base=500_000.0, bos_id=128000, eos_ids=(128001, 128009), pad_id=0)
_QWEN25 = dict(rope_base=1_000_000.0, bos_id=151643, eos_ids=(151643, 151645), pad_id=151643)

MODEL_SHAPES = {
    "gemma3-270m": family_config("gemma3", vocab_size=262144, d_model=640, num_layers=18, num_heads=4,
                                 num_kv_heads=1, head_dim=256, mlp_dim=2048, sliding_window=512, max_seq_len=32768,
                                 name="gemma3-270m"),
    "gemma3-1b": family_config("gemma3", vocab_size=262144, d_model=1152, num_layers=26, num_heads=4,
                               num_kv_heads=1, head_dim=256, mlp_dim=6912, sliding_window=512, max_seq_len=32768,
                               name="gemma3-1b"),
    "gemma3-4b": family_config("gemma3", vocab_size=262208, d_model=2560, num_layers=34, num_heads=8,
                               num_kv_heads=4, head_dim=256, mlp_dim=10240, sliding_window=1024,
                               max_seq_len=131072, name="gemma3-4b"),
    "qwen2.5-1.5b": family_config("qwen2", vocab_size=151936, d_model=1536, num_layers=28, num_heads=12,
                                  num_kv_heads=2, head_dim=128, mlp_dim=8960, tie_embeddings=True,
                                  max_seq_len=32768, name="qwen2.5-1.5b", **_QWEN25),
    "qwen2.5-7b": family_config("qwen2", vocab_size=152064, d_model=3584, num_layers=28, num_heads=28,
                                num_kv_heads=4, head_dim=128, mlp_dim=18944, tie_embeddings=False,
                                max_seq_len=32768, name="qwen2.5-7b", **_QWEN25),
    "llama3-8b": family_config("llama", vocab_size=128256, d_model=4096, num_layers=32, num_heads=32,
                               num_kv_heads=8, head_dim=128, mlp_dim=14336, max_seq_len=131072, name="llama3-8b",
                               **_LLAMA3),
    "llama3-70b": family_config("llama", vocab_size=128256, d_model=8192, num_layers=80, num_heads=64,
                                num_kv_heads=8, head_dim=128, mlp_dim=28672, max_seq_len=131072,
                                name="llama3-70b", **_LLAMA3),
}


def model_shape(name_or_path: str) -> ModelConfig:
  """A name from MODEL_SHAPES, or a JSON file of ModelConfig fields (any other architecture of these families)."""
  if name_or_path in MODEL_SHAPES:
    return MODEL_SHAPES[name_or_path]
  if os.path.isfile(name_or_path):
    with open(name_or_path, encoding="utf-8") as f:
      fields = json.load(f)
    if not isinstance(fields, dict):
      raise ValueError(f"{name_or_path}: expected a JSON object of ModelConfig fields")
    known = set(ModelConfig.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
      raise ValueError(f"{name_or_path}: unknown ModelConfig fields {unknown}; known: {sorted(known)}")
    for key in ("eos_ids",):
      if key in fields:
        fields[key] = tuple(fields[key])
    return ModelConfig(**fields)
  raise ValueError(f"unknown model shape {name_or_path!r}: choose one of {sorted(MODEL_SHAPES)} or give a JSON file "
                   "of ModelConfig fields")
