"""Why an int8 cache stores K over its channel gain: logits of real Gemma 3 270M through 8-bit K/V schemes, against auto.

  python benchmarks/probes/kv_key_smoothing.py [--prompts=16] [--json_out=PATH]

Each scheme runs the prompts (kv_quant.py's: held-out prompts, then Spec-Bench's) through the decode path in chunks
of 16 tokens on an `auto` cache whose new K and V are replaced, where the layer makes them, by what the scheme would
read back (a per-token scheme depends on the token alone, so this is what its cache would return: the row
"int8 per token" equals the real int8 cache of the commit before smoothing, KL for KL). Schemes (all per token and
KV head):
  int8 per token       - one scale per vector (the int8 cache before smoothing);
  int8 K|V only        - that, on K or on V alone (which one the error comes from);
  int8 groups of G     - one scale per G channels (llama.cpp's q8_0 uses 32): G/ D more scales to store;
  int8 smoothed (rms)  - K over its fixed channel gain (cache.key_channel_gain: the k-norm weight, each RoPE pair at
                         the RMS of its two gains), the query times it: q.k unchanged, no scale added;
  int8 smoothed (max)  - the same with each pair at the larger gain;
  fp8 per token, fp8 smoothed (rms) - e4m3, whose relative grid should not care.
And the real caches: `int8` and `fp8` as spec_jax stores them now.
Reports KL(p_auto || p_scheme) mean and p99 and top-1 agreement over every position.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_quant  # noqa: E402  (its prompts and chunked scoring)

import spec_jax.models.transformer as tfm  # noqa: E402
from spec_jax.cache import dequantize, key_channel_gain, quantize  # noqa: E402
from spec_jax.checkpoints.load import load_model  # noqa: E402

_SCHEME = {"now": None}
_layer_qkv = tfm.layer_qkv


def _fake(x, dtype, group):
  """x [..., D] read back from `dtype` with one absmax scale per `group` channels (None: x as it is): the cache's
  own quantizer over groups."""
  if group is None:
    return x
  *lead, d = x.shape
  g = x.reshape(*lead, d // group, group)
  return dequantize(*quantize(g, dtype), x.dtype).reshape(x.shape)


def _schemed_qkv(c, x, p, positions, base, attn_input=None):
  q, k, v = _layer_qkv(c, x, p, positions, base, attn_input)
  if _SCHEME["now"] is None:
    return q, k, v
  dtype, k_group, v_group, pairing = _SCHEME["now"]
  if pairing:
    g = jnp.abs(p["k_norm"].astype(jnp.float32))
    half = g.shape[-1] // 2
    if pairing == "rms":
      gain = key_channel_gain(p["k_norm"])
    else:
      pair = jnp.maximum(g[:half], g[half:])
      pair = jnp.where(pair > 0, pair, 1.0)
      gain = jnp.concatenate([pair, pair])
    q, k = (q.astype(jnp.float32) * gain).astype(q.dtype), (k.astype(jnp.float32) / gain).astype(k.dtype)
  return q, _fake(k, dtype, k_group), _fake(v, dtype, v_group)


def schemes(d: int) -> dict:
  i8, e4 = jnp.int8, jnp.float8_e4m3fn
  return {"int8 per token": (i8, d, d, None), "int8 K only": (i8, d, None, None), "int8 V only": (i8, None, d, None),
          "int8 groups of 128": (i8, 128, 128, None), "int8 groups of 64": (i8, 64, 64, None),
          "int8 groups of 32": (i8, 32, 32, None), "int8 smoothed (rms)": (i8, d, d, "rms"),
          "int8 smoothed (max)": (i8, d, d, "max"), "fp8 per token": (e4, d, d, None),
          "fp8 smoothed (rms)": (e4, d, d, "rms"), "real int8 cache": "int8", "real fp8 cache": "fp8"}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--json_out", default="")
  args = ap.parse_args()
  config, params, tok = load_model(None, "float32")
  if not config.qk_norm:
    raise SystemExit("the smoothed schemes read the k-norm weight: run on a qk-norm model (Gemma 3)")
  ids_all = kv_quant.prompts(tok, args.prompts)
  cap = max(len(i) for i in ids_all) + kv_quant.BS
  tfm.layer_qkv = _schemed_qkv
  ref = [kv_quant.scored(params, config, ids, "auto", cap)[0] for ids in ids_all]
  out = {"prompts": len(ids_all), "tokens": sum(len(i) for i in ids_all), "head_dim": config.head_dim, "schemes": {}}
  print(f"{len(ids_all)} prompts ({out['tokens']} tokens), Gemma 3 270M float32, head_dim {config.head_dim}")
  print(f"{'scheme':22} {'KL mean':>9} {'KL p99':>9} {'top-1':>7}")
  for name, s in schemes(config.head_dim).items():
    _SCHEME["now"] = None if isinstance(s, str) else s
    jax.clear_caches()  # the scheme is read at trace time
    kls, top1 = [], []
    for ids, r in zip(ids_all, ref):
      got = kv_quant.scored(params, config, ids, s if isinstance(s, str) else "auto", cap)[0]
      a, b = jax.nn.log_softmax(r, -1), jax.nn.log_softmax(got, -1)
      kls.append(np.asarray((np.exp(a) * (a - b)).sum(-1)))
      top1.append(np.asarray(r.argmax(-1) == got.argmax(-1)))
    kl, t1 = np.concatenate(kls), np.concatenate(top1)
    out["schemes"][name] = {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
                            "top1": float(t1.mean())}
    print(f"{name:22} {kl.mean():9.5f} {np.percentile(kl, 99):9.5f} {t1.mean():7.4f}", flush=True)
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
