"""A head trained here, written in a published format, so that vLLM, SGLang and the published loaders here
(spec_jax/checkpoints/published.py) read it:

  python -m train.export --heads=heads/medusa_full --format=medusa --output=/tmp/medusa_full
  python -m serve.generate --speculative_config='{"method": "medusa", "model": "/tmp/medusa_full"}'

The target (--model, '' = the packaged Gemma 3 270M) is loaded to check the head against it (load_heads) and to
write what the format needs from it: Medusa-1 heads carry their own output matrices (the target's rows).

Formats, and which of this project's heads each can hold exactly (the same drafts, token for token):
- medusa (FasterDecoding's Medusa-1: config.json + medusa_lm_head.safetensors, one residual SiLU block per head and
  a head matrix over the whole vocabulary): our Medusa heads over the full vocabulary. A head with a reduced draft
  vocabulary (d2t) is refused: a Medusa-1 head matrix has no draft vocabulary.
- eagle (EAGLE-1/2), eagle3 (SafeAILab / SpecForge) and speculators (vLLM's EAGLE-1/HASS and EAGLE-3): refused
  for our EAGLE heads, whose forward is not any published one. Against EAGLE-1/2 and HASS: (1) ours RMS-normalizes
  the target feature before its FC (nonlinear: no FC weight absorbs it; they have no feature norm); (2) ours feeds
  back the layer's output after out_norm, they feed back the raw output; (3) ours drafts over 8192 ids, they have
  no draft vocabulary. Against EAGLE-3: ours runs its attention on attn_norm(FC([norm(feature); norm(embedding)]))
  and keeps the FC's output as the residual; theirs reads [norm(embedding); hidden_norm(feature)] (2 D wide) and
  keeps the feature: the norm between our FC and q/k/v has no place in theirs. And on a Gemma 3 target our layer
  is a Gemma layer (GeGLU, QK norms, post norms), theirs a Llama layer. A converted file would draft other tokens,
  so the export names these reasons instead of writing one. Exact export needs a head trained in a published layout:
  EAGLE heads trained with head_layout="eagle3" (spec_jax/proposers/eagle3_layout.py) are written to eagle3 and
  speculators as they are (train/export_eagle3.py).
The written config.json names the verifier (base_model_name_or_path) and adds `spec_jax_target_fingerprint` and
`spec_jax_vocab_digest`, which the pair check (serve.check_pair) compares with the target at hand.
"""

from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp
import numpy as np
from absl import app, flags

from spec_jax import flag_table
from spec_jax.checkpoints import heads as head_ckpt, safetensors_io
from spec_jax.checkpoints.load import load_model
from spec_jax.proposers import vocab
from spec_jax.quant import QTensor
from train import export_eagle3

FORMATS = ("eagle", "eagle3", "medusa", "speculators")
EAGLE3_FORMATS = ("eagle3", "speculators")  # the formats of a head trained with head_layout="eagle3"
# Why this project's EAGLE heads have no exact published form, each a part of the forward that the published ones
# (EAGLE-1/2's cnets, SpecForge's LlamaForCausalLMEagle3, speculators' EagleSpeculator / Eagle3 model, and vLLM's
# and SGLang's Llama EAGLE layers) do not compute, and that no choice of their weights reproduces.
_FEATURE_NORM = ("it RMS-normalizes the target feature (with its own weight) before the FC; a norm is not linear, "
                 "so no FC weight absorbs it, and {fmt} has no feature norm before its FC")
_FED_BACK = ("it feeds back the layer's output after its out_norm (a normalized feature), where {fmt} feeds back "
             "the layer's raw output and normalizes it only on the way to the logits, if at all")
_LAYER = ("its decoder layer has the target's own conventions ({conv}), where {fmt}'s layer is a Llama decoder "
          "layer (SiLU MLP, no QK or post norms)")
_INPUT = ("its attention reads attn_norm(FC([norm(feature); norm(embedding)])), a norm of the FC's output that no "
          "q/k/v weight over {fmt}'s 2 D-wide input [norm(embedding); hidden_norm(feature)] absorbs, and it keeps "
          "the FC's output as the residual, where {fmt} keeps the fused feature")
_VOCAB = ("it drafts over a reduced vocabulary of {n} ids (d2t), where {fmt} projects onto the target's whole "
          "vocabulary through the target's own lm_head")


def _eagle_reasons(meta: dict, fmt: str) -> list:
  """Every reason `fmt` cannot hold this project's EAGLE head `meta` exactly (see the module docstring)."""
  # speculators writes an EAGLE-3 head as its eagle3 model, an EAGLE-1 head as its eagle (HASS) model.
  three = fmt == "eagle3" or (fmt == "speculators" and bool(meta.get("feature_layers")))
  name = {"eagle": "EAGLE-1/2", "eagle3": "EAGLE-3"}.get(fmt) or (
      "speculators' EAGLE-3" if three else "speculators' EAGLE/HASS")
  out = [_INPUT.format(fmt=name)] if three else [_FEATURE_NORM.format(fmt=name), _FED_BACK.format(fmt=name)]
  if "gemma" in str(meta.get("target_name", "")).lower():
    out.append(_LAYER.format(fmt=name, conv="Gemma 3: GeGLU MLP, QK norms, post-attention and post-MLP norms"))
  if not three and meta.get("draft_vocab_size"):
    out.append(_VOCAB.format(n=meta["draft_vocab_size"], fmt=name))
  return out


class ExportError(ValueError):
  """A head that the asked-for format cannot hold exactly."""


def _meta(stem: str) -> dict:
  path = stem + ".json"
  if not (os.path.isfile(path) and os.path.isfile(stem + ".safetensors")):
    raise FileNotFoundError(f"--heads={stem}: no head checkpoint there (<stem>.json + <stem>.safetensors)")
  with open(path) as f:
    return json.load(f)


def check_exportable(meta: dict, fmt: str, stem: str = "head") -> None:
  """Raises ExportError naming why `fmt` cannot hold this head exactly."""
  if fmt not in FORMATS:
    raise ExportError(f"--format must be one of {FORMATS}, got {fmt!r}")
  kind = meta.get("kind")
  if kind not in ("medusa", "eagle"):
    raise ExportError(f"{stem}: a {kind!r} checkpoint is not a draft head (medusa or eagle); the published formats "
                      "hold heads only (a distilled draft model goes to vLLM as a model directory, method "
                      "draft_model)")
  if kind == "medusa":
    if fmt != "medusa":
      raise ExportError(f"{stem} is a Medusa head: it exports to --format=medusa only ({fmt} holds EAGLE heads)")
    if meta.get("draft_vocab_size"):
      raise ExportError(f"{stem} drafts over a reduced vocabulary of {meta['draft_vocab_size']} ids (d2t), which a "
                        "published Medusa-1 head cannot hold: its head matrices project onto the target's whole "
                        "vocabulary. Train the head with draft_vocab=0 to export it")
    return
  if fmt == "medusa":
    raise ExportError(f"{stem} is an EAGLE head: --format=medusa holds Medusa heads")
  if meta.get("head_layout") == "eagle3":  # trained in the published EAGLE-3 layout: an exact write
    if fmt not in EAGLE3_FORMATS:
      raise ExportError(f"{stem} is an EAGLE head in the published EAGLE-3 layout: it exports to --format=eagle3 or "
                        f"--format=speculators ({fmt} is EAGLE-1/2's layout: no fused aux layers, no hidden_norm)")
    return
  layers = meta.get("feature_layers") or []
  what = f"EAGLE-3 (feature layers {layers})" if layers else "EAGLE-1"
  reasons = "; ".join(f"({i}) {r}" for i, r in enumerate(_eagle_reasons(meta, fmt), 1))
  raise ExportError(f"{stem}: an {what} head of this project cannot be written as --format={fmt} exactly: "
                    f"{reasons}. A converted file would draft other tokens, so nothing is written")


def export(stem: str, fmt: str, output: str, target_config, target_params, tokenizer=None,
           target_name: str = "") -> str:
  """Writes the head `stem` in format `fmt` to the directory `output`; -> the weights file written."""
  stem = stem[:-len(".json")] if stem.endswith(".json") else stem
  stem = stem[:-len(".safetensors")] if stem.endswith(".safetensors") else stem
  meta = _meta(stem)
  check_exportable(meta, fmt, stem)
  if isinstance(vocab.output_rows(target_params), QTensor):  # every format writes the target's output rows
    holder = "the head's lm_head holds" if meta["kind"] == "eagle" else "the Medusa-1 heads carry"
    raise ExportError(f"the target is quantized (--quantize): export from its unquantized weights, whose output "
                      f"rows {holder}")
  _, weights, d2t = head_ckpt.load_heads(stem, target_config, meta["kind"], jnp.float32)
  provenance = {"base_model_name_or_path": target_name or target_config.name,
                "spec_jax_target_fingerprint": head_ckpt.target_fingerprint(target_config)}
  if tokenizer is not None:
    provenance["spec_jax_vocab_digest"] = tokenizer.vocab_digest()
  if meta["kind"] == "eagle":  # check_exportable let only the published EAGLE-3 layout through
    return export_eagle3.export(meta, weights, d2t, fmt, output, target_config, target_params, stem, provenance)
  rows = vocab.output_rows(target_params)
  w, b = np.asarray(weights["w"], np.float32), np.asarray(weights["b"], np.float32)
  K, D, V = w.shape[0], target_config.d_model, target_config.vocab_size
  rows = np.asarray(rows, np.float32)
  if rows.shape != (V, D):
    raise ExportError(f"the target's output rows have shape {rows.shape}, expected {(V, D)}")
  tensors = {}
  for h in range(K):
    tensors[f"{h}.0.linear.weight"] = w[h].T  # ours [in, out], torch's Linear [out, in]
    tensors[f"{h}.0.linear.bias"] = b[h]
    tensors[f"{h}.1.weight"] = rows
  os.makedirs(output, exist_ok=True)
  path = os.path.join(output, "medusa_lm_head.safetensors")
  safetensors_io.write(path, tensors)
  config = {"medusa_num_heads": K, "medusa_num_layers": 1, "hidden_size": D, "vocab_size": V,
            "spec_jax_exported_from": os.path.basename(stem), **provenance}
  with open(os.path.join(output, "config.json"), "w") as f:
    json.dump(config, f, indent=1, sort_keys=True)
  return path


def main(argv):
  del argv
  F = flags.FLAGS
  try:
    if not F.heads or not F.format or not F.output:
      raise ValueError("--heads, --format and --output are required")
    check_exportable(_meta(F.heads[:-len(".json")] if F.heads.endswith(".json") else F.heads), F.format, F.heads)
    config, params, tokenizer = load_model(F.model or None, "float32")
    path = export(F.heads, F.format, F.output, config, params, tokenizer, target_name=F.model or "")
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  method = "eagle3" if F.format in EAGLE3_FORMATS else F.format
  print(f"wrote {path} and {os.path.join(F.output, 'config.json')}; load it with --speculative_config="
        f"'{{\"method\": \"{method}\", \"model\": \"{F.output}\"}}'")


if __name__ == "__main__":
  flag_table.define(("heads", "format", "output", "model"))
  app.run(main)
