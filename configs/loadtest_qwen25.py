"""A short load matrix for the Qwen2.5-Coder pair (issue 11): the 1.5B-Instruct target served with 4 slots in
float32, the baseline (first and last) against the 0.5B-Instruct draft at k = 4 and n-gram k = 4, greedy
Spec-Bench traffic, closed loop at concurrency 1 and 4 (= slots). About 25 minutes on the 2-core CPU.
  python -m serve.loadtest --config=configs/loadtest_qwen25.py"""

from configs import loadtest

SLOTS = 4


def get_config():
  c = loadtest.get_config()
  # "" = a fresh folder under the working directory; the committed report:
  #   --output_dir=benchmarks/reports/qwen25_coder/loadtest
  c.output_dir = ""
  c.server.flags = {"config": "configs/qwen25_coder_1p5b.py", "dtype": "float32", "max_num_seqs": SLOTS,
                    "max_queue": 64, "max_model_len": 1024}
  c.model_name = "qwen2.5-coder-1.5b-instruct"
  c.slots = SLOTS
  c.arms = (
      {"name": "draft_0p5b_k4", "speculative_config": {"method": "draft_model", "num_speculative_tokens": 4,
                                                       "model": "qwen2.5-coder-0.5b-instruct"}},
      {"name": "ngram_k4", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
  )
  c.samplings = ({"name": "greedy", "temperature": 0.0, "top_p": 1.0},)
  c.closed_levels = (1, SLOTS)
  c.open_rates = ()
  c.output_lengths = (32, 64)
  c.requests_per_point = 8
  c.requests_per_client = 2
  c.max_seconds_per_point = 90.0
  c.drain_seconds = 60.0
  c.warmup_requests = 4
  c.verify_tuned = False  # the short matrix: the tuner's file is written, its rerun is left out (time)
  return c
