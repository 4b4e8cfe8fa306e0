"""Whether the store's PostgreSQL server would keep what it recorded through a failover.

A step the library saw committed is only as safe as the server that will be
primary after a failover. A standby that streams asynchronously may be behind
when it is promoted: every commit it had not received is gone, and the bodies
of those steps run again, most of them not reported in doubt (their start was
lost with them). The worker reads the server's settings once as it starts and
warns where it can see that risk. It cannot see what a managed service keeps
outside PostgreSQL's own replication, nor a standby of a standby.

Imports only SQLAlchemy; the worker's start-up (``_signals``) calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, text

# Settings of synchronous_commit under which a commit does not wait for any standby.
_NO_STANDBY_WAIT = ("off", "local")


@dataclass(frozen=True)
class Replication:
    """What one PostgreSQL server says of the standbys streaming from it."""

    # Physical standbys streaming from this server now (logical subscribers excluded).
    standbys: int
    # application_name of each standby that streams asynchronously, where the server
    # shows it to this role (pg_read_all_stats); empty where it does not.
    asynchronous: tuple[str, ...]
    synchronous_standby_names: str
    synchronous_commit: str


def read_replication(conn: Connection) -> Replication:
    """Read the replication settings and standbys of the server ``conn`` is on."""
    names, commit = conn.execute(text(
        "SELECT current_setting('synchronous_standby_names'), "
        "current_setting('synchronous_commit')")).one()
    # A physical standby's WAL sender is connected to no database; a logical one is.
    rows = conn.execute(text(
        "SELECT r.application_name, r.sync_state FROM pg_stat_replication r "
        "JOIN pg_stat_activity a ON a.pid = r.pid WHERE a.datname IS NULL")).all()
    return Replication(
        standbys=len(rows),
        asynchronous=tuple(sorted(str(name) for name, state in rows if state == "async")),
        synchronous_standby_names=str(names),
        synchronous_commit=str(commit))


def replication_warning(replication: Replication) -> str | None:
    """The warning to give about ``replication``, or None where nothing is seen amiss."""
    if replication.standbys == 0:
        return None
    advice = ("A failover to such a standby loses the steps and runs it had not received, "
              "and their bodies run again. Make the standby a failover can promote "
              "synchronous (synchronous_standby_names on the primary, synchronous_commit "
              "on or remote_apply), or promote only a standby that has replayed all of the "
              "old primary's WAL. See 'Replication and failover' in the operating guide.")
    if not replication.synchronous_standby_names.strip():
        return (f"{replication.standbys} standby server(s) stream from the store's PostgreSQL "
                "server and none is synchronous (synchronous_standby_names is empty). "
                + advice)
    if replication.synchronous_commit in _NO_STANDBY_WAIT:
        return (f"the store's PostgreSQL server has synchronous standbys, but "
                f"synchronous_commit is {replication.synchronous_commit!r} for the store's "
                "connections, so a commit does not wait for any standby. " + advice)
    if replication.asynchronous:
        return (f"standby server(s) {', '.join(replication.asynchronous)} stream from the "
                "store's PostgreSQL server asynchronously (others are synchronous). "
                + advice)
    return None
