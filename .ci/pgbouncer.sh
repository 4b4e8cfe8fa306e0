#!/usr/bin/env bash
# Start a PgBouncer in transaction pooling mode in front of the local PostgreSQL, for the
# tests that run the store through a pooler (DURAFLOW_TEST_PGBOUNCER_URL). Installs
# Debian's pgbouncer if it is missing, and runs it as the postgres user on a port of its
# own (PGBOUNCER_PORT, 6432 by default). Does nothing if one already answers there.
#
# The pool is made harsher than a production one on purpose: server_round_robin hands
# consecutive transactions of one client to different server connections, so anything
# that relies on session state between transactions (a session advisory lock, a
# prepared statement, a SET) fails here instead of by chance in production.
#
# Every database name goes to the local server, except duraflow_outage: the private
# cluster on port 5439 that the outage tests create, stop and start (tests/conftest.py).
# When PgBouncer already runs, the configuration is written again and reloaded.
set -euo pipefail

PORT=${PGBOUNCER_PORT:-6432}
PG_HOST=${PG_HOST:-127.0.0.1}
PG_PORT=${PG_PORT:-5432}
DIR=${PGBOUNCER_DIR:-/var/run/duraflow-pgbouncer}

if ! [ -x /usr/sbin/pgbouncer ]; then
    echo "pgbouncer is missing; installing it"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq pgbouncer || { apt-get update -qq && apt-get install -y -qq pgbouncer; }
fi

mkdir -p "$DIR"
cat > "$DIR/pgbouncer.ini" <<INI
[databases]
duraflow_outage = host=127.0.0.1 port=5439 dbname=postgres
* = host=$PG_HOST port=$PG_PORT

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PORT
unix_socket_dir =
auth_type = trust
auth_file = $DIR/userlist.txt
pool_mode = transaction
server_round_robin = 1
default_pool_size = 40
max_client_conn = 1000
server_login_retry = 1
ignore_startup_parameters = extra_float_digits,options
logfile = $DIR/pgbouncer.log
pidfile = $DIR/pgbouncer.pid
INI
printf '"postgres" ""\n' > "$DIR/userlist.txt"
chown -R postgres:postgres "$DIR"

if pg_isready -q -h 127.0.0.1 -p "$PORT" 2>/dev/null && [ -f "$DIR/pgbouncer.pid" ]; then
    echo "PgBouncer already answers on port $PORT; reloading its configuration"
    kill -HUP "$(cat "$DIR/pgbouncer.pid")"
    exit 0
fi
su postgres -s /bin/sh -c "/usr/sbin/pgbouncer -d '$DIR/pgbouncer.ini'"
for _ in $(seq 1 30); do
    pg_isready -q -h 127.0.0.1 -p "$PORT" && break
    sleep 0.5
done
pg_isready -h 127.0.0.1 -p "$PORT"
