"""Checkpoint I/O, all of it: GGUF through the `gguf` package (`gguf_meta`), safetensors through the `safetensors`
package (`safetensors_io`), the loaders built on them, our draft-head checkpoints (`heads`), the tokenizer model a
GGUF carries (`gguf_tokenizer`), and `load.load_model`, the one entry point for a target."""
