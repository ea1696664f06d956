"""Short Gemma 3 270M head in the published EAGLE-3 layout: train, export (eagle3, speculators), load back, tau."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
from configs.train_eagle3_gemma3_270m import get_config
from train.main import run, load_target
from train import export
from spec_jax.batch import generate
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.spec_config import SpecConfig

steps = int(sys.argv[1])
c = get_config()
c.head_layout, c.reg_weight, c.ttt_passes = "eagle3", 0.0, 2
c.train.steps, c.train.eval_every, c.train.save_every, c.train.eval_batches = steps, steps, steps, 4
c.train.workdir, c.cache_dir = f"/tmp/h28b/work{steps}", "/tmp/h28b/cache"
c.train.cache_features = False
c.export = f"/tmp/h28b/eagle3L{steps}_gemma3_270m"
t0 = time.time()
_, ev = run(c, log=lambda s: print(s, flush=True))
print("train_s", round(time.time() - t0), "eval", json.dumps(ev), flush=True)
config, params, tok = load_target(c)
target = Target(config, params)
prompts = [tok.encode(t) for t in ("Write a Python function that reverses a string.",
                                   "Explain why the sky is blue in two sentences.",
                                   "List three uses of a hash map.")]
res = {}
ours, ours_p = build_proposer(SpecConfig("eagle3", 3, model=c.export), target)
r = generate(params, config, prompts, max_new_tokens=32, proposer=ours, proposer_params=ours_p, adaptive_k=False)
plain = generate(params, config, prompts, max_new_tokens=32)
res["trained"] = (r.stats["mean_acceptance_length"], r.stats["per_position_acceptance"])
print("greedy==plain", r.token_ids == plain.token_ids, flush=True)
for fmt in ("eagle3", "speculators"):
  out = f"/tmp/h28b/export{steps}_{fmt}"
  export.export(c.export, fmt, out, config, params, tok, target_name="google/gemma-3-270m-it")
  back, back_p = build_proposer(SpecConfig("eagle3", 3, model=out), target)
  r2 = generate(params, config, prompts, max_new_tokens=32, proposer=back, proposer_params=back_p, adaptive_k=False)
  res[fmt] = (r2.stats["mean_acceptance_length"], r2.stats["per_position_acceptance"])
  print(fmt, "tokens identical", r2.token_ids == r.token_ids, "tau", res[fmt], "vs", res["trained"], flush=True)
print("sizes", {f: os.path.getsize(f) for f in (c.export + ".safetensors",)}, flush=True)
print("total_s", round(time.time() - t0), flush=True)
