"""Anthropic Messages API (stub while being written)."""


def install(app, pipeline, v, ready) -> None:
    pass
