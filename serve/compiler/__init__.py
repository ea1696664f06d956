"""Ahead-of-time compilation for chips this host lacks (TPU through libtpu, GPU through XLA:GPU): the programs at a
model's shape, their memory and cost analysis, the per-role cost breakdown and the CI cost guard (python -m
serve.aot). Imports serve.jobs (cost tables), spec_jax, and from train/ only the trainer-step programs it compiles.
"""
