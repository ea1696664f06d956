"""Writes tiny Hugging Face checkpoints (config.json + *.safetensors) for the loader tests.

This is the inverse of spec_jax/checkpoints/safetensors_loader.py: our params -> HF tensor names and
[out, in] layouts, Gemma norms stored as w - 1. It lives in tests because the library only reads HF files.
"""

from __future__ import annotations

import json
import os

import numpy as np

from spec_jax.config import ModelConfig

DEFAULT_PREFIX = {"llama": "model.", "qwen2": "model.", "gemma3_text": "model.",
                  "gemma3": "model.language_model."}


def hf_config(config: ModelConfig, model_type: str, layer_types: bool = True) -> dict:
  """config.json contents. Gemma 3 gets `layer_types` (transformers >= 4.53) or only sliding_window_pattern."""
  c = config
  eos = list(c.eos_ids) if len(c.eos_ids) > 1 else c.eos_ids[0]
  text = {
      "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.mlp_dim,
      "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.norm_eps,
      "max_position_embeddings": c.max_seq_len, "rope_theta": c.rope_base,
      "tie_word_embeddings": c.tie_embeddings, "bos_token_id": c.bos_id, "eos_token_id": eos,
      "pad_token_id": c.pad_id,
  }
  if model_type in ("llama", "qwen2"):
    text.update(model_type=model_type, hidden_act="silu", rope_scaling=None)
    if model_type == "llama":
      text.update(architectures=["LlamaForCausalLM"], attention_bias=c.qkv_bias, mlp_bias=False)
    else:
      text.update(architectures=["Qwen2ForCausalLM"], use_sliding_window=False, sliding_window=4096,
                  max_window_layers=c.num_layers)
    return text
  text.update(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
              query_pre_attn_scalar=c.query_pre_attn_scalar, rope_local_base_freq=c.rope_base_local,
              sliding_window=c.sliding_window, sliding_window_pattern=c.global_every, rope_scaling=None,
              final_logit_softcapping=None, attn_logit_softcapping=None)
  if layer_types:
    text["layer_types"] = ["full_attention" if g else "sliding_attention" for g in c.layer_is_global()]
  if model_type == "gemma3_text":
    text["architectures"] = ["Gemma3ForCausalLM"]
    return text
  # The multimodal wrapper: ids at the top level, vision settings we never read.
  ids = {k: text.pop(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
  return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
          "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8}, "mm_tokens_per_image": 4,
          **ids}


def hf_tensors(config: ModelConfig, params: dict, model_type: str, prefix: str | None = None) -> dict:
  """Our params -> {HF name: C-contiguous float32 array}."""
  c = config
  pre = DEFAULT_PREFIX[model_type] if prefix is None else prefix
  gemma = model_type.startswith("gemma3")
  a = lambda x: np.asarray(x, np.float32)
  norm = (lambda w: a(w) - np.float32(1.0)) if gemma else a  # Gemma stores w for a (1 + w) multiplier
  lin = lambda w: a(w).reshape(w.shape[0], -1).T  # [in, *out] -> [out, in]
  out = {f"{pre}embed_tokens.weight": a(params["embed"]), f"{pre}norm.weight": norm(params["final_norm"])}
  if not c.tie_embeddings:
    out["lm_head.weight"] = lin(params["lm_head"])
  names = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
           "v": "self_attn.v_proj", "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
           "q_bias": "self_attn.q_proj", "k_bias": "self_attn.k_proj", "v_bias": "self_attn.v_proj"}
  if gemma:
    names.update(post_attn_norm="post_attention_layernorm", mlp_norm="pre_feedforward_layernorm",
                 post_mlp_norm="post_feedforward_layernorm")
  else:
    names["mlp_norm"] = "post_attention_layernorm"  # Llama's pre-MLP norm
  for ours, stacked in params["layers"].items():
    for i in range(c.num_layers):
      w = stacked[i]
      if ours.endswith("_bias"):
        out[f"{pre}layers.{i}.{names[ours]}.bias"] = a(w).reshape(-1)
      elif "norm" in ours:
        out[f"{pre}layers.{i}.{names[ours]}.weight"] = norm(w)
      elif ours == "o":  # [H, d, D] -> [D, H*d]
        out[f"{pre}layers.{i}.{names[ours]}.weight"] = a(w).reshape(-1, w.shape[-1]).T
      else:
        out[f"{pre}layers.{i}.{names[ours]}.weight"] = lin(w)
  if model_type == "gemma3":  # vision tensors the loader must skip
    out["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.ones((8, 3, 2, 2), np.float32)
    out["model.multi_modal_projector.mm_input_projection_weight"] = np.ones((8, c.d_model), np.float32)
  return out


def save_tensors(directory, tensors: dict, config_json: dict | None, shards: int = 1, index: bool = True,
                 bf16: bool = False) -> str:
  """Writes config.json and the tensors, split over `shards` files (with an index json when `index`)."""
  os.makedirs(directory, exist_ok=True)
  if config_json is not None:
    with open(os.path.join(directory, "config.json"), "w") as f:
      json.dump(config_json, f, indent=1)
  # safetensors writes raw buffers: a transposed (non C-contiguous) array would be saved scrambled.
  tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
  names = sorted(tensors)
  groups = [names[i::shards] for i in range(shards)]
  weight_map = {}
  for i, group in enumerate(groups):
    fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    part = {k: tensors[k] for k in group}
    path = os.path.join(directory, fname)
    if bf16:
      import jax.numpy as jnp
      from safetensors.flax import save_file as save_jax
      save_jax({k: jnp.asarray(v, jnp.bfloat16) for k, v in part.items()}, path)
    else:
      from safetensors.numpy import save_file
      save_file(part, path)
    weight_map.update({k: fname for k in group})
  if index and shards > 1:
    total = sum(v.size * (2 if bf16 else 4) for v in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
  return str(directory)


def write_hf(directory, config: ModelConfig, params: dict, model_type: str, *, shards: int = 1,
             index: bool = True, bf16: bool = False, prefix: str | None = None, layer_types: bool = True) -> str:
  """A complete tiny checkpoint directory for `params`."""
  return save_tensors(directory, hf_tensors(config, params, model_type, prefix),
                      hf_config(config, model_type, layer_types), shards=shards, index=index, bf16=bf16)
