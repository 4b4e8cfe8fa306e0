"""Who may see and change what: the token, the session cookie, CSRF fields, signed notes.

With no token the view is read-only: every page can be read and every POST
is refused. With a token, a visitor types it once on the login page and gets
a session cookie. The cookie never holds the token: it holds when it was
issued, a random nonce and an HMAC of both keyed by a key derived from the
token, so changing the token ends every session. Each form carries a CSRF
field, an HMAC of the session cookie under the same key, which a page on
another site cannot know.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SESSION_COOKIE = "duraflow_session"
#: How long a login lasts, in seconds.
SESSION_MAX_AGE = 12 * 3600
#: Pause after a wrong token, so that guessing it is slow.
FAILED_LOGIN_DELAY = 0.5

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "|".join(parts).encode("utf-8"), hashlib.sha256).hexdigest()


class Guard:
    """The token of one app and everything derived from it."""

    def __init__(self, token: str | None) -> None:
        # An empty token (an empty environment variable, say) means no token: read-only.
        self.token = token or None
        secret = (self.token or secrets.token_hex(32)).encode("utf-8")
        self._key = hmac.new(secret, b"celery-duraflow web: session key",
                             hashlib.sha256).digest()
        self._next_failure = 0.0

    @property
    def read_only(self) -> bool:
        return self.token is None

    def token_matches(self, typed: str) -> bool:
        if self.token is None:
            return False
        return secrets.compare_digest(typed.encode("utf-8"), self.token.encode("utf-8"))

    def failure_delay(self) -> float:
        """How long to wait before answering a wrong token (failures queue one behind another)."""
        now = time.monotonic()
        start = max(now, self._next_failure)
        self._next_failure = start + FAILED_LOGIN_DELAY
        return self._next_failure - now

    def new_session(self, now: float | None = None) -> str:
        issued = str(int(time.time() if now is None else now))
        nonce = secrets.token_urlsafe(16)
        return f"{issued}.{nonce}.{_mac(self._key, 'session', issued, nonce)}"

    def session_valid(self, cookie: str | None, now: float | None = None) -> bool:
        if self.token is None or not cookie:
            return False
        parts = cookie.split(".")
        if len(parts) != 3 or not parts[0].isdigit():
            return False
        issued, nonce, mac = parts
        expected = _mac(self._key, "session", issued, nonce)
        if not secrets.compare_digest(mac.encode("ascii", "replace"), expected.encode("ascii")):
            return False
        age = (time.time() if now is None else now) - int(issued)
        return -60 <= age <= SESSION_MAX_AGE

    def csrf_for(self, cookie: str) -> str:
        return _mac(self._key, "csrf", cookie)

    def csrf_valid(self, cookie: str | None, field: str | None) -> bool:
        if not self.session_valid(cookie) or not field:
            return False
        assert cookie is not None
        return secrets.compare_digest(field.encode("ascii", "replace"),
                                      self.csrf_for(cookie).encode("ascii"))

    def sign_note(self, task_id: str, tone: str, text: str) -> str:
        """The signature that lets a note in a run page's address be shown on that page."""
        return _mac(self._key, "note", task_id, tone, text)

    def note_valid(self, task_id: str, tone: str, text: str, signature: str) -> bool:
        return secrets.compare_digest(signature.encode("ascii", "replace"),
                                      self.sign_note(task_id, tone, text).encode("ascii"))


def safe_next(target: str | None, root: str) -> str:
    """Where to go after logging in: a path of this app, never another site."""
    home = root + "/"
    if not target or not target.startswith(home) or target.startswith("//"):
        return home
    if "\\" in target or any(ord(ch) < 32 for ch in target):
        return home
    return target


class SecurityHeaders:
    """ASGI middleware adding the same protective headers to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
                headers["X-Content-Type-Options"] = "nosniff"
                headers["X-Frame-Options"] = "DENY"
                headers["Referrer-Policy"] = "same-origin"
                headers["Cross-Origin-Opener-Policy"] = "same-origin"
                if "cache-control" not in headers:
                    headers["Cache-Control"] = "no-store"
            await send(message)

        await self.app(scope, receive, send_with_headers)
