"""A ~5 minute load matrix on Gemma 3 270M: baseline twice against ngram k = 4, greedy only, closed loop at 1 and
4 clients (peak = 4 slots) and 8 (overload), short outputs. Checks the tool end to end on the real model:
  python -m serve.loadtest --config=configs/loadtest_smoke.py"""

from configs import loadtest


def get_config():
  c = loadtest.get_config()
  c.output_dir = ""  # a fresh loadtest_<date>_<time>/ under the working directory (or --output_dir)
  c.slots = 4
  c.server.flags.max_num_seqs = 4
  c.server.startup_timeout = 600.0
  c.arms = ({"name": "ngram_k4", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                        "prompt_lookup_min": 1, "prompt_lookup_max": 3}},)
  c.samplings = ({"name": "greedy", "temperature": 0.0, "top_p": 1.0},)
  c.closed_levels = (1, 4, 8)
  c.open_rates = ()
  c.output_lengths = (32, 64)
  c.requests_per_point = 8
  c.requests_per_client = 2
  c.max_seconds_per_point = 25.0
  c.drain_seconds = 20.0
  c.warmup_requests = 8
  c.verify_tuned = False
  return c
