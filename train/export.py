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
- eagle (EAGLE-1/2), eagle3 (SafeAILab / SpecForge) and speculators (vLLM's EAGLE-3): refused for our EAGLE
  heads, whose layer is not the published one. Ours RMS-norms the feature and the embedding, fuses them with its
  FC, and runs a pre-norm decoder layer on the FC's output (normed again, and kept as the residual), then normalizes
  its output (out_norm). EAGLE-1's layer reads the FC's output without a norm; EAGLE-3's attention reads
  [norm(embedding); norm(feature)] directly and keeps the feature as its residual. No weights make one compute
  the other, so a converted file would draft other tokens; the export says so instead of writing it.
The written config.json names the verifier (base_model_name_or_path) and adds `spec_jax_target_fingerprint` and
`spec_jax_vocab_digest`, which the pair check (serve.check_pair) compares with the target at hand.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import app, flags

from spec_jax import flag_table

FORMATS = ("eagle", "eagle3", "medusa", "speculators")
_EAGLE_LAYOUT = ("this project's EAGLE layer is not the published one: it RMS-norms the feature and the embedding "
                 "before its FC, runs a pre-norm decoder layer on the FC's output (kept as the residual) and "
                 "normalizes the layer's output (out_norm); ")
_WHY = {
    "eagle": "EAGLE-1/2's layer reads the FC over the raw [embedding; feature] without any norm",
    "eagle3": "EAGLE-3's attention reads [norm(embedding); norm(feature)] directly and keeps the feature as its "
              "residual",
}


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
  layers = meta.get("feature_layers") or []
  fam = "eagle3" if fmt in ("eagle3", "speculators") else "eagle"
  what = f"EAGLE-3 (feature layers {layers})" if layers else "EAGLE-1"
  raise ExportError(f"{stem}: an {what} head cannot be written as --format={fmt} exactly: " + _EAGLE_LAYOUT +
                    _WHY[fam] + ". A converted file would draft other tokens, so nothing is written")


def export(stem: str, fmt: str, output: str, target_config, target_params, tokenizer=None,
           target_name: str = "") -> str:
  """Writes the head `stem` in format `fmt` to the directory `output`; -> the weights file written."""
  from spec_jax.checkpoints import heads as head_ckpt, safetensors_io
  from spec_jax.proposers import vocab
  from spec_jax.quant import QTensor
  stem = stem[:-len(".json")] if stem.endswith(".json") else stem
  stem = stem[:-len(".safetensors")] if stem.endswith(".safetensors") else stem
  meta = _meta(stem)
  check_exportable(meta, fmt, stem)
  import jax.numpy as jnp
  _, weights, _ = head_ckpt.load_heads(stem, target_config, meta["kind"], jnp.float32)
  rows = vocab.output_rows(target_params)
  if isinstance(rows, QTensor):
    raise ExportError("the target is quantized (--quantize): export from its unquantized weights, whose output "
                      "rows the Medusa-1 heads carry")
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
  config = {
      "medusa_num_heads": K, "medusa_num_layers": 1, "hidden_size": D, "vocab_size": V,
      "base_model_name_or_path": target_name or target_config.name,
      "spec_jax_target_fingerprint": head_ckpt.target_fingerprint(target_config),
      "spec_jax_exported_from": os.path.basename(stem),
  }
  if tokenizer is not None:
    config["spec_jax_vocab_digest"] = tokenizer.vocab_digest()
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
    from spec_jax.checkpoints.load import load_model
    config, params, tokenizer = load_model(F.model or None, "float32")
    path = export(F.heads, F.format, F.output, config, params, tokenizer, target_name=F.model or "")
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"wrote {path} and {os.path.join(F.output, 'config.json')}; load it with --speculative_config="
        f"'{{\"method\": \"{F.format}\", \"model\": \"{F.output}\"}}'")


if __name__ == "__main__":
  flag_table.define(("heads", "format", "output", "model"))
  app.run(main)
