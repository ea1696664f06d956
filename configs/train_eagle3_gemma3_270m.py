"""EAGLE-3 head for Gemma 3 270M: python -m train.main --config=configs/train_eagle3_gemma3_270m.py

Fused low, middle and high target layers (1, 8, 14 of 18: SpecForge's choice for an L-layer target, layers
1, L/2 - 1 and L - 4) instead of the final hidden state, the training-time test, and no feature regression
(EAGLE-3 trains on the token distribution only); the same self-distilled data and steps as the EAGLE-1 config."""

from configs.train_base import get_config as _base, use_self_distilled


def get_config():
  c = use_self_distilled(_base("eagle"))
  c.export = "heads/eagle3_gemma3_270m"
  c.feature_layers = (1, 8, 14)
  c.reg_weight = 0.0
  c.ttt_passes = 3
  c.train.steps = 1000
  c.train.workdir = "/tmp/spec_jax_train/eagle3"
  return c
