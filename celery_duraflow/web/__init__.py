"""A small web view of the recorded runs and the durable schedules.

Approve and reject waiting runs, cancel and retry runs, and pause, resume and
backfill schedules.

::

    from celery_duraflow.web import create_app, serve

    serve(app, token=os.environ["DURAFLOW_WEB_TOKEN"])   # http://127.0.0.1:8765/

or ``celery -A proj duraflow web --token ...``. Without a token the view is
read-only; a token that is empty, a placeholder or shorter than 16 characters
is refused. It answers only requests whose ``Host`` is a loopback name, the
address it listens on or a name given in ``allowed_hosts`` (``--allowed-host``),
serves under ``url_prefix`` (``--url-prefix``) behind a reverse proxy that
forwards the prefix, and logging out ends the session in the web process
(restarting it logs everyone out). It needs the ``web`` extra:
``pip install 'celery-duraflow[web]'``.
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
