"""The serving benchmark of docs/benchmark-log.md section 7 (issue 9): Gemma 3 270M, 16 slots, the baseline (first and
last) against ngram k = 4, greedy Spec-Bench traffic, closed loop at concurrency 1, 4 and 16.
  python -m serve.loadtest --config=configs/loadtest_server_bench.py"""

from configs import loadtest


def get_config():
  c = loadtest.get_config()
  c.output_dir = ""  # a fresh loadtest_<date>_<time>/ under the working directory (or --output_dir)
  c.slots = 16
  c.server.flags.max_num_seqs = 16
  c.arms = ({"name": "ngram_k4", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                        "prompt_lookup_min": 1, "prompt_lookup_max": 3}},)
  c.samplings = ({"name": "greedy", "temperature": 0.0, "top_p": 1.0},)
  c.closed_levels = (1, 4, 16)
  c.open_rates = ()
  c.output_lengths = (64,)
  c.requests_per_point = 16
  c.requests_per_client = 1
  c.max_seconds_per_point = 45.0
  c.drain_seconds = 30.0
  c.warmup_requests = 8
  c.verify_tuned = False
  return c
