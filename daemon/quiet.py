"""Library notices that are not the user's business, kept off a command's output.

transformers prints "PyTorch was not found. Models won't be available ..." on stderr the
moment it is imported (mlx-lm imports it for tokenizers), before every ``mlxd`` command's
own output. mlxd never runs PyTorch models, so the notice says nothing to its user. A filter
on transformers' logger drops that one notice; every other warning of the library still
reaches the log. Imported by ``daemon/cli.py`` before anything that imports transformers.
"""

from __future__ import annotations

import logging

# The start of each notice dropped; anything else transformers logs goes through.
NOTICES = ("PyTorch was not found",)


class DropNotices(logging.Filter):
    """Drops a record whose message starts with one of ``NOTICES``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(NOTICES)


def install() -> None:
    """Adds the filter to transformers' root logger, once (it is logged there directly)."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, DropNotices) for f in logger.filters):
        logger.addFilter(DropNotices())


install()
