"""The 8-bit KV cache's scale scheme: reconstruction error of real Gemma 3 270M K/V, and its logits against auto.

  python benchmarks/probes/kv_quant.py [--prompts=4] [--dtype=float32] [--dtypes=fp8_e4m3,int8] [--json_out=PATH]

K/V: each prompt (the training pipeline's held-out prompts, then Spec-Bench's first) runs through the model with a
full-precision cache; every layer's K and V are then stored and read back under each scheme, in the order a
server writes them: the first half of the prompt in one call (a prefill), the rest one token per call (decode
appending to half-full pages of 16 tokens). Schemes, one scale per KV head and:
  token     - per token (what spec_jax/cache.py does: a token's scale is its own, so appends need nothing);
  page      - per page, over the page's final contents (the ideal per-page scale: every page written at once);
  page@1st  - per page, fixed at the page's first write, later tokens clipped to it;
  page-max  - per page, a running max: a token past the scale raises it and the page is requantized;
  none      - a scale of 1 (what a reader that ignores the scales computes).
Error: relative RMS error (||x - x'|| / ||x||) and the largest error relative to its vector's largest magnitude,
averaged over layers and prompts, for K and V. Bytes: what the scales add per value (float32).

Logits: the prompt scored through the decode path (kernels, paging, the new tokens' quantized view) in chunks of
16 tokens, each chunk reading the earlier ones from the cache: KL(p_auto || p_8bit) per position (mean, p99) and
top-1 agreement, for each --kv_cache_dtype.

Greedy (--greedy_tokens N, 0 skips it): N new tokens of plain greedy decoding per prompt with each dtype against
`auto`: the prompts whose N tokens are identical, and the mean length of the common prefix.

Margins (--margins: greedy only, then margins()): where a prompt's greedy text parts from `auto`, auto's top-1 minus
top-2 logit at that token, beside how much the 8-bit cache moves that gap at every generated token (is the parting
a near-tie that the quantization's logit error tips over?).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.cache import KV_CACHE_DTYPES, KVCache
from spec_jax.checkpoints.load import load_model
from spec_jax.models.transformer import forward

BS = 16
DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")


def prompts(tok, n):
  from serve.jobs.prompts import load_prompts
  from spec_jax.datasets import SPEC_BENCH
  from train.eval_acceptance import held_out_prompts
  held = [tok.encode(t) for t in held_out_prompts(max(1, n // 2), 0)]
  bench = [tok.encode(p.text) for p in load_prompts(SPEC_BENCH, tok)[:n - len(held)]] if n > len(held) else []
  return [p[:512] for p in held + bench]


@functools.partial(jax.jit, static_argnames=("config",))
def _step(params, tokens, positions, cache, config):
  logits, _, cache = forward(params, tokens, positions, cache, config=config)
  return logits, cache


def scored(params, config, ids, kv, capacity=0):
  """Logits [T, V] of the prompt `ids` fed in chunks of BS tokens through a `kv` cache; and the cache.
  capacity: the cache's length (0 = T + BS); one fixed capacity compiles the step once for many prompts."""
  T = len(ids)
  cache = KVCache.init(config, 1, capacity or T + BS, params["final_norm"].dtype, kv_dtype=kv)
  out = []
  for at in range(0, T, BS):
    tok = jnp.asarray([ids[at:at + BS]], jnp.int32)
    pos = jnp.arange(at, at + tok.shape[1], dtype=jnp.int32)[None]
    logits, cache = _step(params, tok, pos, cache, config)
    cache = cache.advance(jnp.asarray([tok.shape[1]]))
    out.append(np.asarray(logits[0], np.float32))
  return np.concatenate(out), cache


def kv_of(cache, config, T):
  """-> K, V float32 [L, H, T, D] of the one row."""
  ks, vs = [], []
  for layer in range(config.num_layers):
    k, v = cache.layer_view(jnp.int32(layer))
    ks.append(np.asarray(k[0, :, :T], np.float32))
    vs.append(np.asarray(v[0, :, :T], np.float32))
  return np.stack(ks), np.stack(vs)


def _q(x, scale, dtype):
  """x / scale rounded to dtype's grid (clipped), times scale: what a reader gets back."""
  dtype = jnp.dtype(dtype)
  qmax = float(jnp.iinfo(dtype).max if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).max)
  y = np.clip(x / scale, -qmax, qmax)
  y = np.round(y) if jnp.issubdtype(dtype, jnp.integer) else np.asarray(jnp.asarray(y).astype(dtype), np.float32)
  return y * scale, qmax


def qmax_of(dtype):
  return _q(np.zeros(1, np.float32), 1.0, dtype)[1]


def scheme(x, dtype, name, prefill):
  """x [H, T, D] stored under `name` with the first `prefill` tokens in one call, the rest one per call."""
  qmax = qmax_of(dtype)
  H, T, D = x.shape
  amax_tok = np.abs(x).max(-1, keepdims=True)  # [H, T, 1]
  if name == "token":
    return _q(x, np.where(amax_tok > 0, amax_tok / qmax, 1.0), dtype)[0]
  if name == "none":
    return _q(x, 1.0, dtype)[0]
  out = np.zeros_like(x)
  for p0 in range(0, T, BS):
    page = x[:, p0:p0 + BS]
    if name == "page":
      a = np.abs(page).max((1, 2), keepdims=True)
      out[:, p0:p0 + BS] = _q(page, np.where(a > 0, a / qmax, 1.0), dtype)[0]
      continue
    # the page's writes: its tokens of the prefill at once, then one at a time
    first = min(max(prefill - p0, 1), page.shape[1])
    calls = [(0, first)] + [(t, t + 1) for t in range(first, page.shape[1])]
    stored, scale = np.zeros_like(page), None
    for a0, a1 in calls:
      new = page[:, a0:a1]
      need = np.maximum(np.abs(new).max((1, 2), keepdims=True) / qmax, 1e-30)
      if scale is None:
        scale = need
      elif name == "page-max" and np.any(need > scale):
        grown = np.maximum(scale, need)
        stored[:, :a0] = _q(stored[:, :a0], grown, dtype)[0]  # requantized to the raised scale
        scale = grown
      stored[:, a0:a1] = _q(new, scale, dtype)[0]
    out[:, p0:p0 + BS] = stored
  return out


def errors(x, y):
  rel = float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30))
  amax = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-30)
  return rel, float(np.max(np.abs(x - y) / amax))


def greedy_agreement(params, config, ids_all, n: int) -> tuple[dict, list, dict]:
  """Plain greedy decoding of n tokens per prompt with each 8-bit cache against auto: (summary, auto's tokens,
  each dtype's tokens)."""
  from spec_jax.batch import generate
  ref = generate(params, config, ids_all, max_new_tokens=n, stop_ids=()).token_ids
  out, runs = {}, {}
  print(f"greedy, {n} new tokens: prompts identical to auto, mean common prefix")
  for d in DTYPES:
    got = runs[d] = generate(params, config, ids_all, max_new_tokens=n, stop_ids=(), kv_cache_dtype=d).token_ids
    prefix = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g))) for r, g in zip(ref, got)]
    out[d] = {"identical": sum(r == g for r, g in zip(ref, got)), "prompts": len(ref),
              "mean_common_prefix": float(np.mean(prefix))}
    print(f"  {d:9} {out[d]['identical']}/{len(ref)}  {out[d]['mean_common_prefix']:.1f}")
  return out, ref, runs


def margins(params, config, ids_all, ref, runs) -> dict:
  """Why greedy text parts: at each prompt's first position where a dtype's greedy tokens leave auto's, auto's
  top-1 minus top-2 logit there, beside the cache's logit error. Each prompt plus auto's greedy tokens is scored
  once through auto and once through each 8-bit cache (teacher-forced on auto's text, which the 8-bit run shares up
  to the divergence); the error is the change of the gap between auto's top-1 and top-2 tokens, at every generated
  position (its typical size), and at the divergence (does the scored 8-bit cache pick the 8-bit run's token?)."""
  seqs = [list(p) + list(r) for p, r in zip(ids_all, ref)]
  padded = lambda n: -(-n // BS) * BS
  cap = max(padded(len(s)) for s in seqs) + BS  # one capacity and whole chunks: the step compiles once per dtype
  auto_gap, err, div = [], {d: [] for d in DTYPES}, {d: [] for d in DTYPES}
  for p, (ids, r, s) in enumerate(zip(ids_all, ref, seqs)):
    pad = s + [0] * (padded(len(s)) - len(s))  # causal, per-token scales: the padding changes no earlier position
    la = scored(params, config, pad, "auto", cap)[0][len(ids) - 1:len(s) - 1]  # row i predicts new token i
    rows = np.arange(len(la))
    top1, top2 = np.argsort(-la, -1)[:, :2].T
    gap_a = la[rows, top1] - la[rows, top2]
    auto_gap.append(gap_a)
    for d in DTYPES:
      lq = scored(params, config, pad, d, cap)[0][len(ids) - 1:len(s) - 1]
      gap_q = lq[rows, top1] - lq[rows, top2]
      err[d].append(np.abs(gap_q - gap_a))
      g = runs[d][p]
      i = next((i for i, (x, y) in enumerate(zip(r, g)) if x != y), None)
      if i is not None:
        div[d].append({"prompt": p, "position": i, "auto_token": int(r[i]), "quant_token": int(g[i]),
                       "auto_margin": float(gap_a[i]), "auto_margin_to_quant_token": float(la[i, r[i]] - la[i, g[i]]),
                       "gap_change_here": float(abs(gap_q[i] - gap_a[i])),
                       "scored_quant_picks_it": bool(lq[i].argmax() == g[i])})
  all_gap = np.concatenate(auto_gap)
  pct = lambda x, q: float(np.percentile(x, q))
  out = {"auto_margin_all_positions": {"median": pct(all_gap, 50), "p10": pct(all_gap, 10), "p1": pct(all_gap, 1),
                                       "n": int(all_gap.size)}}
  print(f"auto's top-1 minus top-2 logit over all {all_gap.size} greedy positions: median {pct(all_gap, 50):.3f}, "
        f"p10 {pct(all_gap, 10):.3f}, p1 {pct(all_gap, 1):.3f}")
  for d in DTYPES:
    e = np.concatenate(err[d])
    for f in div[d]:
      f["auto_margin_percentile"] = float(np.mean(all_gap < f["auto_margin"]) * 100)
    out[d] = {"gap_change_all_positions": {"median": pct(e, 50), "p90": pct(e, 90), "p99": pct(e, 99),
                                           "max": float(e.max())}, "diverging": div[d]}
    print(f"  {d:9} |gap change| over all positions: median {pct(e, 50):.3f}, p90 {pct(e, 90):.3f}, "
          f"p99 {pct(e, 99):.3f}; {len(div[d])} prompts part from auto:")
    for f in div[d]:
      print(f"    prompt {f['prompt']:2} at token {f['position']:2}: auto's margin {f['auto_margin']:.3f} "
            f"(percentile {f['auto_margin_percentile']:.1f}; to the 8-bit token {f['auto_margin_to_quant_token']:.3f}), "
            f"gap change there {f['gap_change_here']:.3f}, scored 8-bit picks it: {f['scored_quant_picks_it']}")
  return out


def main():
  global DTYPES  # --dtypes narrows the module's list, which the helpers read
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--greedy_tokens", type=int, default=64)
  ap.add_argument("--json_out", default="")
  ap.add_argument("--dtypes", default=",".join(DTYPES), help="the 8-bit dtypes to run (comma-separated)")
  ap.add_argument("--margins", action="store_true", help="only greedy (--greedy_tokens) and, where it parts from "
                  "auto, auto's top-1/top-2 logit margin there against the cache's logit error (margins())")
  args = ap.parse_args()
  DTYPES = tuple(args.dtypes.split(","))
  config, params, tok = load_model(None, args.dtype)
  ids_all = prompts(tok, args.prompts)
  if args.margins:
    out = {"prompts": len(ids_all), "dtype": args.dtype, "greedy_tokens": args.greedy_tokens}
    out["greedy"], ref, runs = greedy_agreement(params, config, ids_all, args.greedy_tokens)
    out["margins"] = margins(params, config, ids_all, ref, runs)
    if args.json_out:
      with open(args.json_out, "w") as f:
        json.dump(out, f, indent=1, default=float)
    return
  schemes = ("token", "page", "page@1st", "page-max", "none")
  recon = {d: {s: {"k": [], "v": []} for s in schemes} for d in DTYPES}
  quality = {d: {"kl": [], "top1": []} for d in DTYPES}
  for ids in ids_all:
    T = len(ids)
    ref_logits, cache = scored(params, config, ids, "auto")
    K, V = kv_of(cache, config, T)
    for d in DTYPES:
      store = KV_CACHE_DTYPES[d]
      for s in schemes:
        for name, X in (("k", K), ("v", V)):
          recon[d][s][name].append(np.mean([errors(X[l], scheme(X[l], store, s, T // 2)) for l in range(len(X))],
                                           axis=0))
      got, _ = scored(params, config, ids, d)
      a = jax.nn.log_softmax(ref_logits, -1)
      q = jax.nn.log_softmax(got, -1)
      quality[d]["kl"].append(np.asarray((np.exp(a) * (a - q)).sum(-1)))
      quality[d]["top1"].append(np.asarray(ref_logits.argmax(-1) == got.argmax(-1)))
  out = {"prompts": len(ids_all), "tokens": [len(i) for i in ids_all], "dtype": args.dtype,
         "scale_bytes_per_value": 4 / config.head_dim, "recon": {}, "logits": {}}
  print(f"{len(ids_all)} prompts ({sum(out['tokens'])} tokens), Gemma 3 270M {args.dtype}, head_dim "
        f"{config.head_dim}: per-token float32 scales add {4 / config.head_dim:.1%} to an 8-bit value's byte")
  print("reconstruction: relative RMS error K / V (largest error / vector max K / V)")
  for d in DTYPES:
    for s in schemes:
      k, v = np.mean(recon[d][s]["k"], axis=0), np.mean(recon[d][s]["v"], axis=0)
      out["recon"][f"{d}/{s}"] = {"k_rel_rms": k[0], "v_rel_rms": v[0], "k_max": k[1], "v_max": v[1]}
      print(f"  {d:9} {s:9} {k[0]:.4f} / {v[0]:.4f}   ({k[1]:.3f} / {v[1]:.3f})")
  print("logits against auto (chunks of 16 through the cache): KL mean, p99, top-1 agreement")
  for d in DTYPES:
    kl, top1 = np.concatenate(quality[d]["kl"]), np.concatenate(quality[d]["top1"])
    out["logits"][d] = {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
                        "top1": float(top1.mean())}
    print(f"  {d:9} {kl.mean():.5f} {np.percentile(kl, 99):.5f} {top1.mean():.4f}")
  if args.greedy_tokens:
    out["greedy"] = greedy_agreement(params, config, ids_all, args.greedy_tokens)[0]
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(out, f, indent=1, default=float)


if __name__ == "__main__":
  main()
