"""Speculation per traffic segment on Gemma 3 270M (issue 29), sized for the 2-core CPU machine: the load matrix
on one half of the Spec-Bench questions (the tuning split: blocks 0, 2, 4, ... of two consecutive questions, so both
output budgets are in it), whose per-segment verdicts the tuner turns into a policy, then the same traffic on the
other half (held apart) with that policy as the tuned arm, checked per segment against its own baselines:

  python -m serve.loadtest --config=configs/loadtest_segments.py                       # ~15 min
  python -m serve.loadtest --config=configs/loadtest_segments.py --config.prompt_split=odd \\
      --config.output_dir=benchmarks/reports/gemma3_270m_segments/heldout \\
      --config.arms='({"name": "tuned", "speculative_config": {}, "speculative_config_path":
                       "benchmarks/reports/gemma3_270m_segments/speculative_config.json", "baseline": False},)'
  python -m serve.loadtest.steady --config=configs/loadtest_segments.py --config.prompt_split=odd \\
      --output_dir=benchmarks/reports/gemma3_270m_segments --steady_seconds=600 \\
      --switchback='{"window_s": 5, "off_share": 0.25}'                               # ~12 min

Closed loop at 1, 2 and 4 (= slots) clients, greedy and sampled, budgets 32/64; no overload or Poisson points
(the per-segment question, not the capacity one: configs/loadtest.py has those)."""

from configs import loadtest


def get_config():
  c = loadtest.get_config()
  # "" = a fresh folder under the working directory; the committed report:
  #   --output_dir=benchmarks/reports/gemma3_270m_segments
  c.output_dir = ""
  c.prompt_split = "even"
  c.arms = (
      {"name": "ngram_k2", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
      {"name": "ngram_k4", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
  )
  c.closed_levels = (1, 2, 4)
  c.open_rates = ()
  c.requests_per_point = 12
  c.verify_tuned = False  # the held-apart rerun (above) is the check
  return c
