"""The load matrix: baseline against speculative arms on serve.server under concurrency (python -m serve.loadtest)."""
