"""Who may see and change what: Host names, the token, sessions, CSRF fields, signed notes.

Every request must name an allowed host in its ``Host`` header (the loopback
names, the address the view listens on, and any name given with
``--allowed-host``); any other is answered 400 before a handler runs, so a page
on another site that rebinds its DNS name to this address reads nothing.

With no token the view is read-only: every page can be read and every POST
is refused. With a token, a visitor types it once on the login page and gets
a session cookie. The cookie never holds the token: it holds when it was
issued, a random session id and an HMAC of both keyed by a key derived from
the token, so changing the token ends every session. Each form carries a CSRF
field, an HMAC of the session cookie under the same key, which a page on
another site cannot know.

A signature alone does not make a session: the guard keeps the ids of the
sessions it issued in memory, and logging out removes the id, so a copy of the
cookie kept after logging out opens nothing. That table belongs to one web
process: restarting the process logs everyone out, and an app served by several
processes behind one address would know only its own sessions (``serve()`` and
``celery duraflow web`` run one). It holds at most ``MAX_SESSIONS`` sessions;
beyond that the oldest is logged out.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from ipaddress import AddressValueError, IPv6Address

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SESSION_COOKIE = "duraflow_session"
#: How long a login lasts, in seconds.
SESSION_MAX_AGE = 12 * 3600
#: Pause after a wrong token, so that guessing it is slow.
FAILED_LOGIN_DELAY = 0.5
#: The most sessions one web process keeps; a new login beyond it logs out the oldest.
MAX_SESSIONS = 1000
#: Tokens shorter than this are refused.
MIN_TOKEN_LENGTH = 16
#: Tokens that are someone's placeholder, compared in lower case without punctuation.
PLACEHOLDER_TOKENS = frozenset({
    "changeme", "changemetoalongrandomstring", "secret", "token", "password", "duraflow",
    "celeryduraflow", "duraflowwebtoken", "admin", "example", "test",
})
#: A placeholder anywhere in a token gives it away ("please-change-me-0123...").
PLACEHOLDER_PARTS = ("changeme", "replaceme", "yourtoken", "placeholder", "randomstring")
#: Host names every view answers to, whatever it listens on.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "|".join(parts).encode("utf-8"), hashlib.sha256).hexdigest()


def token_problem(token: str) -> str | None:
    """Why ``token`` must not protect the view (empty, a placeholder, too short), or None."""
    advice = ("use a long random one, such as the output of `python -c 'import secrets; "
              "print(secrets.token_urlsafe())'`, or give no token at all for a read-only view")
    if not token.strip():
        return f"the web token is empty: {advice}"
    plain = "".join(ch for ch in token.lower() if ch.isalnum())
    if plain in PLACEHOLDER_TOKENS or any(part in plain for part in PLACEHOLDER_PARTS):
        return f"the web token is a placeholder that anyone can read: {advice}"
    if len(token.strip()) < MIN_TOKEN_LENGTH:
        return f"the web token is shorter than {MIN_TOKEN_LENGTH} characters: {advice}"
    return None


_LABEL = r"[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


def allowed_host_patterns(names: Iterable[str]) -> list[str]:
    """The patterns for Starlette's ``TrustedHostMiddleware`` that allow ``names``.

    A name is a host name or an IP address, without a port (the port is not
    checked). ``.example.com`` allows example.com and every subdomain of it,
    ``*.example.com`` the subdomains only. ``*`` (every host) is refused: it
    would let any site that points its name at this address read the view.
    Raises ValueError for a name that cannot be a Host.
    """
    patterns: list[str] = []
    for given in names:
        name = given.strip().lower()
        wildcard = ""
        if name.startswith("*."):
            wildcard, name = "*.", name[2:]
        elif name.startswith("."):
            wildcard, name = ".", name[1:]
        problem = _host_name_problem(name)
        if problem is not None:
            raise ValueError(f"allowed host {given!r} {problem}; give a host name or an IP "
                             "address without a port, such as ops.example.com, 10.0.0.5, "
                             "[::1], or .example.com for a domain and its subdomains")
        if ":" in name and not name.startswith("["):
            name = f"[{name}]"
        candidates = [name, f"*.{name}"] if wildcard == "." else [wildcard + name]
        patterns += [pattern for pattern in candidates if pattern not in patterns]
    return patterns


def _host_name_problem(name: str) -> str | None:
    if not name or name == "*":
        return "would allow every Host" if name == "*" else "is empty"
    if "*" in name:
        return "may only start with '*.' or '.'"
    if ":" in name:
        address = name[1:-1] if name.startswith("[") and name.endswith("]") else name
        try:
            IPv6Address(address)
        except AddressValueError:
            return "has a port or is not a host name"
        return None
    if _HOST_NAME.fullmatch(name) is None:
        return "is not a host name"
    return None


class Guard:
    """The token of one app, everything derived from it, and the sessions it issued."""

    def __init__(self, token: str | None, *, max_sessions: int = MAX_SESSIONS) -> None:
        # An empty token (an empty environment variable, say) means no token: read-only.
        self.token = token or None
        secret = (self.token or secrets.token_hex(32)).encode("utf-8")
        self._key = hmac.new(secret, b"celery-duraflow web: session key",
                             hashlib.sha256).digest()
        self._next_failure = 0.0
        self._max_sessions = max_sessions
        #: Live session ids, oldest first, with when each was issued.
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

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
        """A new session's cookie value, recorded as live (dropping expired and excess ones)."""
        moment = int(time.time() if now is None else now)
        issued = str(moment)
        nonce = secrets.token_urlsafe(16)
        with self._lock:
            for old, when in list(self._sessions.items()):
                if moment - when > SESSION_MAX_AGE:
                    del self._sessions[old]
            self._sessions[nonce] = moment
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return f"{issued}.{nonce}.{_mac(self._key, 'session', issued, nonce)}"

    def _session_id(self, cookie: str | None) -> tuple[str, int] | None:
        """The id and issue time a cookie carries, if this guard signed it."""
        if self.token is None or not cookie:
            return None
        parts = cookie.split(".")
        if len(parts) != 3 or not parts[0].isdigit():
            return None
        issued, nonce, mac = parts
        expected = _mac(self._key, "session", issued, nonce)
        if not secrets.compare_digest(mac.encode("ascii", "replace"), expected.encode("ascii")):
            return None
        return nonce, int(issued)

    def session_valid(self, cookie: str | None, now: float | None = None) -> bool:
        """True for a cookie this guard issued, not expired and not logged out."""
        found = self._session_id(cookie)
        if found is None:
            return False
        nonce, issued = found
        age = (time.time() if now is None else now) - issued
        with self._lock:
            live = self._sessions.get(nonce) == issued
        return live and -60 <= age <= SESSION_MAX_AGE

    def revoke(self, cookie: str | None) -> None:
        """End the session of ``cookie`` (logging out): the cookie is refused from now on."""
        found = self._session_id(cookie)
        if found is not None:
            with self._lock:
                self._sessions.pop(found[0], None)

    def live_sessions(self) -> int:
        """How many sessions are in the table (expired ones leave it at the next login)."""
        with self._lock:
            return len(self._sessions)

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

    def sign_page_note(self, page: str, tone: str, text: str) -> str:
        """The signature that lets a note in the address of a page that shows no one run
        (``page`` names it, such as ``schedules``) be shown there; never valid on a run's
        page, nor a run page's note here."""
        return _mac(self._key, "page-note", page, tone, text)

    def page_note_valid(self, page: str, tone: str, text: str, signature: str) -> bool:
        return secrets.compare_digest(signature.encode("ascii", "replace"),
                                      self.sign_page_note(page, tone, text).encode("ascii"))


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
