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
  c.draft_quantize = "int8"  # method=qdraft: the draft's weights, int8 | int4
  c.mesh = ""  # 'data:N,model:M' over the devices (spec_jax/sharding.py); '' = one device
  c.method = "ngram"
  c.num_speculative_tokens = 4
  c.ngram_min = 1
  c.ngram_max = 3
  c.draft_layers = 0  # method=draft: 0 = the distilled draft in heads/; N > 0 = early exit after N layers
  c.draft_model = ""  # method=draft: an independent draft model (.gguf, HF directory or packaged name) instead
  # Token trees (medusa; SGLang's flags): num_speculative_tokens is the depth, eagle_topk the candidates per
  # node (1 = chains) and num_draft_tokens the node budget, root included (0 = 1 + depth * eagle_topk).
  c.eagle_topk = 1
  c.num_draft_tokens = 0
  c.adaptive = True
  # Step costs for the adaptive controller, measured by `python -m serve.calibrate` on this 2-core CPU ('' = the
  # default model 1 + 0.25 k). A method without an entry there uses the default model.
  c.costs_file = "configs/costs/gemma3_270m_cpu.json"
  c.heads = ""  # medusa/eagle/draft checkpoint; "" = heads/<method>_gemma3_270m
  return c
