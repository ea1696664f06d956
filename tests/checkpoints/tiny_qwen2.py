"""A tiny random Qwen2 GGUF with a hand-made byte-level BPE vocabulary (merges, control, user-defined and unused
tokens) and a ChatML Jinja template: what the BPE tokenizer, loader and server tests load."""

from __future__ import annotations

import jax
import numpy as np

from spec_jax.checkpoints import gguf_tokenizer
from spec_jax.config import ModelConfig
from spec_jax.models.transformer import init_params
from tests.checkpoints.gguf_writer import write_tiny_gguf

ALPHA = gguf_tokenizer.byte_alphabet()
SP = ALPHA[ord(" ")]  # "Ġ"
MERGES = ["h e", "l l", "he ll", "hell o", f"{SP} w", "o r", f"{SP}w or", "l d", f"{SP}wor ld"]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool_call>"]
UNUSED = ["[PAD0]"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _vocab():
  tokens = [ALPHA[b] for b in range(256)]
  for m in MERGES:
    tokens.append(m.replace(" ", ""))
  types = [1] * len(tokens)
  for group, ty in ((CONTROL, 3), (USER_DEFINED, 4), (UNUSED, 5)):
    tokens += group
    types += [ty] * len(group)
  return tokens, types


TOKENS, TYPES = _vocab()
V = len(TOKENS)
EOT, IM_START, IM_END = (TOKENS.index(t) for t in CONTROL)


def tokenizer_metadata(pre="qwen2", merges=True, template=TEMPLATE):
  def add(w):
    w.add_tokenizer_model("gpt2")
    if pre is not None:
      w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    if merges:
      w.add_token_merges(MERGES)
    w.add_add_bos_token(False)
    if template is not None:
      w.add_chat_template(template)
  return add


CONFIG = ModelConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                     activation="silu", post_norms=False, qk_norm=False, qkv_bias=True, sliding_window=None,
                     query_pre_attn_scalar=None, embed_scale=False, tie_embeddings=False, rope_base=1e6,
                     rope_base_local=1e6, bos_id=EOT, eos_ids=(IM_END,), pad_id=EOT, max_seq_len=256)


def write_tiny_qwen2(path, *, never_stop: bool = False, **kw):
  """-> (path, params): a tiny random Qwen2 with the tokenizer above. `never_stop` zeroes the head columns of the
  stop tokens, so greedy decoding runs to max_tokens (exact token counts)."""
  params = jax.tree.map(np.asarray, init_params(CONFIG, jax.random.key(0)))
  if never_stop:
    head = np.array(params["lm_head"])
    head[:, [EOT, IM_END]] = 0.0
    params["lm_head"] = head
  write_tiny_gguf(path, CONFIG, params, arch="qwen2", extra=tokenizer_metadata(**kw))
  return str(path), params


