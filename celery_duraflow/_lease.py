"""Who owns a run right now: lease owner identities and the heartbeat that renews them.

An attempt owns its run through a lease: an owner string and an expiry time
on the run's row. Every write an attempt makes is fenced on still holding that
lease, so an attempt that lost it can no longer record anything. A heartbeat
thread renews the leases of the attempts running in this process, so a lease
can be short (tens of seconds) and a run whose process was killed resumes
within about one lease.

Owner strings look like ``host|machine|pid|token``. ``machine`` identifies
one running kernel and PID namespace (boot id and namespace inode on Linux),
so "same machine, process gone" can be decided safely and the run taken over
at once; everywhere else a takeover waits for the lease to expire.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._store import Store

logger = logging.getLogger("celery_duraflow.lease")

_machine_id: str | None = None


def machine_id() -> str:
    """An identity of this kernel and PID namespace; empty when it cannot be known."""
    global _machine_id
    if _machine_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            namespace = os.stat("/proc/self/ns/pid").st_ino
            _machine_id = f"{boot}:{namespace}"
        except OSError:
            _machine_id = ""
    return _machine_id


def new_owner() -> str:
    """A fresh owner identity for one attempt: host, machine, process, 12 random hex digits."""
    pid = os.getpid()
    if _owner_prefix[0] != pid:  # once per process (a forked worker child is another)
        host = socket.gethostname().replace("|", "_")[:80]
        _owner_prefix[:] = [pid, f"{host}|{machine_id()}|{pid}|"]
    return f"{_owner_prefix[1]}{os.urandom(6).hex()}"


# The process the owner prefix was made in, and the prefix.
_owner_prefix: list[object] = [None, ""]


def owner_is_gone(owner: str | None) -> bool:
    """True only when ``owner`` was a process on this machine that no longer exists."""
    if not owner:
        return False
    parts = owner.split("|")
    if len(parts) != 4:
        return False
    _host, machine, pid_text, _token = parts
    if not machine or machine != machine_id():
        return False
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    if pid == os.getpid():
        # This process: the owner is another attempt in it, alive by definition.
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    # The pid exists; a zombie (killed, not yet reaped by its parent) is gone too.
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


_IDLE = 1.0


def _beat(store: Store) -> float:
    """How often a lease of this store is renewed: three times per lease."""
    return max(0.2, store.config.lease_seconds / 3)


@dataclass
class _Held:
    owner: str
    count: int = 1


class LeaseKeeper:
    """Renews, from one daemon thread per process, the leases held by running attempts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (store, task id) -> the owner and how many attempts of this process hold it
        # (more than one only for an eager retry nested in its caller's attempt).
        self._held: dict[tuple[Store, str], _Held] = {}
        self._lost: set[tuple[str, str]] = set()
        # Leases whose run was asked to stop (cancel()): seen when renewing.
        self._unwinding: set[tuple[str, str]] = set()
        self._wake = threading.Event()
        # How long the thread is currently sleeping between renewals.
        self._waiting = _IDLE
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def hold(self, store: Store, task_id: str, owner: str) -> None:
        with self._lock:
            self._ensure_thread()
            entry = self._held.get((store, task_id))
            if entry is not None and entry.owner == owner:
                entry.count += 1
            else:
                self._held[(store, task_id)] = _Held(owner)
            if _beat(store) < self._waiting:
                # The thread sleeps longer than this lease allows: make it start over.
                self._wake.set()

    def release(self, store: Store, task_id: str, owner: str) -> None:
        with self._lock:
            entry = self._held.get((store, task_id))
            if entry is None or entry.owner != owner:
                return
            entry.count -= 1
            if entry.count <= 0:
                del self._held[(store, task_id)]
                self._lost.discard((task_id, owner))
                self._unwinding.discard((task_id, owner))

    def lost(self, task_id: str, owner: str) -> bool:
        """True once a renewal found the lease held by someone else."""
        return (task_id, owner) in self._lost

    def cancelled(self, task_id: str, owner: str) -> bool:
        """True once a renewal found that the run was asked to stop."""
        return (task_id, owner) in self._unwinding

    def _ensure_thread(self) -> None:
        if self._pid != os.getpid():
            # Forked: the parent's thread does not exist here, nor do its leases.
            self._held.clear()
            self._lost.clear()
            self._unwinding.clear()
            self._thread = None
            self._pid = os.getpid()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="duraflow-lease-keeper",
                                            daemon=True)
            self._thread.start()

    def renew_now(self) -> None:
        """Renew every held lease once (the thread's loop body; also for tests)."""
        with self._lock:
            by_store: dict[Store, list[tuple[str, str]]] = {}
            for (store, task_id), entry in self._held.items():
                by_store.setdefault(store, []).append((task_id, entry.owner))
        for store, leases in by_store.items():
            try:
                kept = store.renew_leases(leases)
            except Exception:
                # The database may be down for a moment; the next beat tries again.
                logger.warning("could not renew %d run lease(s)", len(leases), exc_info=True)
                continue
            with self._lock:
                for lease in leases:
                    if lease not in kept and (store, lease[0]) in self._held:
                        # The attempt says so (LeaseLost, logged once) when it stops.
                        logger.info("task %s: its lease is held by another owner now; the "
                                    "attempt stops at its next write", lease[0])
                        self._lost.add(lease)
                    elif kept.get(lease) == "cancel":
                        self._unwinding.add(lease)

    def _loop(self) -> None:
        last = time.monotonic()
        while True:
            with self._lock:
                beats = [_beat(store) for store, _ in self._held]
                self._waiting = min(beats) if beats else _IDLE
            due = last + self._waiting
            now = time.monotonic()
            if now < due:
                # Woken early when a lease that needs renewing sooner arrives.
                if self._wake.wait(due - now):
                    self._wake.clear()
                continue
            self.renew_now()
            last = time.monotonic()


_keeper: LeaseKeeper | None = None
_keeper_lock = threading.Lock()


def keeper() -> LeaseKeeper:
    """The process's :class:`LeaseKeeper`."""
    global _keeper
    if _keeper is None:
        with _keeper_lock:
            if _keeper is None:
                _keeper = LeaseKeeper()
    return _keeper

