"""Where a model comes from and how it loads: the composition root (``load``), model sources, GGUF conversion."""
