"""The trainer on a tiny random target: losses fall, a SIGKILLed run resumes to bitwise-equal params, and
data parallelism over 2 host devices trains the same model."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.train_tiny_test import get_config
from spec_jax.models.transformer import init_params
from train import data as data_lib
from train.main import build_task, load_target
from train.trainer import Trainer, TrainSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _self_distilled(cfg):
  """8 greedy continuations of the tiny target (what the heads learn to predict); eval on 4 of them."""
  from spec_jax.batch import generate
  config, params, _ = load_target(cfg)
  rng = np.random.default_rng(0)
  prompts = [[config.bos_id] + rng.integers(3, config.vocab_size, 4).tolist() for _ in range(8)]
  out = generate(params, config.replace(eos_ids=()), prompts, max_new_tokens=19).token_ids
  toks, mask = data_lib.pack([p + o for p, o in zip(prompts, out)], 24)
  return data_lib.Dataset(toks, mask, toks[:4], mask[:4])


@pytest.mark.parametrize("kind", ["medusa", "eagle", "draft"])
def test_losses_fall(kind, tmp_path):
  cfg = get_config(kind)
  config, params, _ = load_target(cfg)
  data = _self_distilled(cfg)
  d2t = np.arange(3, 97, dtype=np.int32)
  task, init, frozen, _ = build_task(cfg, config, params, d2t)
  spec = TrainSpec(steps=60, batch_size=4, lr=1e-2, warmup=3, eval_every=60, save_every=60, log_every=5,
                   workdir=str(tmp_path), progress=False)
  trainer = Trainer(task, spec, log=lambda s: None)
  first = trainer.evaluate(trainer.init_state(init).params, frozen, data)
  _, last = trainer.fit(init, frozen, data)
  assert last["loss"] < 0.7 * first["loss"], (first["loss"], last["loss"])
  assert last["top1_h0"] >= first["top1_h0"]


def _train_cmd(workdir, cache, *extra):
  return [sys.executable, "-m", "train.main", "--config=configs/train_tiny_test.py:eagle",
          f"--config.train.workdir={workdir}", f"--config.cache_dir={cache}", "--config.noise=0.05", *extra]


def _final(workdir):
  z = np.load(os.path.join(workdir, "final_params.npz"))
  return {k: z[k] for k in z.files}


def test_resume_after_sigkill_is_exact(tmp_path):
  cache = str(tmp_path / "data")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  a = str(tmp_path / "a")
  subprocess.run(_train_cmd(a, cache), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
  b = str(tmp_path / "b")
  proc = subprocess.Popen(_train_cmd(b, cache), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 240
  while not os.path.isdir(os.path.join(b, "ckpt", "10")):  # mid-run: saved at step 10 (of 40)
    assert proc.poll() is None and time.time() < deadline, "the training run ended before its step-10 checkpoint"
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not os.path.exists(os.path.join(b, "final_params.npz"))
  out = subprocess.run(_train_cmd(b, cache), cwd=ROOT, env=env, check=True, capture_output=True, text=True,
                       timeout=300)
  assert "resumed from step" in out.stderr
  resumed = int(out.stderr.split("resumed from step")[1].split()[0])
  assert 10 <= resumed < 40
  fa, fb = _final(a), _final(b)
  assert fa.keys() == fb.keys()
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def test_data_parallel_over_two_devices(tmp_path):
  cache = str(tmp_path / "data")
  runs = {}
  for n in (1, 2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
    w = str(tmp_path / f"w{n}")
    subprocess.run([sys.executable, "-m", "train.main", "--config=configs/train_tiny_test.py:medusa",
                    f"--config.train.workdir={w}", f"--config.cache_dir={cache}", "--config.train.steps=10",
                    f"--mesh=data:{n}"],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    import json
    with open(os.path.join(w, "summary.json")) as f:
      assert json.load(f)["devices"] == n
    runs[n] = _final(w)
  for k in runs[1]:
    np.testing.assert_allclose(runs[1][k], runs[2][k], rtol=2e-4, atol=2e-5, err_msg=k)


def test_data_sources_and_held_out_prompts(tmp_path):
  """Self-distilled prompts, then reference transcripts, from one seeded permutation; the last HELD_OUT prompts
  (what train.eval_acceptance measures) are never used; Spec-Bench files are skipped."""
  import json
  d = tmp_path / "train"
  d.mkdir()
  n = data_lib.HELD_OUT + 24
  with open(d / "gsm8k_train.jsonl", "w") as f:
    for i in range(n):
      f.write(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) + "\n")
  with open(d / "spec_bench.jsonl", "w") as f:
    f.write(json.dumps({"question": "never", "answer": "never"}) + "\n")
  spec = data_lib.DataSpec(num_prompts=8, num_transcripts=12, num_text=0, seq_len=16, eval_fraction=0.1)
  gen_calls = []

  def generate_fn(batch, temp, seed):
    gen_calls.append(len(batch))
    return [[7, 7] for _ in batch]

  enc = lambda t: [2] + [ord(c) for c in (t if isinstance(t, str) else "|".join(t))]
  kw = dict(target_name="t", encode_prompt=enc, encode_text=enc, generate_fn=generate_fn,
            cache_dir=str(tmp_path / "cache"), texts=[], data_dir=str(d), log=lambda s: None)
  ds = data_lib.build(spec, **kw)
  rows = [r[m].tolist() for r, m in zip(np.concatenate([ds.tokens, ds.eval_tokens]),
                                         np.concatenate([ds.mask, ds.eval_mask]))]
  texts = ["".join(chr(c) for c in r[1:]) for r in rows]
  assert sum(gen_calls) == 8 and len(rows) == 20
  assert sum(t.endswith("\x07\x07") for t in texts) == 8  # self-distilled: prompt + generated tokens
  transcripts = [t for t in texts if "|" in t]
  assert len(transcripts) == 12 and all(t.split("|")[1] == "a" + t.split("|")[0][1:] for t in transcripts)
  order = data_lib.prompt_order(n, spec.seed)
  held = {f"q{i}" for i in order[-data_lib.HELD_OUT:]}
  used = {t.split("|")[0].rstrip("\x07") for t in texts}
  assert not used & held and "never" not in used
  # The self-distilled part is cached: a second build with more transcripts does not generate again.
  data_lib.build(dataclasses.replace(spec, num_transcripts=14), **kw)
  assert sum(gen_calls) == 8
  with pytest.raises(ValueError, match="held out"):
    data_lib.build(dataclasses.replace(spec, num_transcripts=n), **kw)


def test_resume_refuses_other_settings(tmp_path):
  from train.main import check_resume_config
  cfg = get_config("medusa")
  cfg.train.workdir = str(tmp_path / "w")
  check_resume_config(cfg)  # first run: records its settings
  check_resume_config(cfg)  # same settings: a resume
  cfg.train.progress = not cfg.train.progress  # display only
  check_resume_config(cfg)
  cfg.train.lr = cfg.train.lr * 2
  with pytest.raises(ValueError, match="train.lr"):
    check_resume_config(cfg)


def test_warm_start_from_a_head_checkpoint(tmp_path):
  """config.init_from starts training from a head checkpoint's weights (another epoch for a shipped head); a
  checkpoint of another kind, feature layout or draft vocabulary is refused by name."""
  from spec_jax.checkpoints.heads import save_heads
  from train.main import run, warm_start
  cfg = get_config("eagle")
  config, params, _ = load_target(cfg)
  d2t = np.arange(3, 51, dtype=np.int32)
  _, init, _, meta = build_task(cfg, config, params, d2t)
  leaves, tree = jax.tree.flatten(init)
  keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
  trained = jax.tree.unflatten(tree, [x + jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  stem = str(tmp_path / "head")
  save_heads(stem, "eagle", trained, config, dict(meta, train_steps=7), d2t)
  stored = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), trained)

  assert warm_start(cfg, config, init, d2t) == (init, {})  # no init_from: the fresh init
  cfg.init_from = stem
  got, start = warm_start(cfg, config, init, d2t)
  assert start == {"init_from": stem, "prior_train_steps": 7}
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), got, stored)
  with pytest.raises(ValueError, match="draft vocabulary"):
    warm_start(cfg, config, init, d2t[::-1].copy())
  medusa_cfg = get_config("medusa")
  medusa_cfg.init_from = stem
  with pytest.raises(ValueError, match="'eagle' head checkpoint"):
    warm_start(medusa_cfg, config, init, d2t)
  save_heads(stem + "3", "eagle", trained, config, dict(meta, feature_layers=[1]), d2t)
  cfg.init_from = stem + "3"
  with pytest.raises(ValueError, match="feature layers"):
    warm_start(cfg, config, init, d2t)

  # Through train.main with a zero learning rate, the run's final params are the checkpoint's.
  cfg = get_config("eagle")
  cfg.train.workdir, cfg.cache_dir = str(tmp_path / "w"), str(tmp_path / "cache")
  cfg.train.steps, cfg.train.lr, cfg.train.eval_every, cfg.train.save_every = 2, 0.0, 2, 2
  first = tmp_path / "first"
  cfg.export = str(first)
  run(cfg, log=lambda s: None)  # the data's d2t (this config's), a fresh head
  from spec_jax.checkpoints.heads import load_heads
  _, shipped, ship_d2t = load_heads(str(first), config, "eagle")
  cfg2 = get_config("eagle")
  cfg2.train.workdir, cfg2.cache_dir = str(tmp_path / "w2"), cfg.cache_dir
  cfg2.train.steps, cfg2.train.lr, cfg2.train.eval_every, cfg2.train.save_every = 2, 0.0, 2, 2
  cfg2.init_from, cfg2.export = str(first), str(tmp_path / "second")
  run(cfg2, log=lambda s: None)
  final = _final(cfg2.train.workdir)
  from spec_jax.checkpoints.heads import flatten
  for name, want in flatten(shipped).items():
    np.testing.assert_array_equal(final[name.replace("/", ".")], np.asarray(want))
  second_meta = json.load(open(str(tmp_path / "second") + ".json"))
  assert second_meta["init_from"] == str(first) and second_meta["total_train_steps"] == 4
