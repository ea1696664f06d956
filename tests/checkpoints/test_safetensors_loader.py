import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.cache import KVCache
from spec_jax.checkpoints.safetensors_loader import config_from_hf, load_hf
from spec_jax.models.transformer import forward, init_params
from tests.checkpoints.hf_writer import hf_config, hf_tensors, save_tensors, write_hf
from tests.conftest import tiny_gemma_config, tiny_llama_config

LLAMA = tiny_llama_config(eos_ids=(1, 7), max_seq_len=128)
QWEN2 = tiny_llama_config(qkv_bias=True, tie_embeddings=True, rope_base=1_000_000.0, rope_base_local=1_000_000.0,
                          name="tiny-qwen2")
GEMMA = tiny_gemma_config(eos_ids=(1, 106))
CONFIGS = {"llama": LLAMA, "qwen2": QWEN2, "gemma3_text": GEMMA, "gemma3": GEMMA}
TOKENS = np.array([[2, 17, 5, 88, 40, 3, 61, 9]], np.int32)


def _params(config, seed=0):
  return jax.tree.map(np.asarray, init_params(config, jax.random.PRNGKey(seed)))


def _logits(params, config, tokens=TOKENS):
  B, T = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  logits, _, _ = forward(params, jnp.asarray(tokens), pos, KVCache.init(config, B, T), config=config)
  return np.asarray(logits)


def _assert_params_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("model_type,shards,index,prefix", [
    ("llama", 1, True, None),
    ("llama", 3, True, None),  # sharded with model.safetensors.index.json
    ("qwen2", 2, False, None),  # several files, no index
    ("gemma3_text", 1, True, None),
    ("gemma3", 2, True, None),  # multimodal wrapper, model.language_model. prefix
    ("gemma3", 1, True, "language_model.model."),  # older wrapper layout
])
def test_round_trip(tmp_path, model_type, shards, index, prefix):
  config = CONFIGS[model_type]
  params = _params(config)
  d = write_hf(tmp_path / "ckpt", config, params, model_type, shards=shards, index=index, prefix=prefix,
               layer_types=prefix is None)  # the old layout also only has sliding_window_pattern
  loaded_config, loaded = load_hf(d)
  assert loaded_config == config.replace(name="ckpt")
  _assert_params_equal(loaded, params)
  np.testing.assert_array_equal(_logits(loaded, loaded_config), _logits(params, config))


def test_bfloat16_checkpoint_and_dtype(tmp_path):
  params = _params(LLAMA)
  d = write_hf(tmp_path / "bf16", LLAMA, params, "llama", bf16=True)
  _, loaded = load_hf(d)
  rounded = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), params)
  _assert_params_equal(loaded, rounded)
  _, p16 = load_hf(d, dtype=jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))


def test_generation_config_eos_ids_are_added(tmp_path):
  d = write_hf(tmp_path / "c", LLAMA, _params(LLAMA), "llama")
  with open(os.path.join(d, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [7, 9]}, f)
  assert load_hf(d)[0].eos_ids == (1, 7, 9)


# ------------------------------------------------------------------ independent check of the HF semantics


def _reference_logits(t, cfg, tokens):
  """A float64 numpy forward written from the HF tensor names (Llama/Qwen2), with no code from the model."""
  g = lambda name: t[name].astype(np.float64)
  D, H, K, L = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                cfg["num_hidden_layers"])
  d = cfg.get("head_dim") or D // H
  eps, T = cfg["rms_norm_eps"], len(tokens)

  def rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

  inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2) / d)
  ang = np.outer(np.arange(T), inv_freq)
  cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
  sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]

  def rope(x):  # rotate_half: (x1, x2) -> (-x2, x1)
    return x * cos + np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

  causal = np.tril(np.ones((T, T), bool))
  x = g("model.embed_tokens.weight")[tokens]
  for i in range(L):
    p = f"model.layers.{i}."
    h = rms(x, g(p + "input_layernorm.weight"))

    def proj(n, heads):
      y = h @ g(p + f"self_attn.{n}_proj.weight").T
      if p + f"self_attn.{n}_proj.bias" in t:
        y = y + g(p + f"self_attn.{n}_proj.bias")
      return y.reshape(T, heads, d)

    q, k, v = rope(proj("q", H)), rope(proj("k", K)), proj("v", K)
    attn = np.zeros((T, H, d))
    for head in range(H):
      kv = head // (H // K)  # repeat_kv: each kv head serves H/K consecutive query heads
      s = q[:, head] @ k[:, kv].T / np.sqrt(d)
      s = np.where(causal, s, -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      attn[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
    x = x + attn.reshape(T, H * d) @ g(p + "self_attn.o_proj.weight").T
    h = rms(x, g(p + "post_attention_layernorm.weight"))
    gate, up = h @ g(p + "mlp.gate_proj.weight").T, h @ g(p + "mlp.up_proj.weight").T
    x = x + (gate / (1.0 + np.exp(-gate)) * up) @ g(p + "mlp.down_proj.weight").T
  x = rms(x, g("model.norm.weight"))
  head = g("model.embed_tokens.weight") if cfg["tie_word_embeddings"] else g("lm_head.weight")
  return x @ head.T


def _random_hf(cfg, bias, seed):
  """Random HF tensors, made directly in HF layout (not through our params or the writer's mapping)."""
  rng = np.random.default_rng(seed)
  D, H, K, F, V = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                   cfg["intermediate_size"], cfg["vocab_size"])
  d = cfg.get("head_dim") or D // H
  lin = lambda out, inp: (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)
  norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
  t = {"model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32),
       "model.norm.weight": norm(D)}
  if not cfg["tie_word_embeddings"]:
    t["lm_head.weight"] = lin(V, D)
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    t.update({p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D),
              p + "self_attn.q_proj.weight": lin(H * d, D), p + "self_attn.k_proj.weight": lin(K * d, D),
              p + "self_attn.v_proj.weight": lin(K * d, D), p + "self_attn.o_proj.weight": lin(D, H * d),
              p + "mlp.gate_proj.weight": lin(F, D), p + "mlp.up_proj.weight": lin(F, D),
              p + "mlp.down_proj.weight": lin(D, F)})
    if bias:
      for n, heads in (("q", H), ("k", K), ("v", K)):
        t[p + f"self_attn.{n}_proj.bias"] = (0.3 * rng.standard_normal(heads * d)).astype(np.float32)
  return t


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_matches_numpy_reference_from_hf_names(tmp_path, model_type):
  cfg = {"model_type": model_type, "vocab_size": 61, "hidden_size": 32, "intermediate_size": 40,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 64, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
  if model_type == "llama":  # head_dim decoupled from hidden_size / heads, separate lm_head
    cfg.update(head_dim=16, rope_theta=500_000.0, tie_word_embeddings=False)
  else:  # Qwen2: q/k/v biases, tied head, transformers 5 rope_parameters, head_dim from hidden_size
    cfg.update(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, tie_word_embeddings=True)
  tensors = _random_hf(cfg, bias=model_type == "qwen2", seed=3)
  d = save_tensors(tmp_path / "ref", tensors, cfg)
  config, params = load_hf(d)
  tokens = np.array([5, 1, 33, 60, 7, 12])
  want = _reference_logits(tensors, {"rope_theta": 10_000.0, **cfg}, tokens)
  got = _logits(params, config, tokens[None].astype(np.int32))[0]
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------- config parsing


def _gemma_cfg(**kw):
  c = hf_config(GEMMA.replace(num_layers=12), "gemma3_text", layer_types=False)
  c.update(kw)
  return c


def test_layer_pattern_from_layer_types_and_sliding_window_pattern():
  six = ["sliding_attention"] * 5 + ["full_attention"]
  assert config_from_hf(_gemma_cfg(layer_types=six * 2)).global_every == 6
  assert config_from_hf(_gemma_cfg(layer_types=["full_attention"] * 12)).global_every == 1
  assert config_from_hf(_gemma_cfg(sliding_window_pattern=3)).global_every == 3
  c = config_from_hf(_gemma_cfg(layer_types=six * 2))
  assert c.layer_is_global().tolist() == [t == "full_attention" for t in six * 2]


def test_bad_layer_patterns():
  with pytest.raises(ValueError, match="not 'every N-th layer"):
    config_from_hf(_gemma_cfg(layer_types=["full_attention"] + ["sliding_attention"] * 11))
  with pytest.raises(ValueError, match="layer_types must list 12"):
    config_from_hf(_gemma_cfg(layer_types=["full_attention"] * 5))
  with pytest.raises(ValueError, match="layer_types must list"):
    config_from_hf(_gemma_cfg(layer_types=["chunked_attention"] * 12))
  with pytest.raises(ValueError, match="sliding_window_pattern"):
    config_from_hf(_gemma_cfg(sliding_window_pattern=0))


def test_gemma_defaults_and_rope_parameters():
  minimal = {"model_type": "gemma3", "text_config": {"hidden_size": 64, "intermediate_size": 128,
                                                      "num_hidden_layers": 6, "model_type": "gemma3_text"},
             "eos_token_id": [1, 106]}
  c = config_from_hf(minimal)
  assert (c.vocab_size, c.head_dim, c.num_heads, c.num_kv_heads) == (262208, 256, 8, 4)
  assert (c.rope_base, c.rope_base_local, c.global_every, c.sliding_window) == (1e6, 1e4, 6, 4096)
  assert c.eos_ids == (1, 106) and c.query_pre_attn_scalar == 256 and c.tie_embeddings
  v5 = _gemma_cfg(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}})
  del v5["rope_theta"], v5["rope_local_base_freq"]
  c = config_from_hf(v5)
  assert (c.rope_base, c.rope_base_local) == (5e5, 2e4)


def test_llama_config_fields():
  c = config_from_hf({**hf_config(LLAMA, "llama"), "head_dim": None, "eos_token_id": [128001, 128009],
                      "pad_token_id": None, "rope_theta": 5e5})
  assert c.head_dim == LLAMA.d_model // LLAMA.num_heads
  assert c.eos_ids == (128001, 128009) and c.pad_id == LLAMA.pad_id and c.rope_base == 5e5
  assert not c.qkv_bias and config_from_hf({**hf_config(LLAMA, "llama"), "attention_bias": True}).qkv_bias


@pytest.mark.parametrize("bad,match", [
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "RoPE scaling"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "mistral"}, r"unknown model_type 'mistral'; supported: \('llama', 'qwen2'"),
    ({"model_type": None}, "unknown model_type None"),
    ({"hidden_size": None}, "'hidden_size' is missing"),
])
def test_unsupported_configs(bad, match):
  with pytest.raises(ValueError, match=match):
    config_from_hf({**hf_config(LLAMA, "llama"), **bad}, "/x/config.json")


def test_gemma_softcapping_and_rope_scaling_refused():
  with pytest.raises(ValueError, match="final_logit_softcapping"):
    config_from_hf(_gemma_cfg(final_logit_softcapping=30.0))
  with pytest.raises(ValueError, match="RoPE scaling"):
    config_from_hf({"model_type": "gemma3",
                    "text_config": _gemma_cfg(rope_scaling={"rope_type": "linear", "factor": 8.0})})


# ------------------------------------------------------------------------------------------------ errors


@pytest.fixture()
def llama_dir(tmp_path):
  return write_hf(tmp_path / "llama", LLAMA, _params(LLAMA), "llama")


def test_missing_directory_and_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope"):
    load_hf(tmp_path / "nope")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="config.json not found in .*empty"):
    load_hf(tmp_path / "empty")


def test_bad_config_json(llama_dir):
  with open(os.path.join(llama_dir, "config.json"), "w") as f:
    f.write("{not json")
  with pytest.raises(ValueError, match="config.json is not valid JSON"):
    load_hf(llama_dir)


def test_unknown_model_type_names_the_path(llama_dir):
  path = os.path.join(llama_dir, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  with open(path, "w") as f:
    json.dump({**cfg, "model_type": "mamba"}, f)
  with pytest.raises(ValueError, match=r"llama.config\.json: unknown model_type 'mamba'; supported"):
    load_hf(llama_dir)


def test_no_safetensors_files(tmp_path):
  d = tmp_path / "noweights"
  d.mkdir()
  (d / "config.json").write_text(json.dumps(hf_config(LLAMA, "llama")))
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors files in .*noweights"):
    load_hf(d)


def test_index_names_a_missing_shard(tmp_path):
  d = write_hf(tmp_path / "sh", LLAMA, _params(LLAMA), "llama", shards=2)
  os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
  with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
    load_hf(d)
  with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
    f.write("[]")
  with pytest.raises(ValueError, match="model.safetensors.index.json is not a valid safetensors index"):
    load_hf(d)


@pytest.mark.parametrize("damage", ["random", "truncated", "short", "bad_header"])
def test_corrupt_safetensors(llama_dir, damage):
  path = os.path.join(llama_dir, "model.safetensors")
  data = open(path, "rb").read()
  bad = {"random": os.urandom(300), "truncated": data[: len(data) // 2], "short": data[:5],
         "bad_header": (12).to_bytes(8, "little") + b"{not json!!}" + data[20:]}[damage]
  with open(path, "wb") as f:
    f.write(bad)
  with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
    load_hf(llama_dir)


def test_missing_tensor(tmp_path):
  t = hf_tensors(LLAMA, _params(LLAMA), "llama")
  del t["model.layers.2.mlp.up_proj.weight"]
  d = save_tensors(tmp_path / "m", t, hf_config(LLAMA, "llama"))
  with pytest.raises(ValueError, match="tensor 'layers.2.mlp.up_proj.weight' is missing"):
    load_hf(d)
  t = hf_tensors(LLAMA, _params(LLAMA), "llama")
  del t["lm_head.weight"]  # config says untied
  d = save_tensors(tmp_path / "m2", t, hf_config(LLAMA, "llama"))
  with pytest.raises(ValueError, match="'lm_head.weight' is missing"):
    load_hf(d)


@pytest.mark.parametrize("name,shape,want", [
    ("model.layers.1.self_attn.k_proj.weight", (32, 32), r"\(16, 32\)"),
    ("model.layers.0.self_attn.o_proj.weight", (32, 31), r"\(32, 32\)"),
    ("model.embed_tokens.weight", (96, 32), r"\(97, 32\)"),
    ("model.norm.weight", (32, 1), r"\(32,\)"),
])
def test_misshapen_tensor(tmp_path, name, shape, want):
  t = hf_tensors(LLAMA, _params(LLAMA), "llama")
  t[name] = np.zeros(shape, np.float32)
  d = save_tensors(tmp_path / "s", t, hf_config(LLAMA, "llama"))
  got = str(shape).replace("(", r"\(").replace(")", r"\)")
  with pytest.raises(ValueError, match=f"{name}' in .*model.safetensors has shape {got}, expected {want}"):
    load_hf(d)


def test_nonzero_o_proj_bias_refused(tmp_path):
  config = LLAMA.replace(qkv_bias=True)
  t = hf_tensors(config, _params(config), "llama")
  for i in range(config.num_layers):
    t[f"model.layers.{i}.self_attn.o_proj.bias"] = np.zeros(config.d_model, np.float32)
  d = save_tensors(tmp_path / "zero", t, hf_config(config, "llama"))
  assert load_hf(d)[0].qkv_bias  # zero o_proj biases are harmless
  t["model.layers.1.self_attn.o_proj.bias"][0] = 0.5
  d = save_tensors(tmp_path / "nonzero", t, hf_config(config, "llama"))
  with pytest.raises(ValueError, match="layers.1.self_attn.o_proj.bias.*nonzero"):
    load_hf(d)


def test_clashing_names_after_prefix_strip(tmp_path):
  t = hf_tensors(LLAMA, _params(LLAMA), "llama")
  t["layers.0.input_layernorm.weight"] = t["model.layers.0.input_layernorm.weight"]  # both mean the same
  t["language_model.vision.x"] = t["model.norm.weight"]  # an unused clash-free extra is fine
  d = save_tensors(tmp_path / "c", t, hf_config(LLAMA, "llama"), shards=2)
  with pytest.raises(ValueError, match="input_layernorm.weight' in .*, .*input_layernorm.weight' in .*all map "
                                       "to 'layers.0.input_layernorm.weight'"):
    load_hf(d)
