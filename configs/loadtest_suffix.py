"""The suffix arm of the load matrix on Gemma 3 270M (issue 30), sized for one quiet sitting on the 2-core CPU
(~15-20 minutes): the baseline (first and last) against prompt-only n-gram k = 4 and suffix k = 4, closed loop at
1 and 4 clients (peak = 4 slots), on three traffic kinds: Spec-Bench as is (greedy), and retries (each prompt
sent 3 times in a row, greedy and T 0.7, each send with its own seed). The suffix arm drafts from what earlier
requests wrote (one tenant: the matrix sends no tenant); n-gram from the row's own prompt and output only.
  python -m serve.loadtest --config=configs/loadtest_suffix.py
The committed matrix with the other methods is configs/loadtest.py."""

from configs import loadtest


def get_config():
  c = loadtest.get_config()
  # "" = a fresh folder under the working directory; the committed report:
  #   --output_dir=benchmarks/reports/gemma3_270m_suffix
  c.output_dir = ""
  c.arms = (
      {"name": "ngram_k4", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
      # spec factor 4: all k = 4 drafts on a one-token match, as n-gram drafts (benchmarks/suffix.py: factor 1,
      # vLLM's default, drafts too little on this model's short matches)
      {"name": "suffix_k4", "speculative_config": {"method": "suffix", "num_speculative_tokens": 4,
                                                   "suffix_decoding_max_spec_factor": 4.0}},
  )
  c.samplings = ({"name": "greedy", "temperature": 0.0, "top_p": 1.0},
                 {"name": "retries", "temperature": 0.0, "top_p": 1.0, "repeats": 3},
                 {"name": "retries_t07", "temperature": 0.7, "top_p": 0.9, "repeats": 3})
  c.closed_levels = (1, 4)
  c.open_rates = ()
  c.prompt_split = "odd"  # the held-apart half; nothing here was tuned on it
  c.requests_per_point = 6
  c.requests_per_client = 1
  c.max_seconds_per_point = 30.0
  c.drain_seconds = 20.0
  c.warmup_requests = 4
  c.verify_tuned = False
  return c
