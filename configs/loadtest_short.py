"""A ~30 minute load matrix on Gemma 3 270M for one quiet sitting: the baseline (first and last) against ngram
k = 4, greedy and sampled Spec-Bench traffic, closed loop at 1, 2, 4 (peak = 4 slots) and 8 (2x overload)
clients, then a rerun with the tuned config. The committed matrix (more arms, Poisson arrivals, more requests
per point) is configs/loadtest.py (about 75 minutes).
  python -m serve.loadtest --config=configs/loadtest_short.py"""

from configs import loadtest


def get_config():
  c = loadtest.get_config()
  c.arms = ({"name": "ngram_k4", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                        "prompt_lookup_min": 1, "prompt_lookup_max": 3}},)
  c.open_rates = ()
  c.requests_per_point = 8
  c.requests_per_client = 2
  c.max_seconds_per_point = 30.0
  c.drain_seconds = 25.0
  c.warmup_requests = 8
  return c
