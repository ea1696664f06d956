"""One config-driven decoder-only transformer (Gemma 3, Llama, Qwen2) and the schema of its parameters.

The package holds no names itself: import spec_jax.models.transformer (the forward) or spec_jax.models.schema (the
parameter table sharding and quant read, below the transformer)."""
