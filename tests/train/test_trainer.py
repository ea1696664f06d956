"""The trainer on a tiny random target: losses fall, a SIGKILLed run resumes to bitwise-equal params, and
data parallelism over 2 host devices trains the same model."""

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
  from spec_jax.decode import generate
  config, params, _ = load_target(cfg)
  rng = np.random.default_rng(0)
  prompts = [[config.bos_id] + rng.integers(3, config.vocab_size, 4).tolist() for _ in range(8)]
  out = generate(params, config.replace(eos_ids=()), prompts, max_new_tokens=19, warm=False).token_ids
  toks, mask = data_lib.pack([p + o for p, o in zip(prompts, out)], 24)
  return data_lib.Dataset(toks, mask, toks[:4], mask[:4])


@pytest.mark.parametrize("kind", ["medusa", "eagle", "draft"])
def test_losses_fall(kind, tmp_path):
  cfg = get_config(kind)
  config, params, _ = load_target(cfg)
  data = _self_distilled(cfg)
  d2t = None if kind == "draft" else np.arange(3, 97, dtype=np.int32)
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
                    f"--config.train.workdir={w}", f"--config.cache_dir={cache}", "--config.train.steps=10"],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    import json
    with open(os.path.join(w, "summary.json")) as f:
      assert json.load(f)["devices"] == n
    runs[n] = _final(w)
  for k in runs[1]:
    np.testing.assert_allclose(runs[1][k], runs[2][k], rtol=2e-4, atol=2e-5, err_msg=k)
