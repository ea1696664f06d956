"""Command-line generation, evaluation and benchmarks over the spec_jax library."""
