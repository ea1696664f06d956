"""The static half of the pair check: does this draft head fit this target, before anything is loaded or run?

`static_check(spec, target_config, tokenizer, target_path)` reads the head's config and a few tensors (shapes,
d2t) without building the proposer and returns a list of Findings, one per check:
- format: the published layout detected (spec_jax/checkpoints/published.py), or our trainer's checkpoint;
- vocab: the head's vocabulary size is the target's, and the tokenizer's digest (Tokenizer.vocab_digest) is the
  target's where the head carries one (`spec_jax_vocab_digest`, written by train.export; `vocab_digest` in our
  own checkpoints) or names a verifier directory that exists here;
- hidden: the head's hidden size (and the EAGLE-3 fused FC's width) fits the target's;
- layers: EAGLE-3's aux hidden-state layer ids lie within the target;
- d2t: the draft-to-target map lies in the target's vocabulary, without duplicates;
- verifier: the verifier the head names is the loaded target, by name (the last path component, compared
  loosely) and by architecture (the HF `architectures`, and heads.target_fingerprint where the head carries one or
  the verifier is a local directory). A difference is a warning: the output stays exact, the drafts may be poor.
Levels: "pass", "info" (nothing to check), "warning", "error" (the pair cannot work). `enforce` raises on errors,
and on warnings under strict; the run commands (serve/jobs/setup.py load) call it before they load the head, and
`python -m serve.check_pair` prints the findings and then measures the pair.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
from typing import Optional

from safetensors import safe_open

from spec_jax.checkpoints import heads, published
from spec_jax.checkpoints.heads import target_fingerprint
from spec_jax.checkpoints.load import load_tokenizer
from spec_jax.checkpoints.safetensors_loader import read_config
from spec_jax.config import ModelConfig
from spec_jax.proposers.eagle import check_feature_layers
from spec_jax.proposers.registry import METHODS, default_heads_path, is_checkpoint

log = logging.getLogger("spec_jax.pair_check")
LEVELS = ("pass", "info", "warning", "error")


@dataclasses.dataclass(frozen=True)
class Finding:
  check: str  # format | vocab | hidden | layers | d2t | verifier | head
  level: str  # LEVELS
  message: str

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def head_path(spec) -> Optional[str]:
  """The head a speculative config drafts with (None: a method without a head)."""
  entry = METHODS.get(spec.method)
  if entry is None or not (entry.head_kinds or entry.checkpoint_kind):
    return None
  return spec.model or default_heads_path(spec.method)


def _norm_name(name: str) -> str:
  base = os.path.basename(os.path.normpath(str(name)))
  base = base[:-len(".gguf")] if base.endswith(".gguf") else base
  return re.sub(r"[^a-z0-9]", "", base.lower())


def _target_names(target_config: ModelConfig, target_path: Optional[str]) -> set:
  names = {_norm_name(target_config.name)}
  if target_path:
    names.add(_norm_name(target_path))
  return {n for n in names if n}


def _target_architectures(target_path: Optional[str]) -> Optional[list]:
  p = os.path.join(target_path, "config.json") if target_path and os.path.isdir(target_path) else None
  if not p or not os.path.isfile(p):
    return None
  try:
    with open(p) as f:
      return list(json.load(f).get("architectures") or ()) or None
  except (OSError, ValueError):
    return None


def _same_path(a: str, b: Optional[str]) -> bool:
  return bool(b) and os.path.exists(a) and os.path.exists(b) and os.path.realpath(a) == os.path.realpath(b)


# ------------------------------------------------------------------------------------------------ tensors


def _safetensors_files(directory: str) -> list:
  return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def _tensor_shapes(directory: str, files: tuple = ()) -> dict:
  """{name: shape} of a head's weights, from the safetensors headers (a torch .bin is read whole)."""
  paths = [os.path.join(directory, f) for f in files if os.path.isfile(os.path.join(directory, f))] if files else (
      _safetensors_files(directory))
  out = {}
  st = [p for p in paths if p.endswith(".safetensors")]
  if st:
    for p in st:
      try:
        with safe_open(p, framework="numpy") as h:
          for n in h.keys():
            out[n] = tuple(h.get_slice(n).get_shape())
      except Exception as e:  # the package's own error types
        raise ValueError(f"{p} is not a readable safetensors file: {e}") from e
    return out
  weights, _ = published.read_weights(directory, files)
  return {n: tuple(a.shape) for n, a in weights.items()}


def _read_tensors(directory: str, names: tuple) -> dict:
  """Only `names` (those present) of a head's weights."""
  st = _safetensors_files(directory)
  out = {}
  if st:
    for p in st:
      try:
        with safe_open(p, framework="numpy") as h:
          for n in names:
            if n in h.keys():
              out[n] = h.get_tensor(n)
      except Exception as e:
        raise ValueError(f"{p}: cannot read {list(names)}: {e}") from e
    return out
  weights, _ = published.read_weights(directory)
  return {n: weights[n] for n in names if n in weights}


# ------------------------------------------------------------------------------------------------- checks


def _vocab_findings(head_vocab, digest, verifier_dir, target_config, tokenizer) -> list:
  out = []
  V = target_config.vocab_size
  if head_vocab is not None and int(head_vocab) != V:
    out.append(Finding("vocab", "error", f"the head's vocabulary has {head_vocab} ids, the target's {V}"))
  elif head_vocab is not None:
    out.append(Finding("vocab", "pass", f"vocabulary size {V}"))
  if tokenizer is None:
    return out
  have = None
  if digest is None and verifier_dir:
    try:
      digest, have = load_tokenizer(verifier_dir).vocab_digest(), f"the verifier's tokenizer ({verifier_dir})"
    except (OSError, ValueError) as e:
      out.append(Finding("vocab", "info", f"the verifier's tokenizer in {verifier_dir} cannot be read: {e}"))
  if digest is None:
    out.append(Finding("vocab", "info", "the head carries no tokenizer digest and names no verifier directory "
                       "here: the tokenizer is not compared"))
    return out
  mine = tokenizer.vocab_digest()
  have = have or "the head's tokenizer digest"
  if digest != mine:
    out.append(Finding("vocab", "error", f"{have} {digest[:16]} differs from the target tokenizer's {mine[:16]}: "
                       "the head was trained with another tokenizer"))
  else:
    out.append(Finding("vocab", "pass", f"tokenizer digest {mine[:16]} ({have})"))
  return out


def _verifier_findings(name, architectures, fingerprint, target_config, target_path) -> list:
  out = []
  mine = target_fingerprint(target_config)
  names = _target_names(target_config, target_path)
  if not name:
    out.append(Finding("verifier", "info", "the head names no verifier model"))
  elif _same_path(name, target_path) or _norm_name(name) in names:
    out.append(Finding("verifier", "pass", f"the head's verifier {name!r} is the loaded target"))
  else:
    out.append(Finding("verifier", "warning", f"the head names verifier {name!r}, the loaded target is "
                       f"{target_path or target_config.name!r}: a head made for another model drafts poorly"))
  mine_arch = _target_architectures(target_path)
  if architectures and mine_arch is not None:
    if sorted(architectures) != sorted(mine_arch):
      out.append(Finding("verifier", "warning", f"the head's verifier architecture {list(architectures)} is not "
                         f"the target's {mine_arch}"))
    else:
      out.append(Finding("verifier", "pass", f"verifier architecture {mine_arch}"))
  if fingerprint is None and name and os.path.isdir(name) and os.path.isfile(os.path.join(name, "config.json")):
    try:
      fingerprint = target_fingerprint(read_config(name))
    except (OSError, ValueError, KeyError) as e:
      out.append(Finding("verifier", "info", f"the verifier's config in {name} cannot be read: {e}"))
  if fingerprint is not None:
    if fingerprint != mine:
      out.append(Finding("verifier", "warning", f"the verifier's architecture fingerprint {fingerprint} is not "
                         f"the target's {mine}"))
    else:
      out.append(Finding("verifier", "pass", f"architecture fingerprint {mine}"))
  return out


def _local_dir(name) -> Optional[str]:
  return name if name and os.path.isdir(str(name)) else None


def _published_findings(directory: str, method: str, target_config: ModelConfig, tokenizer, target_path) -> list:
  try:
    fmt = published.detect(directory)
  except (ValueError, FileNotFoundError) as e:
    return [Finding("format", "error", str(e))]
  cfg_path = os.path.join(directory, "config.json")
  cfg = published.read_json(cfg_path) if os.path.isfile(cfg_path) else {}
  kind = fmt
  if fmt == "speculators":
    kind = {"eagle": "eagle1", "eagle3": "eagle3"}.get(cfg.get("speculators_model_type"))
    if kind is None:
      return [Finding("format", "error", f"{directory}: speculators_model_type {cfg.get('speculators_model_type')!r} "
                      "is not supported (eagle, eagle3 are)")]
  allowed = METHODS[method].head_kinds
  if kind not in allowed:
    return [Finding("format", "error", f"{directory} holds a {kind} head ({fmt} format); method {method!r} takes "
                    f"{', '.join(allowed)}")]
  out = [Finding("format", "pass", f"{fmt} format ({kind} head) in {directory}")]
  D, V = target_config.d_model, target_config.vocab_size
  try:
    shapes = _tensor_shapes(directory, published.MEDUSA_FILES if kind == "medusa" else ())
  except (ValueError, FileNotFoundError) as e:
    return out + [Finding("format", "error", str(e))]
  layer_cfg = cfg.get("transformer_layer_config") if fmt == "speculators" else cfg
  layer_cfg = layer_cfg if isinstance(layer_cfg, dict) else {}
  if fmt == "speculators":  # written with to_diff_dict: LlamaConfig's defaults are left out
    layer_cfg = {**published.LLAMA_DEFAULTS, **layer_cfg}
  verifier = (cfg.get("speculators_config") or {}).get("verifier") or {} if fmt == "speculators" else {}
  vname = verifier.get("name_or_path") or cfg.get("base_model_name_or_path") or cfg.get("verifier_name_or_path")
  varch = verifier.get("architectures")
  out += _vocab_findings(layer_cfg.get("vocab_size", cfg.get("vocab_size")), cfg.get("spec_jax_vocab_digest"),
                         _local_dir(vname), target_config, tokenizer)
  hidden = []
  if kind == "medusa":
    if "hidden_size" in cfg and int(cfg["hidden_size"]) != D:
      hidden.append(f"hidden_size is {cfg['hidden_size']}, the target's is {D}")
    w = shapes.get("0.0.linear.weight")
    if w is not None and w != (D, D):
      hidden.append(f"tensor '0.0.linear.weight' has shape {w}, expected {(D, D)}")
  elif kind == "eagle1":
    if "hidden_size" in layer_cfg and int(layer_cfg["hidden_size"]) != D:
      hidden.append(f"hidden_size is {layer_cfg['hidden_size']}, the target's is {D}")
    name = "fusion_fc.weight" if fmt == "speculators" else "fc.weight"
    if shapes.get(name) is not None and shapes[name] != (D, 2 * D):
      hidden.append(f"tensor {name!r} has shape {shapes[name]}, expected {(D, 2 * D)}")
  else:
    Dl = layer_cfg.get("hidden_size")
    Dt = cfg.get("target_hidden_size") or Dl
    if Dt is not None and int(Dt) != D:
      hidden.append(f"the head reads target features of width {Dt}, the target's hidden size is {D}")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    try:
      layers = published.aux_layer_ids(ids, target_config, cfg_path)
      L = target_config.num_layers
      out.append(Finding("layers", "pass", f"aux hidden-state layer ids {list(ids)} within the target's {L}" if ids
                         else f"aux hidden-state layer ids {[2, L // 2, L - 3]} (the default) within the target's {L}"))
      fc = shapes.get("fc.weight")
      if fc is not None and Dl is not None and fc != (int(Dl), len(layers) * D):
        hidden.append(f"tensor 'fc.weight' has shape {fc}, expected {(int(Dl), len(layers) * D)} ({len(layers)} "
                      f"aux layers of hidden size {D})")
    except ValueError as e:
      out.append(Finding("layers", "error", str(e)))
  out += [Finding("hidden", "error", h) for h in hidden] or [Finding("hidden", "pass", f"hidden size {D}")]
  if kind == "eagle3":
    n = int(cfg.get("draft_vocab_size", V))
    try:
      t = published._Tensors(_read_tensors(directory, ("d2t", "t2d")), directory)
      ids = published._d2t(t, n, target_config)
      out.append(Finding("d2t", "pass", f"{n} draft ids within the target's {V}" if ids is not None else
                         "the full vocabulary (no d2t)"))
    except ValueError as e:
      out.append(Finding("d2t", "error", str(e)))
  out += _verifier_findings(vname, varch, cfg.get("spec_jax_target_fingerprint"), target_config, target_path)
  return out


def _checkpoint_findings(stem: str, method: str, target_config: ModelConfig, tokenizer, target_path) -> list:
  """One of our trainer's checkpoints (<stem>.json + <stem>.safetensors)."""
  with open(stem + ".json") as f:
    meta = json.load(f)
  want = METHODS[method].checkpoint_kind
  if meta.get("kind") != want:
    return [Finding("format", "error", f"{stem}.json: a {meta.get('kind')!r} head checkpoint; method {method!r} "
                    f"takes a {want!r} one")]
  out = [Finding("format", "pass", f"this project's {want} checkpoint {stem}")]
  out += _vocab_findings(meta.get("vocab_size"), meta.get("vocab_digest"), None, target_config, tokenizer)
  D = target_config.d_model
  out.append(Finding("hidden", "pass", f"hidden size {D}") if meta.get("hidden_size") == D else
             Finding("hidden", "error", f"hidden_size is {meta.get('hidden_size')}, the target's is {D}"))
  if want == "eagle":
    try:
      layers = check_feature_layers(meta.get("feature_layers") or (), target_config, stem)
      if METHODS[method].needs_feature_layers and not layers:
        out.append(Finding("layers", "error", f"{stem} is an EAGLE-1 head (no feature layers); use method eagle"))
      elif layers:
        out.append(Finding("layers", "pass", f"feature layers {list(layers)} within the target's "
                           f"{target_config.num_layers}"))
    except ValueError as e:
      out.append(Finding("layers", "error", str(e)))
  try:
    d2t = _read_tensors_file(stem + ".safetensors", "d2t")
    if d2t is not None:
      heads.check_d2t(d2t, target_config.vocab_size, where=stem + ".safetensors")
      out.append(Finding("d2t", "pass", f"{len(d2t)} draft ids within the target's {target_config.vocab_size}"))
  except ValueError as e:
    out.append(Finding("d2t", "error", str(e)))
  fp, mine = meta.get("target_fingerprint"), heads.target_fingerprint(target_config)
  name = meta.get("target_name")
  if name and _norm_name(name) not in _target_names(target_config, target_path):
    out.append(Finding("verifier", "warning", f"the head was trained for {name!r}, the loaded target is "
                       f"{target_config.name!r}"))
  elif name:
    out.append(Finding("verifier", "pass", f"trained for {name!r}"))
  # load_heads refuses another fingerprint: an error here too.
  out.append(Finding("verifier", "pass", f"architecture fingerprint {mine}") if fp == mine else
             Finding("verifier", "error", f"the head's target fingerprint {fp} is not the target's {mine} (trained "
                     "for another architecture)"))
  return out


def _read_tensors_file(path: str, name: str):
  try:
    with safe_open(path, framework="numpy") as h:
      return h.get_tensor(name) if name in h.keys() else None
  except Exception as e:
    raise ValueError(f"{path} is not a readable safetensors file: {e}") from e


def static_check(spec, target_config: ModelConfig, tokenizer=None, target_path: Optional[str] = None) -> list:
  """-> [Finding] for the speculative config's head against the target (see the module doc)."""
  path = head_path(spec)
  if path is None:
    return [Finding("head", "info", f"method {spec.method!r} has no draft head to check")]
  stem = path
  for suffix in (".safetensors", ".json"):  # the loaders take a checkpoint's file names for its stem too
    stem = stem[:-len(suffix)] if stem.endswith(suffix) else stem
  try:
    if is_checkpoint(stem):
      return _checkpoint_findings(stem, spec.method, target_config, tokenizer, target_path)
    if published.is_published(path):
      return _published_findings(path, spec.method, target_config, tokenizer, target_path)
  except (OSError, ValueError) as e:
    return [Finding("format", "error", f"{path}: {e}")]
  if not os.path.exists(path) and not os.path.exists(stem + ".json"):
    raise FileNotFoundError(f"head checkpoint {path} does not exist (neither <stem>.json + <stem>.safetensors nor a "
                            "published head directory)")
  return [Finding("format", "error", f"{path}: neither a head checkpoint (<stem>.json + <stem>.safetensors) nor a "
                  "published head directory (config.json and weights, or medusa_lm_head.*)")]


def problems(findings, strict: bool = False) -> list:
  bad = ("error", "warning") if strict else ("error",)
  return [f for f in findings if f.level in bad]


def enforce(findings, strict: bool = False, what: str = "the draft head") -> None:
  """Log the warnings; raise a ValueError naming every error (and warning, when strict)."""
  for f in findings:
    if f.level == "warning":
      log.warning("pair check: %s: %s", f.check, f.message)
  bad = problems(findings, strict)
  if bad:
    raise ValueError(f"{what} does not fit the target (pair check{', strict' if strict else ''}): " +
                     "; ".join(f"{f.check}: {f.message}" for f in bad) +
                     " (python -m serve.check_pair prints every check)")


def format_findings(findings) -> str:
  width = max((len(f.check) for f in findings), default=5)
  return "\n".join(f"  {f.level.upper():<7}  {f.check:<{width}}  {f.message}" for f in findings)


def verdict(findings, strict: bool = False) -> str:
  if problems(findings, strict):
    return "incompatible"
  return "compatible, with warnings" if any(f.level == "warning" for f in findings) else "compatible"

