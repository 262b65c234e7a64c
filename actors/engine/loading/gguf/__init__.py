"""GGUF files: the bounds-checked header reader, architectures in mlx-lm terms, tensors, tokenizers, conversion."""
