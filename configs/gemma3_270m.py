"""Batch generation on Gemma 3 270M (the packaged GGUF). Flags of serve.generate override these fields."""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.model = ""  # "" = the packaged Gemma 3 270M GGUF; or a .gguf path, or an HF safetensors directory
  c.dtype = "bfloat16"  # on CPU: bf16 embedding/head, f32 layers (checkpoints/load.py cpu_layout)
  c.attention_impl = "auto"
  c.max_new_tokens = 64
  c.temperature = 0.0
  c.top_k = 0
  c.top_p = 1.0
  c.seed = 0
  c.batch_size = 1
  c.quantize = "none"  # target weights: none | int8 | int4 (spec_jax/quant.py)
  c.mesh = ""  # 'data:N,model:M' over the devices (spec_jax/sharding.py); '' = one device
  # The speculative config, vLLM's keys (spec_jax/spec_config.py): --speculative_config replaces it, the single
  # flags (--method, --num_speculative_tokens, --speculative_model, ...) override its keys.
  c.speculative_config = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
  c.adaptive = True
  # Step costs for the adaptive controller, measured by `python -m serve.calibrate` on this 2-core CPU ('' = the
  # default model 1 + 0.25 k). A method without an entry there uses the default model.
  c.costs_file = "configs/costs/gemma3_270m_cpu.json"
  return c
