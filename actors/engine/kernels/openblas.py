"""The loaded OpenBLAS's thread count, through OpenBLAS's own C API (Linux CPU backend).

MLX's CPU backend runs every op but matmul on its streams' own threads; OpenBLAS runs a
matmul on its worker threads (one per core by default), which spin between calls. One
stream decoding uses the cores best with OpenBLAS's default (measured on 2 cores: a
SmolLM2 decode step at batch 1 over 1,536 tokens took 90 ms with 2 threads, 122 ms with
1). A prefill chunk split over several MLX streams keeps the cores busy itself, and
there OpenBLAS's spinning workers take cores from the streams' threads (the same chunk
ran 1.3x faster with 1 thread), so the runner lowers the count while such a chunk runs
(``MlxRunner``) and puts it back after.

The count is the process's, and every loaded model's runner shares this one object.
A runner's decode step runs asynchronously on its own stream (mlx-lm's
``BatchGenerator`` evaluates the next step ahead), and the model pool steps the models
in turn, so another model's step may still be running when one model's chunk starts:
every runner's stream is waited for before the count changes.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class OpenBlas:
    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        # runner → the stream its asynchronous work runs on, while the runner lives
        self._streams: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    @classmethod
    @functools.cache
    def loaded(cls) -> OpenBlas | None:
        """OpenBLAS as loaded in this process (``dlopen(NULL)`` sees a preloaded
        library), or None where MLX uses another BLAS (macOS, no ``libopenblas0``).
        One object per process: the thread count it sets is the process's."""
        try:
            lib = ctypes.CDLL(None)
            lib.openblas_get_num_threads.restype = ctypes.c_int
            lib.openblas_set_num_threads.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            return None
        return cls(lib)

    @property
    def threads(self) -> int:
        return int(self._lib.openblas_get_num_threads())

    def set_threads(self, n: int) -> None:
        self._lib.openblas_set_num_threads(max(1, n))

    def watch(self, owner: Any, stream: Any) -> None:
        """``owner`` (a runner) evaluates work on ``stream`` asynchronously: it is waited
        for before the count changes, as long as ``owner`` lives."""
        self._streams[owner] = stream

    def settle(self) -> None:
        """Wait for every watched stream: no matmul is in flight after this."""
        import mlx.core as mx

        for stream in list(self._streams.values()):
            mx.synchronize(stream)

    @contextmanager
    def at_most(self, n: int) -> Iterator[None]:
        """At most ``n`` threads inside the block, the count before it after. Every
        watched stream is waited for before each change; the caller evaluates what it
        starts inside the block before the block ends."""
        before = self.threads
        if n >= before:
            yield
            return
        self.settle()
        self.set_threads(n)
        try:
            yield
        finally:
            self.settle()
            self.set_threads(before)
