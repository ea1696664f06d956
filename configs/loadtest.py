"""The load matrix on Gemma 3 270M (python -m serve.loadtest --config=configs/loadtest.py), sized for the 2-core CPU
machine: 4 slots, the baseline (run first and last) against ngram k = 2 and 4 and EAGLE k = 2, greedy and sampled
Spec-Bench traffic, closed loop at 1, 2, 4 (peak = slots) and 8 (2x overload) clients plus Poisson arrivals, then
a rerun with the tuned config. About 75 minutes (each point is bounded by max_seconds_per_point + drain_seconds);
the machine must be otherwise quiet. More arms: --config.arms='(...)' (ngram k = 6, eagle k = 4, medusa, draft)."""

import ml_collections

SLOTS = 4


def get_config():
  c = ml_collections.ConfigDict()
  # "" = a fresh folder under the working directory; the committed report:
  #   --output_dir=benchmarks/reports/gemma3_270m
  c.output_dir = ""
  # Every arm runs `python -m serve.server` with these flags plus its own --speculative_config (nothing else).
  c.server = ml_collections.ConfigDict({
      "flags": {"config": "configs/gemma3_270m.py", "dtype": "bfloat16", "max_num_seqs": SLOTS, "max_queue": 64},
      "startup_timeout": 900.0, "stop_grace": 60.0, "env": {}})  # env: extra environment for the server
  c.url = ""  # non-empty: target this server for every arm instead of starting one
  c.model_name = "gemma-3-270m"
  c.api_key = ""
  c.slots = SLOTS  # peak concurrency = the server's decode slots
  c.baseline = {"name": "baseline", "speculative_config": {}}
  c.baseline_repeats = 2  # first and last: the repeat-to-repeat noise the verdict uses
  c.arms = (  # tuples, so that --config.arms='(...)' can override them
      {"name": "ngram_k2", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
      {"name": "ngram_k4", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
      {"name": "eagle_k2", "speculative_config": {"method": "eagle", "num_speculative_tokens": 2}},
  )
  # Traffic: identical for every arm.
  c.prompts = "data/specbench/spec_bench_question.jsonl"  # relative paths resolve from the repository root
  c.prompt_limit = 0
  c.prompt_split = ""  # "even" / "odd": half the file in blocks of len(output_lengths) prompts (tuning, held apart)
  c.categories = ()
  c.output_lengths = (32, 64)  # max_tokens; prompt i of the file gets output_lengths[i % 2] (the output segment)
  c.prompt_len_edges = (64, 256)  # prompt-length segments: < 64, 64-255, >= 256 tokens
  c.samplings = ({"name": "greedy", "temperature": 0.0, "top_p": 1.0},
                 {"name": "sampled", "temperature": 0.7, "top_p": 0.9})
  c.seed = 0
  # Load points: closed loop at 1, slots/2, slots (peak) and overload_factor x slots, then Poisson arrivals.
  c.closed_levels = ()  # () = (1, slots/2, slots, 2 x slots)
  c.overload_factor = 2.0
  c.open_rates = (0.15,)  # requests/s: about half of what the baseline completes at peak on this machine
  c.requests_per_point = 12
  c.requests_per_client = 2  # closed loop: at least this many requests per client
  c.max_seconds_per_point = 45.0  # stop issuing after this ...
  c.drain_seconds = 30.0  # ... and cut what is still running after this
  c.warmup_requests = 4  # per sampling setting, at peak concurrency, before the first point (not measured)
  c.request_timeout = 300.0
  c.sample_interval = 0.5
  c.min_segment_requests = 4
  # The tuner's floor: a cell counts toward the segment policy with at least this many completed requests (in the arm
  # and every baseline repeat); thinner cells fall back to the coarser segment. 0 = guardrails["min_requests"].
  c.tuner_min_requests = 0
  c.verify_tuned = True  # rerun with the tuned policy and check it is never below the baseline, per point and segment
  # Guardrails, fixed before the run (serve/loadtest/verdict.py).
  c.guardrails = {
      "itl_p95_max_ratio": 1.0,  # p95 ITL no worse than the baseline's (beyond the noise)
      "peak_req_s_min_ratio": 0.97,  # completed req/s at peak and overload >= 97 % of the baseline's
      "max_extra_failure_rate": 0.0,  # errors, timeouts and 429s no higher than the baseline's
      "acceptance_floor": 0.1,  # acceptance rate (accepted / drafted tokens) floor
      "noise_floor": 0.03, "noise_multiplier": 2.0,  # a difference counts beyond max(3 %, 2 x measured noise)
      "min_requests": 4,  # fewer completed requests in a cell: neutral
      "improve_metrics": ("tpot_mean", "e2e_p50", "output_tok_s"),
      "throughput_tags": ("peak", "overload"),
  }
  return c
