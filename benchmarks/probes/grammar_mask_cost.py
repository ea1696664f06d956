"""What does the grammar mask cost a decode step? Gemma 3 270M, batch 1, float32, one JSON-extraction prompt:
plain decoding without grammar rows, with an unconstrained grammar row (state -1: the lax.cond skips the mask),
and constrained by a schema; then n-gram k = 4 constrained (forced drafts on). Arms interleaved, 2 repeats; time
per loop step (wall / steps, prefill included).

  .venv/bin/python -m benchmarks.probes.grammar_mask_cost
"""
import time

from spec_jax.batch import generate
from spec_jax.checkpoints.load import load_model
from spec_jax.controls import Controls
from spec_jax.grammar import automaton, formats
from spec_jax.grammar.rows import GrammarRows
from spec_jax.proposers.ngram import NgramProposer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                           "city": {"type": "string", "maxLength": 20}},
          "required": ["name", "age", "city"]}


def main():
  config, params, tok = load_model(None, "float32")
  t = time.time()
  auto = automaton.Compiler(tok, config.eos_ids).regex(formats.json_schema_regex(SCHEMA))
  print(f"compile {time.time() - t:.1f} s: {auto.num_states} states x {auto.num_classes} classes")
  prompt = [tok.encode(tok.apply_chat_template(["Alice is 31 and lives in Lyon. Give name, age, city as JSON."]))]
  arms = {"free": Controls.make(1),
          "rows_unconstrained": Controls.make(1).replace(grammar=GrammarRows.make(
              [None], config.vocab_size, (auto.num_states, auto.num_classes))),
          "constrained": Controls.make(1).replace(grammar=GrammarRows.make([auto], config.vocab_size))}
  runs = [(name, c, None) for name, c in arms.items()]
  runs.append(("constrained_ngram4", arms["constrained"], NgramProposer(k=4)))
  for name, c, prop in runs:  # compile
    generate(params, config, prompt, max_new_tokens=8, controls=c,
             **({"proposer": prop, "adaptive_k": False} if prop else {}))
  for rep in range(2):
    for name, c, prop in runs:
      t = time.perf_counter()
      r = generate(params, config, prompt, max_new_tokens=48, controls=c,
                   **({"proposer": prop, "adaptive_k": False} if prop else {}))
      dt = time.perf_counter() - t
      print(f"rep {rep} {name:20s} steps {r.steps:3d} tokens {len(r.token_ids[0]):3d} ms/step {1e3 * dt / r.steps:.1f}"
            f" tok/s {len(r.token_ids[0]) / dt:.1f} text {tok.decode(r.token_ids[0])[:60]!r}")


if __name__ == "__main__":
  main()
