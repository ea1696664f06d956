"""Train Medusa heads, an EAGLE head or a distilled draft on a frozen target, then export the head checkpoint.

  python -m train.main --config=configs/train_eagle_gemma3_270m.py
  python -m train.main --config=configs/train_medusa_gemma3_270m.py --config.train.steps=600
  python -m train.main --config=configs/train_eagle_gemma3_270m.py --mesh=data:4,model:2   # 8 devices
  python -m train.main --config=configs/train_eagle_gemma3_270m.py --config.init_from=heads/eagle_gemma3_270m \
      --config.train.workdir=/tmp/spec_jax_train/eagle_epoch2   # start from a shipped head: another epoch

Re-running the same command resumes from the latest checkpoint in `workdir` (exactly: params, optimizer state,
data position and rng), on any mesh: a checkpoint written on one --mesh resumes on another or on one device.
`model = "tiny"` trains on a small random target with synthetic prompts (tests).

On many hosts (a TPU pod slice, a SLURM/MPI job, or explicit flags) start the same command once per host:
  python -m train.main --config=... --mesh=data:2,model:8 \
      --coordinator_address=HOST0:1234 --num_processes=2 --process_id=I   # not needed on TPU pods, SLURM or MPI
The hosts join one jax.distributed run and train on one mesh over all their devices; every host must get the same
flags (checked at start); the workdir must be one shared directory (checkpoints are written by all hosts together).
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
from absl import app, flags, logging

from spec_jax import distributed, flag_table, sharding
from spec_jax.batch import generate
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.checkpoints.load import load_model
from spec_jax.config import ModelConfig, SamplingParams
from spec_jax.models.transformer import init_params
from spec_jax.proposers.eagle import check_feature_layers
from train import data as data_lib

from train.tasks import build_task  # noqa: F401  (tests and benchmarks import it from here too)
from train.trainer import TrainSpec, Trainer

_CONFIG = flag_table.define_config(lock_config=True)  # the training config
flag_table.define(("stop_after", "mesh", "coordinator_address", "num_processes", "process_id",
                   "initialization_timeout", "heartbeat_timeout"), mesh="")
FLAGS = flags.FLAGS


def load_target(cfg):
  if cfg.model == "tiny":
    config = ModelConfig(**dict(cfg.tiny))
    return config, init_params(config, jax.random.PRNGKey(cfg.tiny_seed), jnp.float32), None
  return load_model(cfg.model or None, cfg.dtype)


def build_data(cfg, config, params, tokenizer, log, lazy=False):
  """The run's Dataset; lazy: rows tokenized as read (data_lib.build), as the trainer on many hosts reads them."""
  spec = data_lib.DataSpec(**dict(cfg.data))
  share = (jax.process_index(), jax.process_count())  # each process checks its share of the distill shards

  def generate_fn(batch, temperature, seed):
    res = generate(params, config, batch, max_new_tokens=spec.max_new_tokens, seed=seed,
                   sampling=SamplingParams.make(len(batch), temperature=temperature),
                   stop_ids=tokenizer.stop_ids if tokenizer else ())
    return res.token_ids

  if tokenizer is None:  # tiny random target: random-token prompts and "texts"
    rng = np.random.default_rng(spec.seed)
    prompts = [rng.integers(3, config.vocab_size, int(rng.integers(3, 12))).tolist()
               for _ in range(spec.num_prompts)]
    texts = [rng.integers(3, config.vocab_size, spec.text_chars).tolist() for _ in range(spec.num_text)]
    return data_lib.build(spec, target_name=config.name, encode_prompt=lambda p: [config.bos_id] + p,
                          encode_text=lambda t: [config.bos_id] + t, generate_fn=generate_fn,
                          cache_dir=cfg.cache_dir, prompts=prompts, texts=texts, transcripts=[], log=log, lazy=lazy,
                          share=share)
  def encode_prompt(t):  # a prompt (ends with the model's turn opening) or a (prompt, answer) transcript
    if isinstance(t, tuple):
      return tokenizer.encode(tokenizer.apply_chat_template(list(t), add_generation_prompt=False))
    return tokenizer.encode(tokenizer.apply_chat_template([t]))
  return data_lib.build(spec, target_name=config.name, encode_prompt=encode_prompt,
                        encode_text=lambda t: tokenizer.encode(t, parse_special=False),
                        generate_fn=generate_fn, cache_dir=cfg.cache_dir, log=log, lazy=lazy, share=share)


def token_counts(data, vocab_size):
  """The training rows' token counts; on many processes each counts its share of the rows and the parts are
  summed, so no host reads every row."""
  n = jax.process_count()
  if n == 1:
    return data.token_counts(vocab_size)
  mine = data.token_counts(vocab_size, share=(jax.process_index(), n)).astype(np.int32)
  return np.asarray(multihost_utils.process_allgather(mine)).astype(np.int64).sum(0)


def record_reads(workdir, data):
  """workdir/data_reads/process<i>.json: the training and eval rows this process tokenized (what a host of many
  reads: its rows of each batch and its share of the token count), and the self-distilled answers and jsonl
  examples it read."""
  if not isinstance(data.tokens, data_lib.RowView):
    return
  path = os.path.join(workdir, "data_reads", f"process{jax.process_index()}.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump({"train": data.tokens.rows_read(), "eval": data.eval_tokens.rows_read(),
               "train_rows": len(data.tokens), "eval_rows": len(data.eval_tokens),
               "answers": sorted(data.answers.read), "answers_total": len(data.answers),
               "examples": sorted(data.examples.read) if data.examples is not None else []}, f)


# Settings a resumed run may change: they do not change what is trained. (data_parallel: an old config key,
# replaced by the --mesh flag, which a resumed run may also change.)
_RESUMABLE = {"train.progress", "train.log_every", "data_parallel"}


def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
  return out


def check_resume_config(cfg):
  """The first run writes its config to workdir/config.json (process 0, atomically); a later run in the same
  workdir (a resume) must have the same settings, or it would silently continue another experiment."""
  path = os.path.join(cfg.train.workdir, "config.json")
  now = _flat(json.loads(cfg.to_json()))
  if os.path.exists(path):
    with open(path) as f:
      before = _flat(json.load(f))
    before.setdefault("head_layout", "ours")  # runs from before the option trained this project's layout
    diff = sorted(k for k in set(now) | set(before) if k not in _RESUMABLE and now.get(k) != before.get(k))
    if diff:
      raise ValueError(f"{cfg.train.workdir} holds a run with other settings ({', '.join(diff)}): use another "
                       "--config.train.workdir, or the same settings to resume it")
    return
  os.makedirs(cfg.train.workdir, exist_ok=True)
  if jax.process_index() == 0:
    with open(f"{path}.tmp", "w") as f:
      f.write(cfg.to_json(indent=1))
    os.replace(f"{path}.tmp", path)  # another host never reads half a file


def warm_start(cfg, config, init, d2t):
  """-> (initial params, export meta): `init` itself, or with cfg.init_from set, the weights of that head
  checkpoint (a second epoch from where a shipped head stopped). The checkpoint must be of this kind, for this
  target, of the same shapes, EAGLE feature layers and draft vocabulary, else ValueError naming the difference."""
  if not cfg.init_from:
    return init, {}
  where = f"init_from {cfg.init_from}"
  meta, params, ck_d2t = head_ckpt.load_heads(cfg.init_from, config, cfg.kind)
  head_ckpt.check_shapes(params, jax.tree.map(np.shape, init), where)
  if cfg.kind == "eagle":  # the metadata read as load_eagle reads it
    layers = check_feature_layers(meta.get("feature_layers") or (), config, where)
    if layers != tuple(cfg.feature_layers):
      raise ValueError(f"{where}: an EAGLE head over feature layers {list(layers)}, but config.feature_layers is "
                       f"{list(cfg.feature_layers)}")
  if (ck_d2t is None) != (d2t is None) or (d2t is not None and not np.array_equal(np.asarray(ck_d2t), d2t)):
    raise ValueError(f"{where}: its draft vocabulary (d2t) differs from the one this data gives "
                     f"(draft_vocab={cfg.draft_vocab})")
  prior = int(meta.get("total_train_steps", meta.get("train_steps", 0)))
  return params, {"init_from": cfg.init_from, "prior_train_steps": prior}


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _portable(data: dict) -> dict:
  """The data settings for a shipped checkpoint's metadata: a distill_dir inside the repository as a relative
  path, not this machine's."""
  d = data.get("distill_dir")
  if d and os.path.abspath(d).startswith(REPO + os.sep):
    data = dict(data, distill_dir=os.path.relpath(os.path.abspath(d), REPO))
  return data


def run(cfg, stop_after=None, log=None, mesh=""):
  """`mesh`: a --mesh string or a Mesh (None or '' = one device)."""
  log = log or (lambda s: print(s, file=sys.stderr, flush=True))
  if jax.process_index() != 0:  # logs from process 0 only (errors still end on every host: spec_jax.distributed)
    log = lambda s: None
  if not isinstance(mesh, jax.sharding.Mesh):  # hosts started with other settings would deadlock in a collective
    distributed.check_same_settings(dict(_flat(json.loads(cfg.to_json())), mesh=mesh or "", stop_after=stop_after),
                                    "flags (--config, --mesh, --stop_after)")
  check_resume_config(cfg)
  t0 = time.time()
  config, params, tokenizer = load_target(cfg)
  data = build_data(cfg, config, params, tokenizer, log, lazy=True)  # each host reads only its own rows
  t_data = time.time() - t0
  d2t = head_ckpt.make_d2t(token_counts(data, config.vocab_size), cfg.draft_vocab) if cfg.draft_vocab else None
  task, init, frozen, meta = build_task(cfg, config, params, d2t)
  init, start_meta = warm_start(cfg, config, init, d2t)
  if mesh is None or isinstance(mesh, str):
    mesh = sharding.make_mesh(mesh or "")
  spec = TrainSpec(**dict(cfg.train), feature_dir=os.path.join(cfg.cache_dir, "features"))
  trainer = Trainer(task, spec, mesh=mesh, log=log)
  final, ev = trainer.fit(init, frozen, data, stop_after=stop_after)
  record_reads(cfg.train.workdir, data)
  if stop_after is not None and int(trainer.ckpt.latest_step() or 0) < cfg.train.steps:
    return final, None
  # Collectives (restores, gathers) on every process; files written by process 0 only.
  final_host = jax.tree.map(sharding.to_host, final)
  flat = head_ckpt.flatten(final_host)
  best = trainer.best_params(final) if cfg.export and cfg.export_best else None
  best = None if best is None else jax.tree.map(sharding.to_host, best)
  out = {"final": final}
  if jax.process_index() != 0:
    return final, ev
  np.savez(os.path.join(cfg.train.workdir, "final_params.npz"), **{k.replace("/", "."): v for k, v in flat.items()})
  if cfg.export:
    meta = dict(meta, **start_meta, train_steps=cfg.train.steps,
                total_train_steps=start_meta.get("prior_train_steps", 0) + cfg.train.steps,
                train_time_s=round(time.time() - t0, 1), data_time_s=round(t_data, 1), eval=ev,
                data=_portable(dict(cfg.data)), draft_vocab=cfg.draft_vocab)
    path = head_ckpt.save_heads(cfg.export, cfg.kind, best if best is not None else final_host, config, meta, d2t,
                                storage=cfg.export_storage)
    log(f"exported {path}")
    out["export"] = path
  with open(os.path.join(cfg.train.workdir, "summary.json"), "w") as f:
    json.dump({"eval": ev, "time_s": round(time.time() - t0, 1), "data_time_s": round(t_data, 1),
               "devices": 1 if mesh is None else mesh.size, "mesh": sharding.describe(mesh)}, f, indent=1)
  return final, ev


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  distributed.main("train.main", lambda: run(_CONFIG.value, FLAGS.stop_after, mesh=FLAGS.mesh),
                   distributed.Join.from_flags(FLAGS))


if __name__ == "__main__":
  app.run(main)
