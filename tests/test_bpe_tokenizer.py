"""Byte-level BPE from GGUF metadata (Qwen2's tokenizer shape) on a tiny hand-made vocabulary: merges, special and
added tokens, byte round trips, streaming, the Jinja chat template, caching and bad files. The real Qwen2.5
tokenizer against transformers is in tests/e2e/test_qwen25.py."""

from __future__ import annotations

import json
import os

import gguf
import jax
import numpy as np
import pytest

from spec_jax.bpe_tokenizer import BPETokenizer
from spec_jax.checkpoints import gguf_tokenizer
from spec_jax.checkpoints.gguf_loader import load_gguf
from spec_jax.checkpoints.load import load_tokenizer
from spec_jax.models.transformer import forward, init_params
from spec_jax.tokenizer import Tokenizer
from tests.checkpoints.gguf_writer import write_tiny_gguf
from tests.checkpoints.tiny_qwen2 import (CONFIG, EOT, IM_END, IM_START, SP, TOKENS, V, tokenizer_metadata,
                                         write_tiny_qwen2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return write_tiny_qwen2(tmp_path_factory.mktemp("bpe") / "tiny-qwen2.gguf")


@pytest.fixture(scope="module")
def tok(tiny) -> BPETokenizer:
  return load_tokenizer(tiny[0])


def test_is_the_shared_interface(tok):
  assert isinstance(tok, Tokenizer) and isinstance(tok, BPETokenizer)
  assert tok.vocab_size == V == len(tok)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (EOT, IM_END, EOT)
  assert tok.stop_ids == (IM_END, EOT)
  assert tok.special_ids == frozenset({EOT, IM_START, IM_END})


def test_merges_apply_in_rank_order(tok):
  merged = {t: i for i, t in enumerate(TOKENS)}
  assert tok.encode("hello world") == [merged["hello"], merged[f"{SP}world"]]
  assert tok.encode("held") == [merged["he"], merged["ld"]]
  assert tok.encode("world") == [merged["w"], merged["or"], merged["ld"]]  # no "w or" merge without the space
  assert tok.encode("hello", add_bos=True) == [merged["hello"]]  # Qwen2 adds no BOS
  # The pre-tokenizer isolates digits one by one and splits punctuation from words.
  assert tok.encode("42!") == [ord("4"), ord("2"), ord("!")]


def test_special_and_added_tokens(tok):
  assert tok.encode("<|im_start|>hello<|im_end|>") == [IM_START, TOKENS.index("hello"), IM_END]
  plain = tok.encode("<|im_start|>", parse_special=False)
  assert IM_START not in plain and len(plain) > 1
  assert tok.encode("<tool_call>") == [TOKENS.index("<tool_call>")]  # user-defined: whole, not special
  assert TOKENS.index("<tool_call>") not in tok.special_ids
  assert TOKENS.index("[PAD0]") not in tok.encode("[PAD0]")  # unused: never matched from text
  ids = tok.encode("<|im_start|>hello<|im_end|>")
  assert tok.decode(ids) == "<|im_start|>hello<|im_end|>"
  assert tok.decode(ids, skip_special=True) == "hello"
  assert tok.id_of("<|im_end|>") == IM_END and tok.id_of(f"{SP}world") == tok.id_of(" world")
  with pytest.raises(KeyError):
    tok.id_of("definitely not one piece")
  with pytest.raises(ValueError):
    tok.decode([V])


@pytest.mark.parametrize("text", ["hello world", "  spaced\n\n\ttabs  ", "Café naïve 你好 🍕👩\u200d💻", "\x00\x07", ""])
def test_byte_round_trip(tok, text):
  assert tok.decode(tok.encode(text)) == text


def test_streaming_holds_split_characters(tok):
  text = "ok 🧬 你好 done"
  ids = tok.encode(text)
  assert len(ids) > len(text) - 2  # the emoji and the CJK characters are several byte tokens each
  stream = tok.stream()
  pieces = [stream.add(t) for t in ids] + [stream.flush()]
  assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
  assert "".join(tok.decode_incremental(ids[:k], ids[k:k + 1]) for k in range(len(ids))) == text


def test_chat_template_from_the_file(tok):
  text = tok.apply_chat_template(["Hi", "Hello!", "Bye"])
  assert text == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                  "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
  msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]
  assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
      "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n")
  with pytest.raises(ValueError, match="role"):
    tok.apply_chat_template([{"role": "tool?", "content": "x"}])


def test_template_errors_are_value_errors(tmp_path):
  path, _ = write_tiny_qwen2(tmp_path / "raise.gguf", template="{{ raise_exception('no system role here') }}")
  with pytest.raises(ValueError, match="no system role here"):
    load_tokenizer(path).apply_chat_template(["Hi"])
  path, _ = write_tiny_qwen2(tmp_path / "none.gguf", template=None)
  with pytest.raises(ValueError, match="no chat template"):
    load_tokenizer(path).apply_chat_template(["Hi"])


def test_spec_is_cached_beside_the_file(tiny, monkeypatch):
  path = tiny[0]
  load_tokenizer(path)
  cached = path + gguf_tokenizer.BPE_CACHE_SUFFIX
  assert os.path.exists(cached) and json.load(open(cached + ".json"))["format"] == gguf_tokenizer.BPE_CACHE_FORMAT
  monkeypatch.setattr(gguf_tokenizer, "build_bpe_spec", lambda p: pytest.fail("the cache was not used"))
  monkeypatch.setattr(gguf_tokenizer, "read_metadata", lambda *a: pytest.fail("the file was read again"))
  assert load_tokenizer(path).encode("hello") == [TOKENS.index("hello")]


def test_damaged_cache_is_rebuilt(tmp_path):
  path, _ = write_tiny_qwen2(tmp_path / "t.gguf")
  load_tokenizer(path)
  with open(path + gguf_tokenizer.BPE_CACHE_SUFFIX, "r+b") as f:
    f.seek(20)
    f.write(b"#")
  assert load_tokenizer(path).encode("hello world") == [TOKENS.index("hello"), TOKENS.index(f"{SP}world")]


def test_bad_files_give_clear_errors(tmp_path):
  path, _ = write_tiny_qwen2(tmp_path / "pre.gguf", pre="some-other-pre")
  with pytest.raises(ValueError, match="pre-tokenizer 'some-other-pre' is not supported"):
    load_tokenizer(path)
  path, _ = write_tiny_qwen2(tmp_path / "merges.gguf", merges=False)
  with pytest.raises(ValueError, match="tokenizer.ggml.merges"):
    load_tokenizer(path)


def test_qwen2_gguf_loads_biases_and_untied_head(tiny):
  path, params = tiny
  config, loaded = load_gguf(path, use_cache=False)
  assert config.qkv_bias and not config.tie_embeddings and not config.qk_norm and not config.post_norms
  assert config.activation == "silu" and config.sliding_window is None and config.embed_scale is False
  assert (config.bos_id, config.eos_ids, config.vocab_size) == (EOT, (IM_END,), V)
  flat = lambda p: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(p)}
  a, b = flat(params), flat(loaded)
  assert sorted(a) == sorted(b)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  toks = np.array([[1, 2, 3, 4]], np.int32)
  np.testing.assert_allclose(forward(loaded, toks, config=config)[0], forward(params, toks, config=CONFIG)[0],
                             rtol=1e-6, atol=1e-6)


def test_qwen2_gguf_with_tied_head(tmp_path):
  cfg = CONFIG.replace(tie_embeddings=True)
  params = init_params(cfg, jax.random.key(1))
  path = tmp_path / "tied.gguf"
  write_tiny_gguf(path, cfg, params, arch="qwen2", extra=tokenizer_metadata())
  config, loaded = load_gguf(str(path), use_cache=False)
  assert config.tie_embeddings and "lm_head" not in loaded


def test_qwen2_gguf_missing_bias_is_named(tmp_path):
  params = init_params(CONFIG, jax.random.key(0))
  path = tmp_path / "nobias.gguf"
  write_tiny_gguf(path, CONFIG, params, arch="qwen2", extra=tokenizer_metadata(), drop=("blk.1.attn_k.bias",))
  with pytest.raises(ValueError, match=r"k_bias\[1\]"):
    load_gguf(str(path), use_cache=False)


def test_reader_sees_the_gpt2_model(tiny):
  r = gguf.GGUFReader(tiny[0])
  assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
