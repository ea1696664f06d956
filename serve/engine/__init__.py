"""The serving engine: one thread that owns the decode state and runs continuous batching over the slot table.

engine.py applies every decision; its helpers (admission, the KV scheduler and its block managers, guardrails,
segments, the live A/B, tenants) read what they are given and return decisions; the waiting queue
(request_queue.py) is an object it owns whose methods change only the queue. Imports only spec_jax.
"""
