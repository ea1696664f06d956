"""One config-driven decoder-only transformer (Gemma 3, Llama, Qwen2) and the schema of its parameters."""

_EXPORTS = ("decoder_layer", "forward", "init_params", "lm_head", "param_shapes")
__all__ = list(_EXPORTS)


def __getattr__(name):
  # Lazy: sharding and quant import models.schema, and the transformer imports them; loading it here would close
  # that loop whenever one of them is imported first.
  if name in _EXPORTS:
    from spec_jax.models import transformer
    return getattr(transformer, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
