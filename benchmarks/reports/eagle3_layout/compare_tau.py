import sys, os
sys.path.insert(0, os.getcwd())
from configs.train_eagle3_gemma3_270m import get_config
from train.main import load_target
from spec_jax.batch import generate
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.spec_config import SpecConfig
c = get_config()
config, params, tok = load_target(c)
target = Target(config, params)
texts = ("Write a Python function that reverses a string.", "Explain why the sky is blue in two sentences.",
         "List three uses of a hash map.")
for chat in (False, True):
  prompts = [tok.encode(tok.apply_chat_template([t])) if chat else tok.encode(t) for t in texts]
  for name in ("heads/eagle3_gemma3_270m", "/tmp/h28b/eagle3L360_gemma3_270m", "/tmp/h28b/export360_speculators"):
    p, pp = build_proposer(SpecConfig("eagle3", 3, model=name), target)
    r = generate(params, config, prompts, max_new_tokens=32, proposer=p, proposer_params=pp, adaptive_k=False)
    print("chat" if chat else "raw", name, round(r.stats["mean_acceptance_length"], 3),
          [round(x, 3) for x in r.stats["per_position_acceptance"]], flush=True)
