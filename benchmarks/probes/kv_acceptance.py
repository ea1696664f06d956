"""n-gram acceptance with an 8-bit KV cache, paired on the same texts: what the cache itself does to τ.

  python benchmarks/probes/kv_acceptance.py [--prompts=64] [--temperature=0.7] [--new_tokens=64] [--k=4]
      [--dtypes=int8,fp8,int8_per_token] [--seed=0] [--json_out=PATH]

`serve.check_pair` measures τ by generating twice, once per cache: at T > 0 the two texts part at the first token
that differs and each then meets its own n-gram matches, so a 64-prompt draw moves τ by ~3 % on `auto` alone and
the cache's effect (issue 46's target: within 2 %) hides in that noise. Here the text is held fixed. `auto` writes
each prompt's continuation (sampled at --temperature with a seeded generator, or greedy at 0); at every position t of
it the n-gram proposer (`ngram_draft`, k drafts from the text so far) drafts d_1..d_k, and each cache's target
verifies them in one forward of [x_{t-1}, d_1..d_k] over its cache of x_{<t-1}, as a verify step does. The step's
expected tokens are 1 + sum_j prod_{i<=j} a_i, with a_i = p_i(d_i) under the temperature (rejection sampling
against a one-hot draft; greedy: a_i = 1 when d_i is the argmax) and a_i = 0 past a short draft. Averaged over
positions: each dtype's expected τ on the same contexts; the per-prompt differences against `auto` give the
change's standard error.

Dtypes: any --kv_cache_dtype, and `int8_per_token`: int8 without the K smoothing (cache.key_channel_gain), K and V
read back per token on an `auto` cache (kv_key_smoothing.py's simulation, equal to the real cache before it).
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
import kv_key_smoothing  # noqa: E402  (the per-token int8 simulation)

import spec_jax.models.transformer as tfm  # noqa: E402
from spec_jax.cache import KVCache  # noqa: E402
from spec_jax.checkpoints.load import load_model  # noqa: E402
from spec_jax.models.transformer import forward  # noqa: E402
from spec_jax.proposers.ngram_lookup import NO_TOKEN, ngram_draft  # noqa: E402

CHUNK = 16
MAX_PROMPT = 448


@jax.jit
def _advance(cache, n):
  return cache.advance(jnp.full((1,), n, jnp.int32))


def _fwd(config):
  @jax.jit
  def step(params, tokens, positions, cache):
    logits, _, cache = forward(params, tokens, positions, cache, config=config)
    return logits[0], cache
  return step


def run_prompt(params, config, step, ids, kv, text, k, temperature, new_tokens, rng, cap):
  """-> (the continuation, expected tokens per step [new_tokens], first-draft acceptance [new_tokens]) of one
  prompt on a `kv` cache. `text` None: this run writes the continuation (auto); else it follows `text`."""
  cache = KVCache.init(config, 1, cap, jnp.float32, kv_dtype="auto" if kv == "int8_per_token" else kv)
  seq = list(ids)
  for at in range(0, len(ids) - 1, CHUNK):  # the prompt but its last token
    tok = ids[at:min(at + CHUNK, len(ids) - 1)]
    pad = tok + [0] * (CHUNK - len(tok))
    _, cache = step(params, jnp.asarray([pad], jnp.int32), jnp.arange(at, at + CHUNK, dtype=jnp.int32)[None], cache)
    cache = _advance(cache, len(tok))
  out, expect, first = [], [], []
  for t in range(len(ids), len(ids) + new_tokens):
    draft = np.asarray(ngram_draft(np.asarray([seq], np.int32), np.asarray([t], np.int32), k=k, ngram_min=1,
                                   ngram_max=3))[0]
    feed = [seq[t - 1]] + [int(d) if d != NO_TOKEN else 0 for d in draft]
    logits, cache = step(params, jnp.asarray([feed], jnp.int32),
                         jnp.arange(t - 1, t + k, dtype=jnp.int32)[None], cache)
    logits = np.asarray(logits, np.float64)  # row i: the distribution after x_{<t}, d_1..d_i
    if temperature > 0:
      z = logits / temperature
      p = np.exp(z - z.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      acc = [p[i, d] if d != NO_TOKEN else 0.0 for i, d in enumerate(draft)]
    else:
      acc = [float(d != NO_TOKEN and logits[i].argmax() == d) for i, d in enumerate(draft)]
    expect.append(1.0 + float(np.sum(np.cumprod(acc))))
    first.append(float(acc[0]))
    if text is None:
      nxt = int(rng.choice(p.shape[-1], p=p[0])) if temperature > 0 else int(logits[0].argmax())
    else:
      nxt = text[len(out)]
    out.append(nxt)
    seq.append(nxt)
    cache = _advance(cache, 1)
  return out, np.asarray(expect), np.asarray(first)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--first", type=int, default=1, help="the first Spec-Bench prompt (1-based)")
  ap.add_argument("--temperature", type=float, default=0.7)
  ap.add_argument("--new_tokens", type=int, default=64)
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--dtypes", default="int8,fp8,int8_per_token")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json_out", default="")
  args = ap.parse_args()
  from serve.jobs.prompts import load_prompts
  from spec_jax.datasets import SPEC_BENCH
  config, params, tok = load_model(None, "float32")
  prompts = load_prompts(SPEC_BENCH, tok)[args.first - 1:args.first - 1 + args.prompts]
  ids_all = [tok.encode(p.text)[-MAX_PROMPT:] for p in prompts]
  cap = max(len(i) for i in ids_all) + args.new_tokens + args.k + CHUNK
  dtypes = ["auto"] + args.dtypes.split(",")
  tfm.layer_qkv = kv_key_smoothing._schemed_qkv  # passes through unless int8_per_token's scheme is set
  steps = {d: _fwd(config) for d in dtypes}  # one trace each, made with its scheme set
  res = {d: {"expect": [], "first": []} for d in dtypes}
  for n, ids in enumerate(ids_all):
    rng = np.random.default_rng([args.seed, n])
    text = None
    for d in dtypes:
      kv_key_smoothing._SCHEME["now"] = (jnp.int8, config.head_dim, config.head_dim, None) \
          if d == "int8_per_token" else None
      out, e, f = run_prompt(params, config, steps[d], ids, d, text, args.k, args.temperature, args.new_tokens, rng,
                             cap)
      text = out if text is None else text
      res[d]["expect"].append(e)
      res[d]["first"].append(f)
    line = " ".join(f"{d} {np.mean(res[d]['expect'][-1]):.3f}" for d in dtypes)
    print(f"prompt {args.first + n}: {line}", flush=True)
  base = np.asarray([e.mean() for e in res["auto"]["expect"]])
  out = {"prompts": len(ids_all), "first": args.first, "temperature": args.temperature, "k": args.k,
         "new_tokens": args.new_tokens, "seed": args.seed, "dtypes": {}}
  print(f"\n{len(ids_all)} prompts from {args.first}, T {args.temperature}, k {args.k}, {args.new_tokens} positions "
        f"each; expected tau on auto's text (paired):")
  print(f"{'dtype':15} {'tau':>6} {'change':>8} {'SE':>6} {'first-draft acceptance':>24}")
  for d in dtypes:
    per = np.asarray([e.mean() for e in res[d]["expect"]])
    tau, tau_auto = float(np.mean(np.concatenate(res[d]["expect"]))), float(np.mean(np.concatenate(
        res["auto"]["expect"])))
    change = tau / tau_auto - 1
    se = float(np.std(per - base, ddof=1) / np.sqrt(len(per)) / tau_auto) if len(per) > 1 else 0.0
    a1 = float(np.mean(np.concatenate(res[d]["first"])))
    out["dtypes"][d] = {"tau": tau, "change": change, "se": se, "first_acceptance": a1,
                        "per_prompt_tau": per.tolist()}
    print(f"{d:15} {tau:6.3f} {change:+8.2%} {se:6.2%} {a1:24.4f}")
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
