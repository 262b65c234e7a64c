"""The scheduler core: plain Python, no MLX (the batch's bookkeeping, the model pool, memory estimates, failed-step recovery, the runner protocol)."""
