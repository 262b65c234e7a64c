"""``python -m mlxd.scripts.bench``: the benchmark ``mlxd bench`` runs (``daemon/bench.py``),
with the same flags, e.g. ``--url http://127.0.0.1:8000 --concurrency 1,8,32``."""

from __future__ import annotations

import sys

from mlxd.daemon.bench import main

if __name__ == "__main__":
    sys.exit(main())
