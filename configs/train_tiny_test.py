"""A tiny random target and tiny synthetic data: the trainer's tests (resume after SIGKILL, losses fall)."""

from configs.train_base import get_config as _base


def get_config(kind: str = "medusa"):
  c = _base(kind)
  c.model = "tiny"
  c.draft_vocab = 48
  c.mlp_dim = 32
  c.draft_layers = 1
  c.data.num_prompts = 16
  c.data.num_text = 8
  c.data.text_chars = 40
  c.data.max_new_tokens = 24
  c.data.gen_batch = 8
  c.data.seq_len = 32
  c.data.eval_fraction = 0.2
  c.train.steps = 40
  c.train.batch_size = 4
  c.train.warmup = 5
  c.train.lr = 3e-3
  c.train.eval_every = 20
  c.train.eval_batches = 1
  c.train.save_every = 5
  c.train.log_every = 5
  c.train.progress = False
  return c
