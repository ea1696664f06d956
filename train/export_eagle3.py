"""An EAGLE head trained here in the published EAGLE-3 layout (head_layout="eagle3", spec_jax/proposers/
eagle3_layout.py) written as SafeAILab / SpecForge's EAGLE-3 (--format=eagle3) or vLLM's speculators EAGLE-3
(--format=speculators): every tensor is a trained parameter as it is, transposed to torch's Linear [out, in], so
the published loaders (spec_jax/checkpoints/published.py, vLLM, SGLang) compute the forward it was trained with.

What the files hold: fc [D, n D] over the aux layers, the decoder layer (`midlayer.*` for SpecForge, `layers.0.*`
for speculators) with its input_layernorm and hidden_norm, norm, lm_head [N, D] (the target's output rows over the
draft vocabulary, which training kept frozen), d2t (offsets: target id = draft id + d2t[draft id]) and t2d (a
mask over the target's ids). The aux layer ids follow vLLM's convention: our feature layer l (a layer's output)
is id l + 1 (the input of layer l + 1). The head's embedding is the target's (no embed_tokens is written).
"""

from __future__ import annotations

import json
import os

import numpy as np

from spec_jax.checkpoints import safetensors_io
from spec_jax.proposers import eagle3_layout, vocab


def _torch_layer(layer: dict, prefix: str) -> dict:
  """Our decoder layer's params -> torch's Llama layer tensors (Linear weights [out, in])."""
  lin = lambda a: np.ascontiguousarray(np.asarray(a, np.float32).reshape(a.shape[0], -1).T)
  o = np.asarray(layer["o"], np.float32)
  return {f"{prefix}self_attn.q_proj.weight": lin(layer["q"]), f"{prefix}self_attn.k_proj.weight": lin(layer["k"]),
          f"{prefix}self_attn.v_proj.weight": lin(layer["v"]),
          f"{prefix}self_attn.o_proj.weight": np.ascontiguousarray(o.reshape(-1, o.shape[-1]).T),
          f"{prefix}mlp.gate_proj.weight": lin(layer["gate"]), f"{prefix}mlp.up_proj.weight": lin(layer["up"]),
          f"{prefix}mlp.down_proj.weight": lin(layer["down"]),
          f"{prefix}input_layernorm.weight": np.asarray(layer["attn_norm"], np.float32),
          f"{prefix}post_attention_layernorm.weight": np.asarray(layer["mlp_norm"], np.float32),
          f"{prefix}hidden_norm.weight": np.asarray(layer["hidden_norm"], np.float32)}


def export(meta: dict, weights: dict, d2t, fmt: str, output: str, target_config, target_params, stem: str,
           provenance: dict) -> str:
  """Writes the head (its checkpoint's `meta`, float32 `weights`, absolute `d2t` or None) as `fmt` (eagle3 |
  speculators) to `output`; -> the weights file written. `provenance`: config keys naming the verifier."""
  V, D = target_config.vocab_size, target_config.d_model
  rows = vocab.output_rows(target_params, None if d2t is None else np.asarray(d2t))  # float: export checked
  ids = np.arange(V, dtype=np.int64) if d2t is None else np.asarray(d2t, np.int64)
  layer = dict(eagle3_layout.layer_dict(target_config, int(meta["mlp_dim"])), vocab_size=V,
               max_position_embeddings=int(target_config.max_seq_len), tie_word_embeddings=False)
  aux_ids = [int(l) + 1 for l in meta["feature_layers"]]
  prefix = "midlayer." if fmt == "eagle3" else "layers.0."
  tensors = {"fc.weight": np.ascontiguousarray(np.asarray(weights["fuse"], np.float32).T),
             "norm.weight": np.asarray(weights["out_norm"], np.float32),
             "lm_head.weight": np.asarray(rows, np.float32),
             "d2t": ids - np.arange(len(ids), dtype=np.int64),
             "t2d": np.isin(np.arange(V), ids)}
  tensors.update(_torch_layer(weights["layer"], prefix))
  if fmt == "eagle3":
    config = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(ids), target_hidden_size=D,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": aux_ids}, **provenance)
  else:
    verifier = {"name_or_path": provenance.get("base_model_name_or_path", "")}
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "transformer_layer_config": layer, "draft_vocab_size": len(ids), "norm_before_residual": False,
              "target_hidden_size": D, "eagle_aux_hidden_state_layer_ids": aux_ids,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": verifier},
              **{k: v for k, v in provenance.items() if k != "base_model_name_or_path"}}
  config["spec_jax_exported_from"] = os.path.basename(stem)
  os.makedirs(output, exist_ok=True)
  path = os.path.join(output, "model.safetensors")
  safetensors_io.write(path, tensors)
  with open(os.path.join(output, "config.json"), "w") as f:
    json.dump(config, f, indent=1, sort_keys=True)
  return path
