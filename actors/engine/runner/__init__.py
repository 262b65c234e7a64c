"""The MLX runners and what they run on: the base runner over mlx-lm's BatchGenerator, the vision runner, batched caches, the prefix cache, sampling, logits processors and row guards."""
