"""What the command-line jobs share: the run flags, building a loop and its proposer from them (setup), the prompt
sets, the baseline-against-speculative runner and its timing, the per-step cost tables. Imports only spec_jax.
"""
