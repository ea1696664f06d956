"""The OpenAI- and vLLM-compatible HTTP layer: request bodies, their validation, routes, streaming and response
shaping. It turns a body into the engine's request and the engine's output into responses; imports serve.engine and
spec_jax only.
"""
