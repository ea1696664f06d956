"""Qwen2.5-Coder 1.5B-Instruct drafted by Qwen2.5-Coder 0.5B-Instruct (the classic same-family pair; both from
their PyPI chunk packages: `pip install -e '.[qwen]'`). Flags of serve.generate / serve.server override these.

  python -m serve.generate --config=configs/qwen25_coder_1p5b.py --compare
  python -m serve.generate --config=configs/qwen25_coder_1p5b.py --compare --method=ngram
  python -m serve.generate --config=configs/qwen25_coder_1p5b.py --speculative_model=PATH.gguf  # any same-vocab draft
"""

from configs.gemma3_270m import get_config as _base


def get_config():
  c = _base()
  c.model = "qwen2.5-coder-1.5b-instruct"  # a packaged model's name (spec_jax/checkpoints/packages.py) or a path
  c.speculative_config = dict(method="draft_model", num_speculative_tokens=4, model="qwen2.5-coder-0.5b-instruct")
  c.dtype = "float32"
  # Step costs measured on this 2-core CPU: python -m serve.calibrate --config=configs/qwen25_coder_1p5b.py
  # --method=draft|ngram --calibrate_batch=1|4 --output_costs=configs/costs/qwen25_coder_cpu.json
  c.costs_file = "configs/costs/qwen25_coder_cpu.json"
  c.served_model_name = "qwen2.5-coder-1.5b-instruct"
  return c
