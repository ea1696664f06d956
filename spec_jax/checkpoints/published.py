"""Draft heads as others publish them, loaded into this project's proposers without conversion by hand.

A published head is a directory. `detect(dir)` says which format it holds, from its files and config.json:
- "speculators": vLLM's speculators format (config.json with `speculators_model_type`; EAGLE-3: `layers.0.*`,
  `fc`, `norm`, `lm_head`, `d2t`, `t2d`, `eagle_aux_hidden_state_layer_ids`, `speculators_config.verifier`;
  EAGLE-1/HASS (`eagle`): `fusion_fc` (+ bias, HASS) over [embedding; hidden], one decoder layer `transformer.*`,
  with `layernorms` also `embedding_layernorm`, the layer's input norm and `pre_lm_head_layernorm`; embeddings,
  RoPE and lm_head are the verifier's);
- "medusa": Medusa-1 as FasterDecoding publishes it (`medusa_lm_head.safetensors|.pt|.bin`, config.json with
  `medusa_num_heads`, `medusa_num_layers`; per head `{h}.{j}.linear.weight|bias` residual SiLU blocks and
  `{h}.{medusa_num_layers}.weight`, its own head matrix);
- "eagle3": EAGLE-3 as SafeAILab and SpecForge publish it (`midlayer.*` or `layers.0.hidden_norm`, the fused
  `fc` [D, 3 Dt], `norm`, `lm_head` over the draft vocabulary, `d2t` holding offsets: target id = draft id +
  d2t[draft id], `t2d` a mask over the target's ids);
- "eagle1": EAGLE-1/2 as its authors publish it (`fc` [D, 2 D] (+ bias) over [embedding; hidden], one Llama
  decoder layer `layers.0.*` without `input_layernorm`).
Weights come from `model.safetensors` (or any `*.safetensors`) or `pytorch_model.bin`, the latter read without
torch (spec_jax/checkpoints/weight_files.py).

Aux hidden-state layer ids (EAGLE-3) follow vLLM's convention: id i is the residual stream at the *input* of
target layer i, so this project's feature layer (a layer's output) is i - 1. Without ids in the config the
conventional default is (2, L // 2, L - 3).
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.checkpoints.weight_files import read_json, read_weights  # noqa: F401 (pair_check reads them here)
from spec_jax.checkpoints.safetensors_loader import llama_layer_config
from spec_jax.config import ModelConfig
from spec_jax.proposers import eagle, medusa, vocab

FORMATS = ("speculators", "medusa", "eagle3", "eagle1")
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")


def detect(directory: str) -> str:
  """Which published format `directory` holds (FORMATS), or a ValueError naming what is missing."""
  directory = str(directory)
  cfg_path = os.path.join(directory, "config.json")
  cfg = read_json(cfg_path) if os.path.isfile(cfg_path) else None
  if cfg is not None and "speculators_model_type" in cfg:
    return "speculators"
  if any(os.path.isfile(os.path.join(directory, n)) for n in MEDUSA_FILES) or (cfg or {}).get("medusa_num_heads"):
    return "medusa"
  if cfg is None:
    raise ValueError(f"{directory}: not a published draft head: config.json is missing (expected config.json with "
                     f"weights, or {MEDUSA_FILES[0]})")
  if any("eagle3" in str(a).lower() for a in cfg.get("architectures") or ()) or "draft_vocab_size" in cfg:
    return "eagle3"
  weights, _ = read_weights(directory)
  if any(k.startswith("midlayer.") or k.endswith("hidden_norm.weight") for k in weights):
    return "eagle3"
  if "fc.weight" in weights and any(k.startswith("layers.0.") for k in weights):
    return "eagle1"
  raise ValueError(f"{directory}: config.json and weights are not a known draft head format: expected "
                   "speculators_model_type (speculators), medusa_lm_head.* (Medusa-1), midlayer.* / "
                   "layers.0.hidden_norm (EAGLE-3) or fc + layers.0.* (EAGLE-1/2); found tensors "
                   f"{sorted(weights)[:8]}")


def is_published(path: str) -> bool:
  """Is `path` a directory that looks like a published head (not one of our trainer's checkpoints)?"""
  if not path or not os.path.isdir(path):
    return False
  return any(os.path.isfile(os.path.join(path, n)) for n in ("config.json",) + MEDUSA_FILES)


# ----------------------------------------------------------------------------------------- helpers


class _Tensors:
  def __init__(self, weights: dict, where: str):
    self.w, self.where, self.used = weights, where, set()

  def has(self, name):
    return name in self.w

  def get(self, name, shape=None):
    if name not in self.w:
      raise ValueError(f"{self.where}: tensor {name!r} is missing (expected shape {shape}); tensors present: "
                       f"{sorted(self.w)[:12]}")
    a = np.asarray(self.w[name])
    if shape is not None and tuple(a.shape) != tuple(shape):
      raise ValueError(f"{self.where}: tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    self.used.add(name)
    return a

  def linear(self, name, n_in, n_out):
    """A torch Linear weight [out, in] -> ours [in, out] (float32)."""
    return self.get(name, (n_out, n_in)).astype(np.float32).T


# transformers' LlamaConfig defaults: speculators writes transformer_layer_config with to_diff_dict, which leaves
# out every value equal to these (Llama-3-8B's hidden_size 4096, for one).
LLAMA_DEFAULTS = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_attention_heads=32, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0)


def _decoder_layer(t: _Tensors, prefix: str, cfg: ModelConfig, in_width: int, input_norm: bool) -> dict:
  D, H, K, d, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  p = {
      "q": t.linear(f"{prefix}self_attn.q_proj.weight", in_width, H * d).reshape(in_width, H, d),
      "k": t.linear(f"{prefix}self_attn.k_proj.weight", in_width, K * d).reshape(in_width, K, d),
      "v": t.linear(f"{prefix}self_attn.v_proj.weight", in_width, K * d).reshape(in_width, K, d),
      "o": t.linear(f"{prefix}self_attn.o_proj.weight", H * d, D).reshape(H, d, D),
      "mlp_norm": t.get(f"{prefix}post_attention_layernorm.weight", (D,)),
      "gate": t.linear(f"{prefix}mlp.gate_proj.weight", D, F),
      "up": t.linear(f"{prefix}mlp.up_proj.weight", D, F),
      "down": t.linear(f"{prefix}mlp.down_proj.weight", F, D),
  }
  if cfg.qkv_bias:
    p.update(q_bias=t.get(f"{prefix}self_attn.q_proj.bias", (H * d,)).reshape(H, d),
             k_bias=t.get(f"{prefix}self_attn.k_proj.bias", (K * d,)).reshape(K, d),
             v_bias=t.get(f"{prefix}self_attn.v_proj.bias", (K * d,)).reshape(K, d))
  # A layer without its input norm (EAGLE-1's first layer) still gets the row: decoder_layer is then handed its
  # attention input directly and never reads it.
  p["attn_norm"] = t.get(f"{prefix}input_layernorm.weight", (D,)) if input_norm else np.ones((D,), np.float32)
  return p


def _check_unused(t: _Tensors, ignore=()) -> None:
  extra = sorted(k for k in t.w if k not in t.used and not any(k.startswith(i) for i in ignore))
  if extra:
    raise ValueError(f"{t.where}: unexpected tensors {extra[:8]} (a layout this loader does not know)")


def _embed(t: _Tensors, target_params: dict, cfg: ModelConfig, target: ModelConfig, dtype):
  """The head's own embedding when it ships one, else the target's (it must then be as wide as the layer)."""
  if t.has("embed_tokens.weight"):
    return jnp.asarray(t.get("embed_tokens.weight", (target.vocab_size, cfg.d_model)), dtype)
  if target.d_model != cfg.d_model:
    raise ValueError(f"{t.where}: no embed_tokens.weight and the target's width {target.d_model} differs from "
                     f"the head's {cfg.d_model}")
  return target_params["embed"]


def _to_params(tree, dtype):
  return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float32), dtype), tree)


# ------------------------------------------------------------------------------------------- EAGLE


def aux_layer_ids(ids, target: ModelConfig, where: str) -> tuple:
  """vLLM's aux hidden-state ids (inputs of target layers) -> this project's feature layers (layer outputs)."""
  L = target.num_layers
  ids = tuple(int(i) for i in (ids if ids else (2, L // 2, L - 3)))
  if any(not 1 <= i <= L for i in ids) or len(set(ids)) != len(ids):
    raise ValueError(f"{where}: aux hidden-state layer ids {list(ids)} must be distinct and in [1, {L}] for a "
                     f"{L}-layer target (id 0, the embeddings, is not supported)")
  return tuple(i - 1 for i in ids)


def _d2t(t: _Tensors, n: int, target: ModelConfig) -> Optional[np.ndarray]:
  """Published d2t offsets -> this project's absolute draft-to-target ids (None: the full vocabulary)."""
  if not t.has("d2t"):
    if n != target.vocab_size:
      raise ValueError(f"{t.where}: a {n}-id draft vocabulary needs a d2t tensor")
    return None
  off = t.get("d2t", (n,)).astype(np.int64)
  ids = np.arange(n, dtype=np.int64) + off
  if ids.min() < 0 or ids.max() >= target.vocab_size:
    bad = int(np.argmax((ids < 0) | (ids >= target.vocab_size)))
    raise ValueError(f"{t.where}: d2t is out of range: draft id {bad} + offset {int(off[bad])} = {int(ids[bad])}, "
                     f"outside the target's vocabulary [0, {target.vocab_size})")
  if len(np.unique(ids)) != n:
    raise ValueError(f"{t.where}: d2t maps two draft ids to one target id")
  if t.has("t2d"):
    mask = t.get("t2d", (target.vocab_size,)).astype(bool)
    if not np.array_equal(np.flatnonzero(mask), np.sort(ids)):
      raise ValueError(f"{t.where}: t2d does not mark exactly the target ids d2t maps to")
  if n == target.vocab_size and np.array_equal(ids, np.arange(n)):
    return None
  return ids.astype(np.int32)


def load_eagle3(directory: str, target: ModelConfig, target_params: dict, fmt: str, k: int, impl: str, tree):
  """An EAGLE-3 head (SafeAILab / SpecForge, or speculators) -> (EagleProposer, params)."""
  where = os.path.join(directory, "config.json")
  cfg = read_json(where)
  if fmt == "speculators":
    layer_cfg = cfg.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
      raise ValueError(f"{where}: speculators EAGLE-3 config needs a transformer_layer_config object")
    layer_cfg = {**LLAMA_DEFAULTS, "num_hidden_layers": 1, **layer_cfg}
    for flag in ("norm_before_fc",):
      if cfg.get(flag):
        raise ValueError(f"{where}: {flag}=true is not supported")
    if int(layer_cfg.get("num_hidden_layers", 1)) != 1:
      raise ValueError(f"{where}: {layer_cfg['num_hidden_layers']} draft layers; only 1 is supported")
    ids, n = cfg.get("eagle_aux_hidden_state_layer_ids"), int(cfg.get("draft_vocab_size", target.vocab_size))
    published = eagle.Published("eagle3", bool(cfg.get("norm_before_residual", False)),
                                bool(cfg.get("norm_output", False)))
    prefix, fc_norm = "layers.0.", bool(cfg.get("fc_norm", False))
    target_hidden = cfg.get("target_hidden_size")
  else:
    layer_cfg = cfg
    if int(cfg.get("num_hidden_layers", 1)) != 1:
      raise ValueError(f"{where}: {cfg['num_hidden_layers']} draft layers; only 1 is supported")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    n = int(cfg.get("draft_vocab_size", target.vocab_size))
    # SpecForge's `norm_output` (default true) means "logits through the final norm", which is this layout.
    published, prefix, fc_norm = eagle.Published("eagle3"), None, bool(cfg.get("fc_norm", False))
    target_hidden = cfg.get("target_hidden_size")
  lcfg = llama_layer_config(layer_cfg, target, where)
  weights, wpath = read_weights(directory)
  t = _Tensors(weights, wpath)
  if prefix is None:
    prefix = "midlayer." if any(k.startswith("midlayer.") for k in weights) else "layers.0."
  Dt = int(target_hidden or lcfg.d_model)
  if Dt != target.d_model:
    raise ValueError(f"{where}: the head reads target features of width {Dt}, the target's hidden size is "
                     f"{target.d_model}")
  layers = aux_layer_ids(ids, target, where)
  nf, D = len(layers), lcfg.d_model
  fc_w = t.get("fc.weight")
  if fc_w.shape != (D, nf * Dt):
    raise ValueError(f"{wpath}: tensor 'fc.weight' has shape {tuple(fc_w.shape)}, expected {(D, nf * Dt)} "
                     f"({nf} aux layers of hidden size {Dt}: a head made for another target?)")
  layer = _decoder_layer(t, prefix, lcfg, 2 * D, input_norm=True)
  layer["hidden_norm"] = t.get(f"{prefix}hidden_norm.weight", (D,))
  w = {"fuse": t.linear("fc.weight", nf * Dt, D), "layer": layer, "out_norm": t.get("norm.weight", (D,))}
  if fc_norm:
    w["fuse_norm"] = np.stack([t.get(f"fc_norm.{i}.weight", (Dt,)) for i in range(nf)])
  lm = t.get("lm_head.weight", (n, D))
  d2t = _d2t(t, n, target)
  dtype = target_params["final_norm"].dtype
  params = _to_params(w, dtype)
  params.update(embed=_embed(t, target_params, lcfg, target, dtype), rows=jnp.asarray(lm, dtype))
  if d2t is not None:
    params["d2t"] = jnp.asarray(d2t, jnp.int32)
  _check_unused(t, ignore=("verifier_", "embed_tokens.weight"))
  proposer = eagle.EagleProposer(config=lcfg, vocab_size=target.vocab_size, k=k, reduced=d2t is not None,
                                 impl=impl, tree=tree, feature_layers=layers, published=published)
  return proposer, params


def load_eagle1(directory: str, target: ModelConfig, target_params: dict, k: int, impl: str, tree):
  """An EAGLE-1/2 head as its authors publish it -> (EagleProposer, params)."""
  where = os.path.join(directory, "config.json")
  cfg = read_json(where)
  if int(cfg.get("num_hidden_layers", 1)) != 1:
    raise ValueError(f"{where}: {cfg['num_hidden_layers']} draft layers; only 1 is supported")
  lcfg = llama_layer_config(cfg, target, where)
  if lcfg.d_model != target.d_model:
    raise ValueError(f"{where}: hidden_size {lcfg.d_model} differs from the target's {target.d_model} (a head "
                     "made for another target?)")
  weights, wpath = read_weights(directory)
  t = _Tensors(weights, wpath)
  D = lcfg.d_model
  w = {"fc": t.linear("fc.weight", 2 * D, D), "layer": _decoder_layer(t, "layers.0.", lcfg, D, input_norm=False)}
  if t.has("fc.bias"):
    w["fc_bias"] = t.get("fc.bias", (D,))
  dtype = target_params["final_norm"].dtype
  params = _to_params(w, dtype)
  params.update(embed=_embed(t, target_params, lcfg, target, dtype), rows=vocab.output_rows(target_params))
  _check_unused(t, ignore=("embed_tokens.weight",))
  proposer = eagle.EagleProposer(config=lcfg, vocab_size=target.vocab_size, k=k, impl=impl, tree=tree,
                                 published=eagle.Published("eagle1"))
  return proposer, params


def load_speculators_eagle(directory: str, target: ModelConfig, target_params: dict, k: int, impl: str, tree):
  """A speculators EAGLE-1/HASS head (speculators_model_type "eagle") -> (EagleProposer, params).

  Its forward (speculators' EagleSpeculator): x = fusion_fc([e; h]) (+ bias) with e the verifier's embedding
  (embedding_layernorm(e) with `layernorms`), one decoder layer (its input norm only with `layernorms`), the
  verifier's RoPE, logits = verifier lm_head(x) (pre_lm_head_layernorm(x) first with `layernorms`); x is fed back.
  """
  where = os.path.join(directory, "config.json")
  cfg = read_json(where)
  layer_cfg = cfg.get("transformer_layer_config")
  if not isinstance(layer_cfg, dict):
    raise ValueError(f"{where}: speculators EAGLE config needs a transformer_layer_config object")
  arch = cfg.get("transformer_layer_architecture", "auto")
  if arch not in ("auto", "LlamaDecoderLayer"):
    raise ValueError(f"{where}: transformer_layer_architecture {arch!r} is not supported (LlamaDecoderLayer)")
  # The model always builds one layer (num_hidden_layers may be the verifier's); RoPE is the verifier's.
  lcfg = llama_layer_config({**LLAMA_DEFAULTS, **layer_cfg}, target, where).replace(
      rope_base=target.rope_base, rope_base_local=target.rope_base, rope_scaling=target.rope_scaling)
  if lcfg.d_model != target.d_model:
    raise ValueError(f"{where}: hidden_size {lcfg.d_model} differs from the target's {target.d_model} (a head "
                     "made for another target?)")
  layernorms, D = bool(cfg.get("layernorms", False)), lcfg.d_model
  weights, wpath = read_weights(directory)
  t = _Tensors(weights, wpath)
  w = {"fc": t.linear("fusion_fc.weight", 2 * D, D),
       "layer": _decoder_layer(t, "transformer.", lcfg, D, input_norm=layernorms)}
  if cfg.get("fusion_bias", False) or t.has("fusion_fc.bias"):
    w["fc_bias"] = t.get("fusion_fc.bias", (D,))
  if layernorms:
    w["emb_norm"] = t.get("embedding_layernorm.weight", (D,))
    w["out_norm"] = t.get("pre_lm_head_layernorm.weight", (D,))
  dtype = target_params["final_norm"].dtype
  params = _to_params(w, dtype)
  params.update(embed=target_params["embed"], rows=vocab.output_rows(target_params))
  _check_unused(t, ignore=("verifier", "embed_tokens.weight", "lm_head."))
  proposer = eagle.EagleProposer(config=lcfg, vocab_size=target.vocab_size, k=k, impl=impl, tree=tree,
                                 published=eagle.Published("eagle1", layernorms=layernorms))
  return proposer, params


# ------------------------------------------------------------------------------------------ Medusa


def load_medusa(directory: str, target: ModelConfig, target_params: dict, k: int):
  """Medusa-1 heads as FasterDecoding publishes them -> (MedusaProposer, params)."""
  where = os.path.join(directory, "config.json")
  cfg = read_json(where) if os.path.isfile(where) else {}
  try:
    K, NL = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
  except KeyError as e:
    raise ValueError(f"{where}: config key 'medusa_num_heads' is missing") from e
  for key, want in (("hidden_size", target.d_model), ("vocab_size", target.vocab_size)):
    if key in cfg and int(cfg[key]) != want:
      raise ValueError(f"{where}: {key} is {cfg[key]}, the target's is {want} (a head made for another target?)")
  weights, wpath = read_weights(directory, MEDUSA_FILES)
  t = _Tensors(weights, wpath)
  D, V = target.d_model, target.vocab_size
  if t.has("0.0.linear.weight") and t.w["0.0.linear.weight"].shape != (D, D):
    raise ValueError(f"{wpath}: tensor '0.0.linear.weight' has shape {tuple(t.w['0.0.linear.weight'].shape)}, "
                     f"expected {(D, D)} (hidden size {D}: a head made for another target?)")
  w = np.stack([np.stack([t.linear(f"{h}.{j}.linear.weight", D, D) for j in range(NL)]) for h in range(K)])
  b = np.stack([np.stack([t.get(f"{h}.{j}.linear.bias", (D,)) for j in range(NL)]) for h in range(K)])
  rows = np.stack([t.get(f"{h}.{NL}.weight", (V, D)) for h in range(K)])
  _check_unused(t)
  dtype = target_params["final_norm"].dtype
  params = {"heads": _to_params({"w": w, "b": b}, dtype), "rows": jnp.asarray(rows, dtype)}
  return medusa.MedusaProposer(vocab_size=V, num_heads=K, k=k, num_layers=NL), params


# ---------------------------------------------------------------------------------------------- entry


def load(directory: str, method: str, kinds: tuple, target: ModelConfig, target_params: dict, k: int,
         impl: str = "xla", tree=None):
  """The registry's entry: a published head directory for `method`, which takes heads of `kinds` (its entry's
  head_kinds) -> (proposer, params)."""
  fmt = detect(directory)
  if fmt == "speculators":
    kind = read_json(os.path.join(directory, "config.json")).get("speculators_model_type")
    if kind not in ("eagle", "eagle3"):
      raise ValueError(f"{directory}: speculators_model_type {kind!r} is not supported (eagle, eagle3 are)")
    fmt_kind = {"eagle": "eagle1", "eagle3": "eagle3"}[kind]
  else:
    fmt_kind = fmt
  if fmt_kind not in kinds:
    raise ValueError(f"{directory} holds a {fmt_kind} head ({fmt} format); method {method!r} takes "
                     f"{', '.join(kinds) or 'no published head'}")
  if fmt_kind == "medusa":
    return load_medusa(directory, target, target_params, k)
  if fmt_kind == "eagle1":
    if fmt == "speculators":
      return load_speculators_eagle(directory, target, target_params, k, impl, tree)
    return load_eagle1(directory, target, target_params, k, impl, tree)
  return load_eagle3(directory, target, target_params, fmt, k, impl, tree)
