"""One config-driven decoder-only transformer (Gemma 3, Llama, Qwen2)."""

from spec_jax.models.transformer import decoder_layer, forward, init_params, lm_head, param_shapes

__all__ = ["decoder_layer", "forward", "init_params", "lm_head", "param_shapes"]
