"""Writes tiny Gemma 3 and Qwen2 GGUF files (float32 tensors, llama.cpp names and layout) for loader tests."""

import gguf
import numpy as np

INV = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
       "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "post_attn_norm": "post_attention_norm",
       "mlp_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
       "post_mlp_norm": "post_ffw_norm"}
BIAS = {"q_bias": "attn_q", "k_bias": "attn_k", "v_bias": "attn_v"}


def to_torch_layout(name, w):
  """Our [in, ...out] layout back to the [out, in] matrices llama.cpp stores."""
  if name in ("q", "k", "v"):
    return w.reshape(w.shape[0], -1).T
  if name == "o":
    return w.reshape(-1, w.shape[-1]).T
  if name in ("gate", "up", "down"):
    return w.T
  return w


def write_tiny_gguf(path, config, params, *, arch="gemma3", drop=(), reshape=None, extra=None):
  """`extra(writer)`, when given, adds more metadata (a tokenizer) before the file is written."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(config.num_layers)
  w.add_embedding_length(config.d_model)
  w.add_feed_forward_length(config.mlp_dim)
  w.add_head_count(config.num_heads)
  w.add_head_count_kv(config.num_kv_heads)
  w.add_key_length(config.head_dim)
  w.add_value_length(config.head_dim)
  w.add_layer_norm_rms_eps(config.norm_eps)
  w.add_rope_freq_base(config.rope_base)
  if config.sliding_window is not None:
    w.add_sliding_window(config.sliding_window)
  w.add_context_length(config.max_seq_len)
  w.add_bos_token_id(config.bos_id)
  w.add_eos_token_id(config.eos_ids[0])
  w.add_pad_token_id(config.pad_id)
  if extra is not None:
    extra(w)
  tensors = {"token_embd.weight": np.asarray(params["embed"]), "output_norm.weight": np.asarray(params["final_norm"])}
  if "lm_head" in params:  # untied: llama.cpp's output.weight, [V, D]
    tensors["output.weight"] = np.asarray(params["lm_head"]).T
  for ours, theirs in INV.items():
    if ours not in params["layers"]:
      continue
    for i in range(config.num_layers):
      tensors[f"blk.{i}.{theirs}.weight"] = to_torch_layout(ours, np.asarray(params["layers"][ours][i]))
  for ours, theirs in BIAS.items():
    if ours in params["layers"]:
      for i in range(config.num_layers):
        tensors[f"blk.{i}.{theirs}.bias"] = np.asarray(params["layers"][ours][i]).reshape(-1)
  for name, arr in tensors.items():
    if name in drop:
      continue
    if reshape and name in reshape:
      arr = arr.reshape(reshape[name])
    w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
