"""Hugging Face checkpoints: a directory with config.json and *.safetensors (one file, or sharded).

Supported model types: Llama, Qwen2, Qwen3 (dense), Gemma 3 text (`gemma3_text`) and the Gemma 3 multimodal wrapper (`gemma3`,
whose text config sits under `text_config`; only the language model is loaded). Tensor names and the
layout conversion (HF Linear weights are [out, in]; ours are [in, ...out] with heads split out) are the rows of
spec_jax/models/schema.py, as are the family differences (Gemma's norm weights are stored as w for a (1 + w)
multiplier; ours are plain multipliers).

The files are read through `safetensors_io` (the `safetensors` package), tensor by tensor as they are needed.
"""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
import numpy as np

from spec_jax.checkpoints.safetensors_io import SafetensorsFile
from spec_jax.checkpoints.weight_files import read_json
from spec_jax.config import FAMILIES, ModelConfig, family_config
from spec_jax.models import schema

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text", "gemma3")
INDEX_FILE = "model.safetensors.index.json"
# Wrappers put the decoder under these; longest first so `model.language_model.` is not cut at `model.`.
NAME_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")

_GEMMA3 = FAMILIES["gemma3"]
# Gemma3TextConfig's defaults, for keys that official config.json files leave out: its sizes and window are
# transformers' own; the rest are the family's flags.
_GEMMA3_DEFAULTS = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    rms_norm_eps=1e-6, sliding_window=4096, rope_theta=_GEMMA3["rope_base"],
    rope_local_base_freq=_GEMMA3["rope_base_local"], query_pre_attn_scalar=_GEMMA3["query_pre_attn_scalar"],
    sliding_window_pattern=_GEMMA3["global_every"], tie_word_embeddings=_GEMMA3["tie_embeddings"],
)


# ----------------------------------------------------------------------------------------------- files


def _strip(name: str) -> str:
  for p in NAME_PREFIXES:
    if name.startswith(p):
      return name[len(p):]
  return name


class _TensorIndex:
  """Every tensor across the shards, by name with the wrapper prefix stripped."""

  def __init__(self, directory: str):
    self.directory = directory
    files = self._shard_files(directory)
    self.where = {}  # stripped name -> (file, original name)
    self.clashes = {}  # stripped name -> every original name that maps to it, when more than one does
    for path in files:
      st = SafetensorsFile(path)
      for name in st.names:
        key = _strip(name)
        if key in self.where:  # only an error if that tensor is asked for (vision towers may clash)
          self.clashes.setdefault(key, [self.label(key)]).append(f"{name!r} in {path}")
        else:
          self.where[key] = (st, name)

  @staticmethod
  def _shard_files(directory):
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
      except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map' object): {e}") from e
      files = [os.path.join(directory, n) for n in names]
      for p in files:
        if not os.path.exists(p):
          raise FileNotFoundError(f"{index} lists shard {os.path.basename(p)!r}, which is missing: {p}")
      if not files:
        raise ValueError(f"{index} has an empty weight_map")
      return files
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
      raise FileNotFoundError(f"no *.safetensors files in {directory}")
    return files

  def has(self, key: str) -> bool:
    return key in self.where

  def get(self, key: str) -> np.ndarray:
    if key in self.clashes:
      raise ValueError(f"{self.directory}: tensors {', '.join(self.clashes[key])} all map to {key!r}; "
                       "cannot tell which to load")
    if key not in self.where:
      raise ValueError(f"{self.directory}: tensor {key!r} is missing (looked for it with or without the "
                       f"prefixes {NAME_PREFIXES})")
    st, name = self.where[key]
    return st.read(name)

  def label(self, key: str) -> str:
    st, name = self.where[key]
    return f"{name!r} in {st.path}"


# ---------------------------------------------------------------------------------------------- config


def _rope_spec(cfg: dict, path: str, default_theta: float, default_local: float, allow_llama3: bool = False):
  """-> (global theta, local theta, scaling), from the transformers 4 keys or 5's `rope_parameters`.

  Plain RoPE, and (where `allow_llama3`, the Llama family) Llama 3.1's `llama3` frequency scaling, which comes back
  as ModelConfig.rope_scaling's tuple. Any other scaling (linear, yarn, ...) changes the frequencies in ways this
  model does not compute, so it is refused rather than silently ignored.
  """
  rp = cfg.get("rope_parameters") or {}
  if not isinstance(rp, dict):
    raise ValueError(f"{path}: rope_parameters must be an object, got {rp!r}")
  if "full_attention" in rp or "sliding_attention" in rp:  # per layer type (Gemma 3 in transformers 5)
    full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
  else:
    full, local = rp, {}
  scaling = None
  for spec in (full, local, cfg.get("rope_scaling") or {}):
    if not isinstance(spec, dict):
      raise ValueError(f"{path}: RoPE parameters must be an object, got {spec!r}")
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind == "llama3" and allow_llama3 and spec is not local:
      try:
        scaling = ("llama3", float(spec["factor"]), float(spec["low_freq_factor"]), float(spec["high_freq_factor"]),
                   float(spec["original_max_position_embeddings"]))
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: llama3 RoPE scaling {spec!r} needs factor, low_freq_factor, high_freq_factor "
                         f"and original_max_position_embeddings: {e!r}") from e
      if scaling[2] == scaling[3]:
        raise ValueError(f"{path}: llama3 RoPE scaling with low_freq_factor == high_freq_factor is not supported")
    elif kind not in (None, "default"):
      supported = "plain RoPE or llama3 scaling" if allow_llama3 else "only plain RoPE"
      raise ValueError(f"{path}: RoPE scaling {spec!r} is not supported ({supported})")
  theta = float(full.get("rope_theta", cfg.get("rope_theta", default_theta)))
  local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", default_local)))
  return theta, local_theta, scaling


def _global_every(cfg: dict, num_layers: int, path: str) -> int:
  """Our config says layer i is global when (i + 1) % global_every == 0; derive that from HF's pattern."""
  types = cfg.get("layer_types")
  if types is not None:
    allowed = ("sliding_attention", "full_attention")
    if len(types) != num_layers or any(t not in allowed for t in types):
      raise ValueError(f"{path}: layer_types must list {num_layers} entries from {allowed}, got {types!r}")
    is_global = [t == "full_attention" for t in types]
    for g in range(1, num_layers + 2):  # num_layers + 1 means no global layer at all
      if is_global == [(i + 1) % g == 0 for i in range(num_layers)]:
        return g
    raise ValueError(f"{path}: layer_types {types!r} is not 'every N-th layer is full attention', "
                     "the only pattern this model supports")
  n = cfg.get("sliding_window_pattern", _GEMMA3_DEFAULTS["sliding_window_pattern"])
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise ValueError(f"{path}: sliding_window_pattern must be a positive integer, got {n!r}")
  return n


def _token_ids(cfg: dict, text: dict) -> dict:
  """bos/eos/pad ids; a wrapper's own ids (what its generation uses) win over its text config's."""
  out = {}
  def pick(key):
    for src in (cfg, text):
      if src.get(key) is not None:
        return src[key]
    return None
  bos, eos, pad = pick("bos_token_id"), pick("eos_token_id"), pick("pad_token_id")
  if bos is not None:
    out["bos_id"] = int(bos)
  if eos is not None:
    out["eos_ids"] = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
  if pad is not None:
    out["pad_id"] = int(pad)
  return out


def _get(cfg: dict, key: str, path: str, default=None):
  v = cfg.get(key)
  if v is None:
    v = default
  if v is None:
    raise ValueError(f"{path}: config key {key!r} is missing")
  return v


def config_from_hf(cfg: dict, path: str = "config.json", name: str = "hf") -> ModelConfig:
  """A parsed config.json -> ModelConfig (raises ValueError for what this model cannot express)."""
  model_type = cfg.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"{path}: unknown model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
  text = cfg
  if model_type == "gemma3":
    text = cfg.get("text_config")
    if not isinstance(text, dict):
      raise ValueError(f"{path}: model_type 'gemma3' needs a 'text_config' object")
  gemma = model_type in ("gemma3", "gemma3_text")
  defaults = _GEMMA3_DEFAULTS if gemma else {}
  g = lambda key: _get(text, key, path, defaults.get(key))

  for key in ("attn_logit_softcapping", "final_logit_softcapping"):
    if text.get(key) is not None:
      raise ValueError(f"{path}: {key}={text[key]} is not supported")
  D, H = int(g("hidden_size")), int(g("num_attention_heads"))
  head_dim = int(text.get("head_dim") or defaults.get("head_dim") or D // H)
  num_layers = int(g("num_hidden_layers"))
  common = dict(
      vocab_size=int(g("vocab_size")), d_model=D, num_layers=num_layers, num_heads=H,
      num_kv_heads=int(text.get("num_key_value_heads") or defaults.get("num_key_value_heads") or H),
      head_dim=head_dim, mlp_dim=int(g("intermediate_size")),
      norm_eps=float(_get(text, "rms_norm_eps", path, 1e-6)),
      max_seq_len=int(_get(text, "max_position_embeddings", path, 32768)),
      name=name, **_token_ids(cfg, text),
  )

  if gemma:
    act = text.get("hidden_activation") or text.get("hidden_act") or defaults["hidden_activation"]
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
      raise ValueError(f"{path}: hidden_activation {act!r} is not supported for Gemma 3 (gelu_pytorch_tanh)")
    theta, local_theta, _ = _rope_spec(text, path, defaults["rope_theta"], defaults["rope_local_base_freq"])
    window = text.get("sliding_window", defaults["sliding_window"])
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", defaults["tie_word_embeddings"]))
    return family_config(
        "gemma3", **common, rope_base=theta, rope_base_local=local_theta,
        sliding_window=None if window is None else int(window),
        global_every=_global_every(text, num_layers, path),
        query_pre_attn_scalar=float(g("query_pre_attn_scalar")), tie_embeddings=bool(tie),
    )

  act = text.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"{path}: hidden_act {act!r} is not supported for {model_type} (silu)")
  if model_type in ("qwen2", "qwen3") and text.get("use_sliding_window"):
    raise ValueError(f"{path}: {model_type} with use_sliding_window=true is not supported (its per-layer window "
                     "schedule differs from Gemma's); only full attention")
  if any(t != "full_attention" for t in text.get("layer_types") or ()):
    raise ValueError(f"{path}: layer_types {text['layer_types']!r}: only full attention is supported for "
                     f"{model_type}")
  if text.get("mlp_bias"):
    raise ValueError(f"{path}: mlp_bias=true is not supported")
  theta, _, scaling = _rope_spec(text, path, 10_000.0, 10_000.0, allow_llama3=model_type == "llama")
  # Qwen3's q_norm/k_norm come with the family (schema rows q_norm, k_norm; stored as plain multipliers).
  return family_config(
      model_type if model_type in ("qwen2", "qwen3") else "llama", **common,
      qkv_bias=model_type == "qwen2" or bool(text.get("attention_bias", False)),
      rope_base=theta, rope_base_local=theta, tie_embeddings=bool(text.get("tie_word_embeddings", False)),
      rope_scaling=scaling,
  )


# ---------------------------------------------------------------------------------------------- params


def _merge_generation_eos(config: ModelConfig, directory: str, own_eos: bool) -> ModelConfig:
  """Chat models often list their end-of-turn token only in generation_config.json: stop on those too.

  `own_eos` says whether config.json named any; if not, ModelConfig's (Gemma) default is replaced."""
  path = os.path.join(directory, "generation_config.json")
  if not os.path.exists(path):
    return config
  try:
    with open(path) as f:
      eos = json.load(f).get("eos_token_id")
  except (ValueError, UnicodeDecodeError, AttributeError) as e:
    raise ValueError(f"{path} is not a valid generation config: {e}") from e
  if eos is None:
    return config
  extra = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
  base = list(config.eos_ids) if own_eos else []
  return config.replace(eos_ids=tuple(dict.fromkeys([*base, *extra])))


def read_config(directory: str) -> ModelConfig:
  """The ModelConfig of a Hugging Face checkpoint directory (config.json and generation_config.json)."""
  directory = str(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"checkpoint directory not found: {directory}")
  cfg_path = os.path.join(directory, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"config.json not found in {directory}")
  cfg = read_json(cfg_path)
  config = config_from_hf(cfg, cfg_path, name=os.path.basename(os.path.normpath(directory)))
  own_eos = "eos_ids" in _token_ids(cfg, cfg.get("text_config") or cfg)
  return _merge_generation_eos(config, directory, own_eos)


def load_hf(directory: str, dtype=jnp.float32):
  """-> (ModelConfig, params as jnp arrays of `dtype`) from a Hugging Face checkpoint directory."""
  directory = str(directory)
  config = read_config(directory)
  tensors = _TensorIndex(directory)
  offset = np.float32(schema.hf_norm_offset(config))

  def fetch(row, want, i=None):
    key = schema.hf_name(row, config).format(i=i)
    w = tensors.get(key)
    out = schema.from_torch(row, w, want)
    if out is None:
      raise ValueError(f"{directory}: tensor {tensors.label(key)} has shape {tuple(w.shape)}, expected "
                       f"{schema.torch_shape(row, want)}")
    out = np.asarray(out, np.float32)
    if row.is_norm and offset:
      out = out + offset
    return out

  layers = {}
  for row in schema.layer_rows(config):
    want = row.shape(config)
    stacked = np.empty((config.num_layers,) + want, np.float32)
    for i in range(config.num_layers):
      stacked[i] = fetch(row, want, i)
    layers[row.name] = jnp.asarray(stacked, dtype)
    del stacked

  if not config.post_norms:
    # An o_proj bias (Llama with attention_bias) has no place in our model: refuse unless it is all zeros.
    for i in range(config.num_layers):
      key = f"layers.{i}.self_attn.o_proj.bias"
      if tensors.has(key) and np.any(tensors.get(key) != 0):
        raise ValueError(f"{directory}: tensor {tensors.label(key)} is a nonzero o_proj bias, which this model "
                         "does not support")

  params = {r.name: jnp.asarray(fetch(r, r.shape(config)), dtype) for r in schema.top_rows(config)}
  params["layers"] = layers
  return config, params


def llama_layer_config(cfg: dict, target: ModelConfig, where: str) -> ModelConfig:
  """A draft head's decoder layer, from its (Llama) config: its own sizes and RoPE, Llama conventions (published
  heads, and the heads trained in their layout: spec_jax/proposers/eagle3_layout.py)."""
  mt = cfg.get("model_type", "llama")
  if mt not in ("llama", None):
    raise ValueError(f"{where}: the head's layer is model_type {mt!r}; only Llama-style layers are supported")
  if cfg.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{where}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")
  try:
    D, H = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    theta, _, scaling = _rope_spec(cfg, where, 10_000.0, 10_000.0, allow_llama3=True)
    return target.replace(
        d_model=D, num_layers=1, num_heads=H, num_kv_heads=int(cfg.get("num_key_value_heads") or H),
        head_dim=int(cfg.get("head_dim") or D // H), mlp_dim=int(cfg["intermediate_size"]), activation="silu",
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), post_norms=False, qk_norm=False,
        qkv_bias=bool(cfg.get("attention_bias", False)), rope_base=theta, rope_base_local=theta,
        rope_scaling=scaling, sliding_window=None, query_pre_attn_scalar=None, name=f"{target.name}-eagle")
  except KeyError as e:
    raise ValueError(f"{where}: config key {e.args[0]!r} is missing") from e
