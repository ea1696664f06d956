"""Loading weights: GGUF (the default Gemma 3 270M), HF safetensors directories, and our own heads."""
