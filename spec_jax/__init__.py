"""spec_jax: speculative decoding for JAX, exact by construction and measured before it is trusted."""
