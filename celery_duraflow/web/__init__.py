"""A small web view of the recorded runs, with approve and reject for waiting runs.

::

    from celery_duraflow.web import create_app, serve

    serve(app, token="a long random string")   # http://127.0.0.1:8765/

or ``celery -A proj duraflow web --token ...``. Without a token the view is
read-only. It needs the ``web`` extra: ``pip install 'celery-duraflow[web]'``.
"""

from __future__ import annotations

try:
    import jinja2  # noqa: F401
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on what is installed
    raise ImportError(
        f"the celery-duraflow web view needs the 'web' extra ({exc}): "
        "pip install 'celery-duraflow[web]'"
    ) from exc

from ._app import create_app, serve

__all__ = ["create_app", "serve"]
