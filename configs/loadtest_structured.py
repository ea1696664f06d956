"""The load matrix with a `structured` segment (issue 36) on Gemma 3 270M: half the traffic is the JSON-extraction
workload (data/structured/extraction.jsonl, written by benchmarks/structured_workload.py: chat requests with
response_format json_schema), half Spec-Bench's first 48 questions; the baseline against ngram k = 4 (forced
drafts on, as always in the server) and grammar-forced drafts alone (method "grammar", loaded with --plugins),
greedy and sampled, closed loop at 1, 2 and 4 (= slots) clients. The "structured" cell sits in every per-segment
table beside the categories, and the tuner gives structured requests rules of their own (the server tags a request
with a grammar "structured"). About 40 minutes on the 2-core CPU machine:

  python -m serve.loadtest --config=configs/loadtest_structured.py"""

from configs import loadtest


def get_config():
  c = loadtest.get_config()
  # "" = a fresh folder under the working directory; the committed report:
  #   --output_dir=benchmarks/reports/structured/loadtest
  c.output_dir = ""
  c.server.flags["plugins"] = "spec_jax.proposers.grammar_only"
  c.prompts = "data/structured/extraction.jsonl,data/specbench/spec_bench_question.jsonl"  # read in turn
  c.prompt_limit = 96  # the 48 structured prompts first, then Spec-Bench's first 48
  c.output_lengths = (64, 96)  # an extraction answer is ~50 tokens
  c.arms = (
      {"name": "ngram_k4", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
      {"name": "grammar_k4", "speculative_config": {"method": "grammar", "num_speculative_tokens": 4}},
  )
  c.closed_levels = (1, 2, 4)
  c.open_rates = ()
  c.requests_per_point = 16
  return c
