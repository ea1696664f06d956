"""The load matrix: baseline against speculative arms on serve.server under real concurrency (python -m serve.loadtest)."""
