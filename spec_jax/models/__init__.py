"""One config-driven decoder-only transformer (Gemma 3, Llama, Qwen2)."""

from spec_jax.models.transformer import Transformer, forward, lm_head, init_params, param_shapes

__all__ = ["Transformer", "forward", "lm_head", "init_params", "param_shapes"]
