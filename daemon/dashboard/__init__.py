"""The live dashboard: one page at ``/`` served by the daemon, working offline.

The page is ``index.html``, ``app.js`` and ``style.css`` (plain script and SVG charts
written here, nothing fetched from elsewhere); ``routes.py`` serves it and
the JSON it polls (``GET /v1/dashboard``), and the operator's load / unload of a model;
``terminal.py`` prints the same summary for ``mlxd status``. The samples and recent
requests come from ``daemon/history.py``.
"""

from mlxd.daemon.dashboard.routes import PAGE_PATHS, install

__all__ = ["PAGE_PATHS", "install"]
