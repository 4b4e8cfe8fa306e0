"""The Starlette application: routes, handlers, and the HTML they render."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode

import anyio
from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from .._format import (
    catchup_note,
    clip,
    next_slot,
    queue_note,
    run_note,
    span,
    unwinding_note,
    waits_for,
    wall_time,
    when,
)
from .._operations import cancel, retry_run
from .._schedules import backfill_schedule, pause_schedule, resume_schedule
from .._serialization import visible
from .._store import (
    CANCELLED,
    COMPENSATED,
    FAILED,
    IGNORED,
    REJECTED,
    RUN_STATUSES,
    SUCCEEDED,
    WAITING,
)
from .._waits import send_signal
from ..errors import (
    DuraflowError,
    InvalidSchedule,
    RunNotFound,
    RunStateError,
    ScheduleNotFound,
    StoreUnavailable,
)
from ._data import (
    MAX_PAGE_SIZE,
    PAGE_SIZE,
    Cursor,
    load_run_page,
    load_runs_page,
    load_schedules_page,
    store_of,
)
from ._security import (
    LOCAL_HOSTS,
    SESSION_COOKIE,
    SESSION_MAX_AGE,
    Guard,
    SecurityHeaders,
    allowed_host_patterns,
    safe_next,
    token_problem,
)

logger = logging.getLogger("celery_duraflow.web")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
#: What a URL prefix may be: one or more path segments of unreserved characters.
_PREFIX = re.compile(r"(?:/[A-Za-z0-9._~-]+)+")
#: The largest request body a form may send.
MAX_BODY = 1024 * 1024
#: Runs that ended this way can be sent again from the run page.
RETRYABLE = (FAILED, CANCELLED, COMPENSATED, IGNORED, REJECTED)

READ_ONLY_REFUSAL = ("This view is read-only: it was started without a token, so nothing can "
                     "be changed from it. Start it with --token (or DURAFLOW_WEB_TOKEN) to "
                     "allow actions.")


def _field(form: FormData, name: str) -> str:
    value = form.get(name)
    return value if isinstance(value, str) else ""


def _visible(value: Any) -> Any:
    """Every ``{{ ... }}`` of the templates goes through this before it is HTML-escaped.

    Text read from the store may hold a bidi override, a control character or
    a lone surrogate (a row of an older version, or written by hand): escaped
    (:func:`~celery_duraflow._serialization.visible`), it is seen where it
    stands, cannot reorder what is around it, and the page can always be
    encoded. Markup is the templates' own HTML, made of values that came
    through here already.
    """
    if value is None or isinstance(value, int | float | Markup):
        return value
    return visible(value if isinstance(value, str) else str(value), lines=True)


def _compact(payload: Any, limit: int = 200) -> str:
    return clip(json.dumps(payload, ensure_ascii=False), limit)


def _moment(text: str, what: str) -> datetime:
    """A backfill form's time: ISO 8601, read as UTC unless it names its offset (the
    browser's date and time field sends none, and the form says UTC)."""
    text = text.strip()
    if not text:
        raise ValueError(f"give the {what} time, such as 2026-06-01T00:00 (UTC)")
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"the {what} time {text!r} is not a date and time such as "
                         "2026-06-01T00:00 (UTC)") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


def _gone(name: str, what: str) -> str:
    return (f"No schedule named {name!r} is stored (it may have just been removed), so "
            f"nothing was {what}.")


class _Handlers:
    """The handlers of one app, sharing its Celery app, its guard and its templates."""

    def __init__(self, celery_app: Any, guard: Guard, prefix: str) -> None:
        self.celery_app = celery_app
        self.guard = guard
        self.prefix = prefix
        self.env = Environment(loader=PackageLoader("celery_duraflow.web", "templates"),
                               autoescape=True, undefined=StrictUndefined,
                               trim_blocks=True, lstrip_blocks=True, finalize=_visible)
        # The display helpers the CLI uses too (celery_duraflow._format).
        self.env.globals.update(when=when, span=span, waits_for=waits_for, run_note=run_note,
                                queue_note=queue_note,
                                unwinding_note=unwinding_note, statuses=RUN_STATUSES,
                                retryable=RETRYABLE, catchup_note=catchup_note,
                                next_slot=next_slot, wall_time=wall_time)
        self.css = (resources.files("celery_duraflow.web") / "static" / "duraflow.css"
                    ).read_bytes()

    # -- plumbing ----------------------------------------------------------------------------

    def root(self, request: Request) -> str:
        """The path every URL of the app starts with (no trailing slash): mount + prefix."""
        return str(request.scope.get("root_path", "")).rstrip("/") + self.prefix

    def run_url(self, request: Request, task_id: str, **query: str) -> str:
        url = f"{self.root(request)}/runs/{quote(task_id, safe='')}"
        return f"{url}?{urlencode(query)}" if query else url

    def schedule_url(self, request: Request, name: str) -> str:
        """Where the actions of schedule ``name`` are posted (``<url>/pause``...)."""
        return f"{self.root(request)}/schedules/{quote(name, safe='')}"

    def session(self, request: Request) -> str | None:
        """The visitor's session cookie if it is valid, else None."""
        cookie = request.cookies.get(SESSION_COOKIE)
        return cookie if self.guard.session_valid(cookie) else None

    def login_first(self, request: Request) -> Response | None:
        """A redirect to the login page for a visitor who must log in, else None."""
        if self.guard.read_only or self.session(request) is not None:
            return None
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"{self.root(request)}/login?{urlencode({'next': target})}",
                                status_code=303)

    def render(self, request: Request, template: str, status_code: int = 200,
               **context: Any) -> HTMLResponse:
        session = self.session(request)
        root = self.root(request)
        html = self.env.get_template(template).render(
            root=root,
            read_only=self.guard.read_only,
            logged_in=session is not None,
            can_act=session is not None,
            csrf=self.guard.csrf_for(session) if session is not None else "",
            run_url=lambda task_id, **query: self.run_url(request, task_id, **query),
            schedule_url=lambda name: self.schedule_url(request, name),
            **context,
        )
        return HTMLResponse(html, status_code=status_code)

    async def action_form(self, request: Request) -> FormData:
        """The form of a POST that changes something, once the visitor may send it."""
        if self.guard.read_only:
            raise HTTPException(403, READ_ONLY_REFUSAL)
        cookie = request.cookies.get(SESSION_COOKIE)
        if not self.guard.session_valid(cookie):
            raise HTTPException(403, "Log in first: this action needs a session, and the "
                                     "request has none (or it expired).")
        await self.check_size(request)
        form = await request.form()
        if not self.guard.csrf_valid(cookie, _field(form, "csrf")):
            raise HTTPException(403, "The form's CSRF field is missing or does not match this "
                                     "session, so nothing was done. Reload the page and try "
                                     "again.")
        return form

    @staticmethod
    async def check_size(request: Request) -> None:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY:
            raise HTTPException(413, "The form is too large.")

    def back(self, request: Request, task_id: str, text: str, tone: str = "ok") -> Response:
        """Redirect to the run page, carrying a signed note about what was done."""
        signature = self.guard.sign_note(task_id, tone, text)
        return RedirectResponse(self.run_url(request, task_id, note=text, tone=tone,
                                             sig=signature), status_code=303)

    def note(self, request: Request, task_id: str) -> tuple[str, str] | None:
        """The note in the address, if this app wrote it for this run."""
        params = request.query_params
        text, tone, signature = params.get("note"), params.get("tone"), params.get("sig")
        if not text or tone not in ("ok", "error") or not signature:
            return None
        if not self.guard.note_valid(task_id, tone, text, signature):
            return None
        return text, tone

    def back_to_schedules(self, request: Request, text: str, tone: str = "ok") -> Response:
        """Redirect to the schedules page, carrying a signed note about what was done."""
        signature = self.guard.sign_page_note("schedules", tone, text)
        query = urlencode({"note": text, "tone": tone, "sig": signature})
        return RedirectResponse(f"{self.root(request)}/schedules?{query}", status_code=303)

    def page_note(self, request: Request, page: str) -> tuple[str, str] | None:
        """The note in the address, if this app wrote it for ``page``."""
        params = request.query_params
        text, tone, signature = params.get("note"), params.get("tone"), params.get("sig")
        if not text or tone not in ("ok", "error") or not signature:
            return None
        if not self.guard.page_note_valid(page, tone, text, signature):
            return None
        return text, tone

    # -- pages -------------------------------------------------------------------------------

    async def runs(self, request: Request) -> Response:
        redirect = self.login_first(request)
        if redirect is not None:
            return redirect
        params = request.query_params
        status = params.get("status") or None
        if status is not None and status not in RUN_STATUSES:
            raise HTTPException(400, f"Unknown status {status!r}: use one of "
                                     f"{', '.join(RUN_STATUSES)}.")
        task_name = (params.get("task") or "").strip() or None
        raw_limit = params.get("limit") or str(PAGE_SIZE)
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_PAGE_SIZE:
            raise HTTPException(400, f"'limit' must be a whole number from 1 to {MAX_PAGE_SIZE}.")
        limit = int(raw_limit)
        try:
            cursor = Cursor.parse(params.get("before"), params.get("before_id"))
        except ValueError as exc:
            raise HTTPException(400, f"This page address is not valid ({exc}).") from None
        page = await run_in_threadpool(load_runs_page, store_of(self.celery_app), status=status,
                                       task_name=task_name, cursor=cursor, limit=limit)

        def link(**changes: Any) -> str:
            query = {"status": status, "task": task_name,
                     "limit": str(limit) if limit != PAGE_SIZE else None}
            query.update(changes)
            kept = {key: value for key, value in query.items() if value}
            return f"{self.root(request)}/" + (f"?{urlencode(kept)}" if kept else "")

        next_link = link(**page.next_cursor.params()) if page.next_cursor else None
        return self.render(request, "runs.html", page=page, status=status, task_name=task_name,
                           total=page.counts.total, link=link, next_link=next_link,
                           first_page=cursor is None)

    async def run(self, request: Request) -> Response:
        redirect = self.login_first(request)
        if redirect is not None:
            return redirect
        return await self.run_response(request, request.path_params["task_id"])

    async def run_response(self, request: Request, task_id: str, *, status_code: int = 200,
                           note: tuple[str, str] | None = None,
                           payload_text: str = "") -> Response:
        page = await run_in_threadpool(load_run_page, self.celery_app, task_id)
        if page is None:
            raise HTTPException(404, f"No run with task id {task_id!r} is recorded.")
        return self.render(request, "run.html", status_code=status_code, page=page,
                           run=page.view, note=note or self.note(request, task_id),
                           payload_text=payload_text)

    async def schedules(self, request: Request) -> Response:
        redirect = self.login_first(request)
        if redirect is not None:
            return redirect
        return await self.schedules_response(request)

    async def schedules_response(self, request: Request, *, status_code: int = 200,
                                 note: tuple[str, str] | None = None,
                                 typed: dict[str, dict[str, str]] | None = None) -> Response:
        items = await run_in_threadpool(load_schedules_page, self.celery_app)
        return self.render(request, "schedules.html", status_code=status_code, items=items,
                           note=note or self.page_note(request, "schedules"),
                           typed=typed or {})

    async def stylesheet(self, request: Request) -> Response:
        return Response(self.css, media_type="text/css",
                        headers={"Cache-Control": "public, max-age=3600"})

    # -- logging in and out ------------------------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        root = self.root(request)
        target = safe_next(request.query_params.get("next"), root)
        if self.guard.read_only or self.session(request) is not None:
            return RedirectResponse(target, status_code=303)
        return self.render(request, "login.html", next=target, error=None)

    async def login(self, request: Request) -> Response:
        if self.guard.read_only:
            raise HTTPException(403, READ_ONLY_REFUSAL)
        await self.check_size(request)
        form = await request.form()
        target = safe_next(_field(form, "next"), self.root(request))
        if not self.guard.token_matches(_field(form, "token")):
            await anyio.sleep(self.guard.failure_delay())
            return self.render(request, "login.html", status_code=403, next=target,
                               error="That is not the token this view was started with.")
        # A session the browser already had ends: one browser, one live session.
        self.guard.revoke(request.cookies.get(SESSION_COOKIE))
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(SESSION_COOKIE, self.guard.new_session(), max_age=SESSION_MAX_AGE,
                            path=f"{self.root(request)}/", httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response

    async def logout(self, request: Request) -> Response:
        await self.action_form(request)
        # Forget the session here, not only in this browser: a copy of the cookie is dead too.
        self.guard.revoke(request.cookies.get(SESSION_COOKIE))
        root = self.root(request)
        response = RedirectResponse(f"{root}/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path=f"{root}/", httponly=True,
                               samesite="strict", secure=request.url.scheme == "https")
        return response

    # -- actions -----------------------------------------------------------------------------

    async def approve(self, request: Request) -> Response:
        form = await self.action_form(request)
        return await self.send(request, form, {"approved": True}, "Approved")

    async def reject(self, request: Request) -> Response:
        form = await self.action_form(request)
        return await self.send(request, form, {"approved": False}, "Rejected")

    async def signal(self, request: Request) -> Response:
        form = await self.action_form(request)
        text = _field(form, "payload")
        try:
            if not text.strip():
                raise ValueError("the payload is empty")
            payload = json.loads(text)
        except ValueError as exc:
            task_id = request.path_params["task_id"]
            message = (f"Nothing was sent: the payload is not valid JSON ({exc}). Type a JSON "
                       'value, such as {"approved": true, "note": "ok"}.')
            return await self.run_response(request, task_id, status_code=400,
                                           note=(message, "error"), payload_text=text)
        return await self.send(request, form, payload, "Sent")

    async def send(self, request: Request, form: FormData, payload: Any, done: str) -> Response:
        """Send the signal the run waits for, if it still waits for the one on the page."""
        task_id = request.path_params["task_id"]
        name = _field(form, "signal")
        record = await run_in_threadpool(store_of(self.celery_app).get_run, task_id)
        if record is None:
            raise HTTPException(404, f"No run with task id {task_id!r} is recorded.")
        if not (record.status == WAITING and record.wait_kind == "signal"
                and record.waiting_for == name):
            return self.back(request, task_id, f"Nothing was sent: the run no longer waits for "
                                               f"signal {name!r}.", "error")
        try:
            stored = await run_in_threadpool(send_signal, task_id, name, payload,
                                             app=self.celery_app)
        except RunNotFound:
            raise HTTPException(404, f"No run with task id {task_id!r} is recorded.") from None
        if not stored:
            return self.back(request, task_id, f"Signal {name!r} had already been sent, so this "
                                               "one was ignored: a run gets the first payload "
                                               "sent under a name.", "error")
        return self.back(request, task_id,
                         f"{done}: signal {name!r} sent with payload {_compact(payload)}.")

    async def cancel(self, request: Request) -> Response:
        await self.action_form(request)
        task_id = request.path_params["task_id"]
        try:
            requested = await run_in_threadpool(cancel, task_id, app=self.celery_app)
        except RunNotFound:
            raise HTTPException(404, f"No run with task id {task_id!r} is recorded.") from None
        if not requested:
            return self.back(request, task_id, "The run had already ended: nothing to cancel.",
                             "error")
        return self.back(request, task_id, "Cancellation requested: the run stops at its next "
                                           "step (at once if it sleeps or waits), the steps it "
                                           "completed are compensated, and it ends cancelled.")

    async def retry(self, request: Request) -> Response:
        form = await self.action_form(request)
        task_id = request.path_params["task_id"]
        from_step = _field(form, "from_step") or None
        record = await run_in_threadpool(store_of(self.celery_app).get_run, task_id)
        if record is None:
            raise HTTPException(404, f"No run with task id {task_id!r} is recorded.")
        if record.status not in RETRYABLE and not (record.status == SUCCEEDED and from_step):
            return self.back(request, task_id, f"The run is {record.status}: only a run that "
                                               "failed, was cancelled or was compensated is "
                                               "retried from here (a succeeded one from a "
                                               "named step).", "error")
        try:
            await run_in_threadpool(retry_run, task_id, from_step=from_step, app=self.celery_app)
        except RunStateError as exc:
            return self.back(request, task_id, f"Not retried: {exc}", "error")
        except RunNotFound:
            raise HTTPException(404, f"No run with task id {task_id!r} is recorded.") from None
        start = f"from step {from_step!r}" if from_step else "replaying its recorded steps"
        return self.back(request, task_id, f"Sent again under the same task id, {start}.")

    async def schedule_pause(self, request: Request) -> Response:
        form = await self.action_form(request)
        name = request.path_params["name"]
        note = _field(form, "note").strip() or None
        try:
            await run_in_threadpool(pause_schedule, name, note=note, app=self.celery_app)
        except ScheduleNotFound:
            return self.back_to_schedules(request, _gone(name, "paused"), "error")
        why = f" ({note})" if note else ""
        return self.back_to_schedules(request, f"Paused {name!r}{why}: none of its slots "
                                               "fires until it is resumed.")

    async def schedule_resume(self, request: Request) -> Response:
        await self.action_form(request)
        name = request.path_params["name"]
        try:
            schedule = await run_in_threadpool(resume_schedule, name, app=self.celery_app)
        except ScheduleNotFound:
            return self.back_to_schedules(request, _gone(name, "resumed"), "error")
        return self.back_to_schedules(
            request, f"Resumed {name!r}: its next slot is {when(next_slot(schedule))} UTC. "
                     "The slots it was paused over stay unfired; backfill them to run them.")

    async def schedule_backfill(self, request: Request) -> Response:
        form = await self.action_form(request)
        name = request.path_params["name"]
        typed = {"start": _field(form, "start"), "end": _field(form, "end")}
        try:
            start, end = _moment(typed["start"], "from"), _moment(typed["end"], "to")
        except ValueError as exc:
            return await self.schedules_response(
                request, status_code=400, typed={name: typed},
                note=(f"Nothing was backfilled for {name!r}: {exc}.", "error"))
        try:
            sent = await run_in_threadpool(backfill_schedule, name, start, end,
                                           app=self.celery_app)
        except ScheduleNotFound:
            return self.back_to_schedules(request, _gone(name, "backfilled"), "error")
        except InvalidSchedule as exc:
            return self.back_to_schedules(request, f"Not backfilled: {exc}", "error")
        where = (f"Backfill of {name!r} from {when(start.astimezone(UTC))} to "
                 f"{when(end.astimezone(UTC))} UTC")
        if not sent:
            return self.back_to_schedules(request, f"{where}: every slot had a run already "
                                                   "(or the range holds none); nothing was "
                                                   "sent.")
        return self.back_to_schedules(request, f"{where}: {len(sent)} run(s) sent, one for "
                                               "each slot that had none.")

    # -- errors ------------------------------------------------------------------------------

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        titles = {400: "Bad request", 403: "Not allowed", 404: "Not found",
                  405: "Method not allowed", 413: "Too large"}
        response = self.render(request, "error.html", status_code=exc.status_code,
                               title=titles.get(exc.status_code, "Error"), message=exc.detail)
        response.headers.update(exc.headers or {})
        return response

    async def store_error(self, request: Request, exc: Exception) -> Response:
        unavailable = isinstance(exc, StoreUnavailable)
        return self.render(request, "error.html", status_code=503 if unavailable else 500,
                           title="The step store cannot be read" if unavailable else "Error",
                           message=str(exc))


def check_options(*, token: str | None = None, allowed_hosts: Iterable[str] = (),
                  url_prefix: str = "") -> tuple[list[str], str]:
    """Check the options of :func:`create_app`; return the Host patterns and the URL prefix.

    Raises ValueError, with a message that says what to give instead, for a
    token that is empty, a placeholder or shorter than 16 characters, a host
    name that cannot be one (or is ``*``), or a prefix that is not a plain path.
    """
    if token is not None:
        problem = token_problem(token)
        if problem is not None:
            raise ValueError(problem)
    patterns = allowed_host_patterns([*LOCAL_HOSTS, *allowed_hosts])
    return patterns, _normalize_prefix(url_prefix)


def _normalize_prefix(url_prefix: str) -> str:
    """``/duraflow`` for ``duraflow``, ``/duraflow/`` or ``/duraflow``; ``""`` for ``/``."""
    prefix = url_prefix.strip()
    if prefix in ("", "/"):
        return ""
    if not prefix.startswith("/"):
        prefix = "/" + prefix
    prefix = prefix.rstrip("/")
    if _PREFIX.fullmatch(prefix) is None or any(
            part in (".", "..") for part in prefix.split("/")):
        raise ValueError(f"url prefix {url_prefix!r} is not a plain path: give one such as "
                         "/duraflow (segments of letters, digits, '.', '_', '~' and '-', "
                         "separated by '/')")
    return prefix


def create_app(celery_app: Any, *, token: str | None = None,
               allowed_hosts: Iterable[str] = (), url_prefix: str = "") -> Starlette:
    """The web view of the runs stored for ``celery_app``, as an ASGI application.

    Without ``token`` it is read-only: anyone who can reach it can read every
    run and schedule, and every POST is refused with 403. With a token, visitors
    must log in with it before they see anything, and may then approve or reject
    waiting runs, send signals, cancel and retry, and pause, resume and backfill
    schedules (the schedules page, ``/schedules``). A token that is empty, a placeholder
    or shorter than 16 characters is refused with ValueError. Logging out ends
    the session in this process (see :mod:`celery_duraflow.web._security`).

    Only requests whose ``Host`` header names ``localhost``, ``127.0.0.1``,
    ``[::1]`` or one of ``allowed_hosts`` (with any port) are answered; any
    other gets a plain-text 400 before a handler runs, whatever the route. A
    name given as ``.example.com`` allows the domain and its subdomains,
    ``*.example.com`` the subdomains only.

    ``url_prefix`` (say ``/duraflow``) puts every route, link, form, redirect,
    the cookie's path and the stylesheet under that path, for a reverse proxy
    that forwards the prefix unchanged (nginx: ``location /duraflow/ {
    proxy_pass http://127.0.0.1:8765; }``). Mounted inside another ASGI app,
    the mount's ``root_path`` comes first.
    """
    patterns, prefix = check_options(token=token, allowed_hosts=allowed_hosts,
                                     url_prefix=url_prefix)
    handlers = _Handlers(celery_app, Guard(token), prefix)
    actions = ("approve", "reject", "signal", "cancel", "retry")
    routes = [
        Route(f"{prefix}/", handlers.runs, methods=["GET"], name="runs"),
        *(Route(f"{prefix}/runs/{{task_id:path}}/{action}", getattr(handlers, action),
                methods=["POST"], name=action) for action in actions),
        Route(f"{prefix}/runs/{{task_id:path}}", handlers.run, methods=["GET"], name="run"),
        Route(f"{prefix}/schedules", handlers.schedules, methods=["GET"], name="schedules"),
        *(Route(f"{prefix}/schedules/{{name:path}}/{action}",
                getattr(handlers, f"schedule_{action}"), methods=["POST"],
                name=f"schedule_{action}") for action in ("pause", "resume", "backfill")),
        Route(f"{prefix}/login", handlers.login_page, methods=["GET"], name="login_page"),
        Route(f"{prefix}/login", handlers.login, methods=["POST"], name="login"),
        Route(f"{prefix}/logout", handlers.logout, methods=["POST"], name="logout"),
        Route(f"{prefix}/static/duraflow.css", handlers.stylesheet, methods=["GET"],
              name="css"),
    ]
    middleware = [
        # Outermost, so that the refusal of a foreign Host carries the same headers.
        Middleware(SecurityHeaders),
        Middleware(TrustedHostMiddleware, allowed_hosts=patterns, www_redirect=False),
    ]
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: handlers.http_error,
                                         DuraflowError: handlers.store_error})


def serve(celery_app: Any, *, host: str = "127.0.0.1", port: int = 8765,
          token: str | None = None, allowed_hosts: Iterable[str] = (),
          url_prefix: str = "") -> None:
    """Serve :func:`create_app` with uvicorn until interrupted (Ctrl-C).

    It listens on the loopback interface unless ``host`` says otherwise;
    put it behind a proxy that adds TLS before exposing it further. The
    ``host`` address is an allowed Host besides the loopback names and
    ``allowed_hosts``. Raises ValueError for the options :func:`create_app`
    refuses (a placeholder or short token, say) before listening.
    """
    import uvicorn

    hosts = (host, *allowed_hosts) if host else tuple(allowed_hosts)
    application = create_app(celery_app, token=token, allowed_hosts=hosts,
                             url_prefix=url_prefix)
    if host not in LOOPBACK_HOSTS:
        if token is None:
            logger.warning("serving the runs read-only on %s without a token: anyone who can "
                           "reach port %d can read every run's arguments and outputs", host, port)
        else:
            logger.warning("serving on %s over plain HTTP: put a proxy with TLS in front, or "
                           "the token and the session cookie travel in the clear", host)
    config = uvicorn.Config(application, host=host, port=port,
                            ws="none", lifespan="off", log_level="info",
                            proxy_headers=False, server_header=False)
    uvicorn.Server(config).run()
