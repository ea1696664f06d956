"""Every command-line flag of the serve/ and train/ commands, defined once: one row per name.

A command says which rows it takes (`define(names, **defaults)`); a row's default may be the command's own (distill
runs float32, the AOT check bfloat16). The speculation rows are the speculative config's keys
(spec_jax/spec_config.py), `model` and `quantization` renamed beside the target's `--model` and `--quantize`.
Defining is idempotent, so a process may import several commands (the tests do); the first definer's default wins.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from absl import flags


class Row(NamedTuple):
  kind: str  # string | integer | float | bool | list | enum
  help: str
  default: Any = None
  choices: tuple = ()


# The speculative config's keys -> their flags (the rest keep their names).
SPEC_FLAG_NAMES = {"model": "speculative_model", "quantization": "speculative_quantization"}

ROWS: dict[str, Row] = {
    "config": Row("config", "ml_collections config file: the command's settings (run, load matrix or training)."),
    # --- the target and its run (serve.generate, the server, serve.calibrate, serve.evaluate)
    "plugins": Row("list", "Python modules to import first (e.g. my_pkg.my_proposer): each may register proposers "
                   "with spec_jax.proposers.registry.register, which --method and --speculative_config then name.",
                   []),
    "model": Row("string", "A .gguf file or HF safetensors directory ('' = packaged Gemma 3 270M)."),
    "dtype": Row("enum", "Weights and activations dtype.", None, ("float32", "bfloat16")),
    "attention_impl": Row("enum", "Attention kernel ('' = the platform's).", None,
                          ("", "auto", "xla", "pallas_gpu", "pallas_tpu")),
    "kv_cache_dtype": Row("enum", "Every KV cache (target, draft model, EAGLE layer): 'auto' = the activation dtype; "
                          "fp8 (= fp8_e4m3), fp8_e5m2 or int8 with a float32 scale per token and KV head, half the "
                          "bytes a page (vLLM's flag; the XLA attention only).", "auto",
                          ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")),
    "max_new_tokens": Row("integer", "New tokens per prompt (the server: a request's default max_tokens)."),
    "temperature": Row("float", "0 is greedy (the server: a request's default)."),
    "top_k": Row("integer", "0 is off (the server: a request's default)."),
    "top_p": Row("float", "1 is off (the server: a request's default)."),
    "seed": Row("integer", "Sampling seed (the server: its engine's stream; training data: the prompt order)."),
    "quantize": Row("enum", "Target weights: int8 per output channel, int4 per 32 inputs (spec_jax/quant.py); "
                    "cached beside the checkpoint.", None, ("none", "int8", "int4")),
    "adaptive": Row("bool", "Adapt the number of drafted tokens per step (default on)."),
    "mesh": Row("string", "Device mesh 'data:N,model:M' (spec_jax/sharding.py): rows (a training batch) split over "
                "data, heads/MLP/vocabulary over model. '' = one device."),
    "costs_file": Row("string", "Step costs for the adaptive controller (serve.calibrate or serve.aot --cost_table); "
                      "'' = the default cost model; unset = the config's."),
    "batch_size": Row("integer", "Prompts per batch."),
    "limit": Row("integer", "Use only the first N prompts (0: all)."),
    "output": Row("string", "Where the command writes its result (a file, or the AOT report's directory)."),
    "output_dir": Row("string", "Where the report and raw files go (serve.loadtest: default the config's, else a "
                      "fresh loadtest_<date>_<time>/ under the working directory)."),
    "port_range": Row("string", "serve.loadtest: the ports (LO-HI) the servers it starts may listen on at 127.0.0.1; "
                      "'' = any free port."),
    "steady_seconds": Row("float", "serve.loadtest.steady: how long the steady mixed traffic runs.", 600.0),
    "steady_clients": Row("integer", "serve.loadtest.steady: closed-loop clients of the steady traffic.", 4),
    "repeats": Row("integer", "Run everything this many times (interleaved) and report the spread.", 1),
    "progress": Row("bool", "Progress bar on stderr.", True),
    "methods": Row("list", "Methods to run, each with the other speculative settings (names of "
                   "spec_jax/proposers/registry.py; benchmarks/specbench.py also takes method=checkpoint)."),
    # --- speculation: the speculative config (spec_jax/spec_config.py)
    "speculative_config": Row("string", "vLLM-style JSON, inline or a file: method, num_speculative_tokens, "
                              "prompt_lookup_min/max, model, ..., and a per-request \"policy\" "
                              "(spec_jax/spec_policy.py); or {\"per_concurrency\": {\"1\": {...}, ...}}. '{}' = off. "
                              "Unset: the config file's; the flags below override single keys."),
    "method": Row("string", "Draft source, a name of spec_jax/proposers/registry.py (qdraft: the target's own "
                  "weights quantized to --speculative_quantization; draft_model is vLLM's name of draft)."),
    "num_speculative_tokens": Row("integer", "Tokens drafted per step (the largest k; a tree's depth)."),
    "prompt_lookup_min": Row("integer", "ngram: shortest suffix n-gram to match."),
    "prompt_lookup_max": Row("integer", "ngram: longest suffix n-gram to match."),
    "speculative_model": Row("string", "The speculative config's model: medusa/eagle heads or a distilled draft "
                             "(our checkpoint stem), or an independent draft model with the target's vocabulary "
                             "(.gguf, HF directory or packaged name); '' = the one in heads/."),
    "draft_layers": Row("integer", "method=draft: N > 0 = the early-exit self-draft of the target's first N layers."),
    "eagle_topk": Row("integer", "Token trees: candidates per node (1 = chains)."),
    "num_draft_tokens": Row("integer", "Token trees: node budget, root included (0 = 1 + depth * eagle_topk)."),
    "speculative_quantization": Row("enum", "method=qdraft: the draft's weights.", None, ("int8", "int4")),
    "suffix_decoding_max_tree_depth": Row("integer", "method=suffix: the longest suffix matched."),
    "suffix_decoding_max_spec_factor": Row("float", "method=suffix: tokens drafted per matched token (up to k)."),
    "suffix_history_tokens": Row("integer", "method=suffix: the shared history of committed tokens, per slot."),
    "suffix_sharing": Row("enum", "method=suffix: tenant = a request drafts only from its own tenant's history "
                          "(the API key, then extra_body tenant); global = from every request's, on purpose "
                          "(speed can then show one tenant what another wrote).", None, ("tenant", "global")),
    # --- serving
    "host": Row("string", "Bind address (default 127.0.0.1: loopback only)."),
    "port": Row("integer", "Port (default 8000)."),
    "max_num_seqs": Row("integer", "Decode slots (requests decoded together)."),
    "max_queue": Row("integer", "Requests that may wait beyond the free slots; more get 429."),
    "max_model_len": Row("integer", "Tokens per slot (prompt + output + k + 1)."),
    "steps_per_sync": Row("integer", "Decode steps per engine iteration (between host looks at the state)."),
    "block_size": Row("integer", "The paged KV cache: tokens per page (vLLM's; default 16)."),
    "num_kv_blocks": Row("integer", "The KV pool in pages (vLLM's num_gpu_blocks_override; 0 = enough for "
                         "max_num_seqs requests of max_model_len tokens, the memory of fixed slots)."),
    "kv_cache_memory_bytes": Row("integer", "The KV pool in bytes (vLLM's), turned into pages at the bytes one page "
                                 "holds in every cache (target and proposer); 0 = --num_kv_blocks decides."),
    "enable_prefix_caching": Row("bool", "Reuse the KV pages of a cached prompt prefix (vLLM's; per tenant and "
                                 "cache_salt)."),
    "kv_speculation_yields": Row("bool", "When the KV pool is short, shrink speculation first (one step per call, "
                                 "then no drafts for the segment that gains least) and preempt only if that is not "
                                 "enough; false preempts at once (vLLM's rule, for comparison)."),
    "poison_freed_pages": Row("bool", "Test-only: fill freed KV pages with NaN, so a read of stale K/V shows."),
    "max_logprobs": Row("integer", "The most top logprobs a request may ask for (vLLM's; -1: no logprobs, no "
                        "buffers in the loop)."),
    "logprobs_mode": Row("enum", "What logprobs report (vLLM's): raw_logprobs, the model's own log-softmax; "
                         "processed_logprobs, after the controls, temperature, top-k and top-p "
                         "(spec_jax/logprobs.py).", None, ("raw_logprobs", "processed_logprobs")),
    "timing_probe_s": Row("float", "Every this many seconds while drafting, time one propose() and one step on the "
                          "live batch (the proposer's share of a step in /metrics); 0 = never."),
    "api_key": Row("string", "When set, /v1 and /admin need 'Authorization: Bearer KEY'."),
    "served_model_name": Row("string", "The model id clients send (default: the --model file's or directory's name "
                             "without extension; gemma-3-270m for the packaged model)."),
    "guardrails": Row("string", "Automatic rollback, JSON inline or a file (serve/engine/guardrails.py)."),
    "switchback": Row("string", "The live A/B: short speculation-off windows in a random order, JSON inline or a "
                      "file, e.g. '{\"window_s\": 5, \"off_share\": 0.25}' (serve/engine/live_ab.py); the report is GET "
                      "/admin/speculation/report."),
    "request_timeout_s": Row("float", "A request still unfinished after this long fails with 504."),
    "drain_timeout_s": Row("float", "SIGTERM: how long running and queued requests may take to finish; then each "
                           "ends with a 503 (a stream: an error event and [DONE])."),
    "default_max_tokens": Row("integer", "The output budget of a request without max_tokens: 0 = up to the end of "
                              "the context (OpenAI's and vLLM's); N > 0 caps it at N."),
    "warmup_prompt_lens": Row("list", "Compile insert for these prompt lengths before serving (the server: "
                              "1,17,33)."),
    "extended_warmup": Row("bool", "Before the port opens, send a chat, streamed, completion, n=2, structured-output "
                           "and logprobs request through the app in-process, so their programs are compiled when "
                           "'ready' is logged (default on; false: a faster start, slower first requests)."),
    "grammar_capacity": Row("list", "Structured outputs: the largest grammar automaton a slot holds, as "
                            "STATES,CLASSES (token classes; default 2048,512: 4 MB a slot); empty = none "
                            "(response_format, guided_*, tools with tool_choice required are then a 400)."),
    "log_level": Row("string", "debug, info, warning."),
    "compilation_cache_dir": Row("string", "JAX's persistent compilation cache: a restart loads the compiled "
                                 "programs instead of compiling again ('' = off; default ~/.cache/spec_jax/xla)."),
    # --- serve.generate
    "prompts": Row("string", "JSONL prompts: 'prompt' or 'turns', optional 'id' and 'category'."),
    "summary_json": Row("string", "Write aggregate metrics here."),
    "categories": Row("list", "Keep only prompts of these categories.", []),
    "compare": Row("bool", "Run the baseline and the method on the same prompts, interleaved batch by batch.", False),
    # --- serve.check_pair (and the server's start-up check)
    "strict": Row("bool", "The pair check: a verifier named by the head that is not the loaded target (by name or "
                  "architecture) is an error, not a warning (serve.check_pair; the server refuses to start).", False),
    "check_temperatures": Row("list", "serve.check_pair: the temperatures the pair runs at.", ["0", "0.7"]),
    "cost_reps": Row("integer", "serve.check_pair: timed repeats of one propose and of a step (best kept).", 5),
    # --- train.export
    "heads": Row("string", "train.export: the head checkpoint stem to export (<stem>.json + <stem>.safetensors)."),
    "format": Row("enum", "train.export: the published format to write.", None,
                  ("eagle", "eagle3", "medusa", "speculators")),
    # --- serve.calibrate
    "output_costs": Row("string", "The calibration file to update.", "configs/costs/gemma3_270m_cpu.json"),
    "calibrate_batch": Row("integer", "Rows of the state the costs are for (occupancies 1..batch); serve.generate "
                           "runs a bfloat16 batch of 1 with 2 rows on CPU, the server max_num_seqs rows.", 2),
    "calibrate_reps": Row("integer", "Timed repeats per option (best kept).", 7),
    # --- serve.evaluate (jax.distributed)
    "coordinator_address": Row("string", "HOST:PORT of process 0 (not needed on TPU pods, SLURM or MPI)."),
    "num_processes": Row("integer", "Processes in the run (with --coordinator_address)."),
    "process_id": Row("integer", "This process's index, 0 .. num_processes - 1."),
    "initialization_timeout": Row("integer", "Seconds to wait for every process to join before failing.", 300),
    "heartbeat_timeout": Row("integer", "Seconds without a heartbeat after which a process counts as dead and the "
                             "run fails.", 100),
    # --- serve.aot (compiling for a TPU topology or a GPU, without one)
    "topology": Row("string", "A TPU topology (jax.experimental.topologies: v5e:2x4, v5p:2x2x1) or a GPU target of "
                    "configs/gpu_targets (h200).", "v5e:2x2"),
    "model_shape": Row("string", "A name of spec_jax/models/shapes.py, or a JSON ModelConfig.", "gemma3-270m"),
    "draft_model_shape": Row("string", "method=draft: an independent draft's shape ('' = the 2-layer distilled "
                             "draft this project trains).", ""),
    "insert_buckets": Row("list", "Prompt buckets to compile slot insert at.", ["16", "512"]),
    "train_kinds": Row("list", "Trainer steps to compile ('' = none).", ["medusa", "eagle", "eagle3", "draft"]),
    "train_batch": Row("integer", "Trainer batch.", 8),
    "train_seq_len": Row("integer", "Trainer sequence length.", 512),
    "train_target_dtype": Row("enum", "The trainer's frozen target (train.main's config.dtype; the head trains in "
                              "float32 either way).", "float32", choices=("float32", "bfloat16")),
    "cost_table": Row("string", "Instead of the programs: write the compiler-estimated verify-cost table (JSON, "
                      "serve/jobs/step_costs.py's format) here.", ""),
    "cost_batches": Row("list", "Batch sizes of the cost table.", ["1", "4", "16", "64"]),
    "cost_ks": Row("list", "Chain draft lengths (0, plain decoding, always).", [str(k) for k in range(9)]),
    "cost_trees": Row("list", "Tree sizes (nodes, root included).", ["8", "16", "32"]),
    "cost_tree_method": Row("string", "The tree proposer of the cost table (several: comma-separated, eagle,medusa).",
                            "eagle"),
    "cost_tree_depth": Row("integer", "Its trees' depth.", 4),
    "cost_hlo_dir": Row("string", "Write each cost-table program's optimized HLO text here ('' = none): the "
                        "instructions behind the breakdown.", ""),
    "cost_chains": Row("list", "Chain methods besides n-gram compiled at the largest of cost_ks (the breakdown's "
                       "draft, medusa, eagle, eagle3, suffix).", []),
    # --- serve.loadtest
    "url": Row("string", "Target this running server for every arm instead of starting one per arm."),
    "analyze_only": Row("string", "Rebuild summary, verdict, tuned config and report from this run dir."),
    "only_arms": Row("list", "Run only these speculative arms (the baseline repeats always run).", []),
    "verify_tuned": Row("bool", "Rerun with the tuned config and check it against the baseline."),
    "plots": Row("bool", "Write the PNG plots.", True),
    # --- train/
    "stop_after": Row("integer", "Stop (without finishing) after this global step: for tests."),
    "out": Row("string", "Directory for the shards and manifest.json."),
    "batch": Row("integer", "Slots decoded together."),
    "max_prompt_tokens": Row("integer", "Longer prompts (chat template included) are skipped, and counted.", 224),
    "shard_size": Row("integer", "Prompts per shard.", 512),
    "num_prompts": Row("integer", "Held-out prompts.", 16),
    "size": Row("integer", "N: how many target ids the draft vocabulary keeps.", 32768),
    "vocab_out": Row("string", "Checkpoint stem to write (<out>.safetensors and <out>.json)."),
    # --- benchmarks/ (the maintained entry points)
    "json_out": Row("string", "Write the results as JSON here."),
    "per_category": Row("integer", "Prompts per Spec-Bench category."),
    "trees": Row("string", "Tree arms method:topk:nodes,... (depth = --num_speculative_tokens), beside the chains."),
    "adaptive_arms": Row("list", "Adaptive k per method arm: on, off or both.", ["on", "off"]),
    "new_tokens": Row("integer", "Tokens decoded per run."),
    "batches": Row("string", "Batch sizes, comma-separated."),
    "dtypes": Row("string", "Dtypes, comma-separated (float32, bfloat16: the CPU layout)."),
    "k0_check": Row("integer", "1: also compare plain vs. the speculative loop at k = 0.", 1),
    "k0_repeats": Row("integer", "Interleaved repeats of the k = 0 check.", 5),
    "meshes": Row("string", "Meshes to compare, ';'-separated ('' = one device)."),
    "lookup": Row("integer", "transformers' prompt_lookup_num_tokens.", 4),
    "gguf": Row("string", "The target GGUF (transformers and llama.cpp load the same file)."),
    "assistant_gguf": Row("string", "A draft model for transformers' assisted generation.", ""),
    "dry_run": Row("bool", "Lower every program for CUDA and run none (works on any host).", False),
    "smoke": Row("bool", "Run every measurement at tiny shapes with the kernel in Pallas interpret mode on this host's "
                 "CPU: the script's own code, checked without a GPU (its numbers mean nothing).", False),
    "hbm_bytes_per_s": Row("float", "The device's published HBM bandwidth (H200: 4.8 TB/s).", 4.8e12),
    "runs": Row("integer", "Timed runs per measurement (median reported).", 20),
    "traffic": Row("list", "benchmarks/suffix.py: traffic kinds (specbench, retries, retries_sampled, templated)."),
    "prompts_out": Row("string", "benchmarks/suffix.py: write the repeated-prompt set (the specbench kind's "
                       "held-apart questions, each twice in a row) as a serve.generate prompt file here, and exit."),
    "requests_per_kind": Row("integer", "benchmarks/suffix.py: requests per traffic kind (retries: that many rounded "
                             "up to whole prompts sent 3 times)."),
    "retry_temperature": Row("float", "benchmarks/suffix.py: the temperature of the sampled retries."),
    "concurrencies": Row("list", "benchmarks/structured_server.py: the closed-loop concurrencies to measure at."),
}

SPEC_ROWS = ("speculative_config", "method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "speculative_model", "draft_layers", "eagle_topk", "num_draft_tokens", "speculative_quantization",
             "suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor", "suffix_history_tokens",
             "suffix_sharing")


_config_holder = None


def define_config(default=None, lock_config: bool = False):
  """--config (an ml_collections config file, `default` the command's); -> its FlagHolder."""
  global _config_holder
  if _config_holder is None:
    from ml_collections import config_flags  # lazy: heavy, only this path (ml_collections: --config files)
    _config_holder = config_flags.DEFINE_config_file("config", default, ROWS["config"].help, lock_config=lock_config)
  return _config_holder


def define(names, **defaults) -> None:
  """Define these rows as absl flags (a name already defined in this process is left as it is)."""
  unknown = [n for n in list(names) + list(defaults) if n not in ROWS]
  if unknown:
    raise KeyError(f"flags not in spec_jax/flag_table.py: {unknown}")
  for name in names:
    if name in flags.FLAGS:
      continue
    row = ROWS[name]
    if row.kind == "config":
      raise ValueError("--config is defined by define_config")
    default = defaults.get(name, row.default)
    if row.kind == "enum":
      flags.DEFINE_enum(name, default, list(row.choices), row.help)
    else:
      getattr(flags, f"DEFINE_{row.kind}")(name, default, row.help)
