#!/usr/bin/env bash
# Run Celery's own test suite twice, with the plain task class and with DurableTask as
# every test app's task class, and fail on tests that pass with the first but not the
# second (see README.md beside this file).
#
#   PYTHON=.venv/bin/python bash .ci/celery_suite/run.sh [unit] [integration]
#
# Both parts run when none is named. The unit part is t/unit/tasks/ (the two variants run
# at the same time); the integration part is t/integration/test_tasks.py and the
# test_canvas.py tests that replace tasks, against a Redis broker (db 10) and result
# backend (db 11) and a worker started by the tests (the variants run one after the other,
# as they share the Redis databases).
#
# Environment:
#   PYTHON                  the project's venv python (default .venv/bin/python)
#   DURAFLOW_CELERY_SRC     where Celery's source distribution is downloaded and unpacked
#                           (default /tmp/duraflow-celery-src; reused when already there)
#   DURAFLOW_CELERY_OUT     reports and logs (default: results/ in that folder, emptied)
#   DURAFLOW_CELERY_REDIS   host:port of Redis for the integration part (default 127.0.0.1:6379)
set -euo pipefail

cd "$(dirname "$0")/../.."
ROOT=$PWD
HERE=$ROOT/.ci/celery_suite

PYTHON=${PYTHON:-.venv/bin/python}
case "$PYTHON" in
    */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;;  # absolute; the tests run elsewhere
    *) PYTHON=$(command -v "$PYTHON") ;;
esac
CACHE=${DURAFLOW_CELERY_SRC:-/tmp/duraflow-celery-src}
OUT=${DURAFLOW_CELERY_OUT:-$CACHE/results}
REDIS=${DURAFLOW_CELERY_REDIS:-127.0.0.1:6379}
# celery-duraflow refuses DURAFLOW_* variables that are not its settings (DURAFLOW_TEST_*
# aside), so these three must not reach the tests.
unset DURAFLOW_CELERY_SRC DURAFLOW_CELERY_OUT DURAFLOW_CELERY_REDIS

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(unit integration)
for part in "${parts[@]}"; do
    case "$part" in unit|integration) ;; *) echo "unknown part: $part (unit, integration)" >&2; exit 2 ;; esac
done
wants() { [[ " ${parts[*]} " == *" $1 "* ]]; }

note() { printf '\n--- %s\n' "$*"; }
# Seconds since the epoch, with fractions, for the wall times the summary quotes.
now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }

# --- Celery's source, of the version installed in the venv -----------------------------
VERSION=$("$PYTHON" -c 'import celery; print(celery.__version__)')
SRC=$CACHE/celery-$VERSION
note "Celery $VERSION: tests from $SRC"
if [ ! -f "$SRC/t/unit/conftest.py" ] || [ ! -f "$SRC/t/integration/conftest.py" ]; then
    mkdir -p "$CACHE"
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps "celery==$VERSION" -d "$CACHE"
    archive=$(ls "$CACHE"/celery-"$VERSION".tar.gz)
    unpack=$(mktemp -d "$CACHE/unpack.XXXXXX")
    tar -xzf "$archive" -C "$unpack"
    rm -rf "$SRC"
    mv "$unpack/celery-$VERSION" "$SRC"
    rm -rf "$unpack"
fi
[ -d "$SRC/t/unit/tasks" ] || { echo "$SRC has no t/unit/tasks" >&2; exit 1; }

# --- What Celery's conftests and test modules import that the venv may lack -------------
# Only these, pinned as Celery's requirements/ pins them; every package already installed
# is held at its version (a constraints file), so the project's venv is not changed.
pin() {  # pin NAME: Celery's requirement line for NAME (without comments), or NAME
    local line
    line=$(grep -rhiE "^$1[[:space:]]*(==|>=|~=|<)" "$SRC/requirements" 2>/dev/null | head -n1 \
        | sed 's/[[:space:]]*#.*//') || true
    echo "${line:-$1}"
}
missing=()
"$PYTHON" -c 'import pytest_timeout' 2>/dev/null || missing+=(pytest-timeout)
if wants integration; then
    # t/integration/tasks.py imports pydantic.
    "$PYTHON" -c 'import pydantic' 2>/dev/null || missing+=(pydantic)
fi
# pytest 9 has the subtests fixture built in; older ones need the plugin.
"$PYTHON" -c 'import pytest, sys; sys.exit(pytest.version_tuple[0] < 9)' 2>/dev/null \
    || "$PYTHON" -c 'import pytest_subtests' 2>/dev/null || missing+=(pytest-subtests)
mkdir -p "$CACHE"
rm -rf "$OUT"
mkdir -p "$OUT"
if [ ${#missing[@]} -gt 0 ]; then
    pinned=()
    for name in "${missing[@]}"; do pinned+=("$(pin "$name")"); done
    note "installing Celery's test dependencies the venv lacks: ${pinned[*]}"
    "$PYTHON" -m pip freeze --exclude-editable | grep -v -e '^-e ' -e ' @ ' > "$OUT/venv-constraints.txt" || true
    if ! "$PYTHON" -m pip install --quiet -c "$OUT/venv-constraints.txt" "${pinned[@]}"; then
        echo "Celery's pins do not fit the venv; installing the versions that do" >&2
        "$PYTHON" -m pip install --quiet -c "$OUT/venv-constraints.txt" "${missing[@]}"
    fi
fi

# --- Running one variant ----------------------------------------------------------------
# run_pytest NAME VARIANT ARGS...: pytest from the source tree, report in $OUT/NAME.xml, log
# in $OUT/NAME.log, wall time in $OUT/NAME.seconds, exit code in $OUT/NAME.rc.
run_pytest() {
    local name=$1 variant=$2 start rc=0
    shift 2
    mkdir -p "$OUT/tmp-$name"
    start=$(now)
    (
        cd "$SRC"
        export DURAFLOW_TEST_TASK_CLS=$variant
        export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
        export TMPDIR="$OUT/tmp-$name"
        exec "$PYTHON" -m pytest -p swap -p no:cacheprovider -p no:celery \
            --junitxml="$OUT/$name.xml" --basetemp="$OUT/tmp-$name/pytest" \
            -q -ra --color=no "$@"
    ) > "$OUT/$name.log" 2>&1 || rc=$?
    seconds "$start" "$(now)" > "$OUT/$name.seconds"
    echo "$rc" > "$OUT/$name.rc"
}

# report NAME: the variant's closing line, time and exit code; fails if pytest itself broke
# (interrupted, internal error, usage error, nothing collected), as the report then
# compares nothing.
report() {
    local name=$1 rc
    rc=$(cat "$OUT/$name.rc")
    printf '%-20s %4ss  exit %s  %s\n' "$name" "$(cat "$OUT/$name.seconds")" "$rc" \
        "$(grep -E '(passed|failed|error|no tests ran)' "$OUT/$name.log" | tail -n1)"
    if [ "$rc" -gt 1 ] || [ ! -s "$OUT/$name.xml" ]; then
        echo "pytest did not complete the $name run (exit $rc); the end of $OUT/$name.log:" >&2
        tail -n 30 "$OUT/$name.log" >&2
        return 1
    fi
}

status=0
summary=()

# --- Unit: t/unit/tasks, both variants at the same time ---------------------------------
if wants unit; then
    note "unit: t/unit/tasks/ with the plain task class and with DurableTask (concurrently)"
    run_pytest unit-plain plain t/unit/tasks/ &
    plain_pid=$!
    run_pytest unit-durable durable t/unit/tasks/ &
    durable_pid=$!
    wait "$plain_pid" "$durable_pid"
    report unit-plain || status=1
    report unit-durable || status=1
    "$PYTHON" "$HERE/compare.py" "$OUT/unit-plain.xml" "$OUT/unit-durable.xml" \
        "$HERE/allowed.txt" "unit (t/unit/tasks)" | tee "$OUT/unit-compare.txt" || status=1
    summary+=("unit: plain $(cat "$OUT/unit-plain.seconds")s, durable $(cat "$OUT/unit-durable.seconds")s (run concurrently)")
fi

# --- Integration: a Redis broker and backend, a worker started by the tests -------------
if wants integration; then
    note "integration: test_tasks.py and the test_canvas.py tests that replace tasks (Redis $REDIS, dbs 10/11)"
    host=${REDIS%:*}
    port=${REDIS##*:}
    "$PYTHON" "$HERE/select_integration.py" "$SRC" > "$OUT/integration-nodes.txt"
    mapfile -t nodes < "$OUT/integration-nodes.txt"
    deselect=()
    while read -r line; do
        line=${line%%#*}
        line=$(echo "$line" | xargs)
        [ -z "$line" ] || deselect+=(--deselect "$line")
    done < "$HERE/deselect_integration.txt"
    echo "${#nodes[@]} node ids selected, $(( ${#deselect[@]} / 2 )) deselected (deselect_integration.txt)"
    for variant in plain durable; do
        # Fresh broker queues, results and worker state for each variant.
        "$PYTHON" -c 'import redis, sys
for db in (10, 11):
    redis.Redis(host=sys.argv[1], port=int(sys.argv[2]), db=db).flushdb()' "$host" "$port"
        (
            export TEST_BROKER="redis://$host:$port/10" TEST_BACKEND="redis://$host:$port/11"
            # Celery's test tasks keep a few helper keys (redis-echo, redis-count...) here.
            export REDIS_HOST=$host REDIS_PORT=$port
            # One hanging test may not take the 300 s Celery's markers give it: at most
            # 60 s each, marked or not (pytest-timeout).
            export DURAFLOW_TEST_TIMEOUT_CAP=60
            if [ "$variant" = durable ]; then
                # The worker is started once and forks its pool then: one store for the
                # whole run, fresh for each run.
                export DURAFLOW_TEST_SHARED_STORE=1
                export DURAFLOW_DATABASE_URL="sqlite:///$OUT/integration-durable.sqlite3"
            fi
            # -p no:celery switches pytest-celery off (its Docker-based fixtures); Celery's
            # own plugin gives the fixtures the integration conftest does not import.
            run_pytest "integration-$variant" "$variant" -p celery.contrib.pytest \
                --timeout=60 "${nodes[@]}" "${deselect[@]}"
        )
        report "integration-$variant" || status=1
    done
    "$PYTHON" "$HERE/compare.py" "$OUT/integration-plain.xml" "$OUT/integration-durable.xml" \
        "$HERE/allowed_integration.txt" "integration (Redis broker and backend)" \
        | tee "$OUT/integration-compare.txt" || status=1
    summary+=("integration: plain $(cat "$OUT/integration-plain.seconds")s, durable $(cat "$OUT/integration-durable.seconds")s (one after the other)")
fi

note "summary (Celery $VERSION; reports and logs in $OUT)"
for line in "${summary[@]}"; do echo "$line"; done
for name in unit integration; do
    wants "$name" || continue
    grep -E '^(t/|total)' "$OUT/$name-compare.txt" | sed "s|^|$name  |" || true
    tail -n1 "$OUT/$name-compare.txt" | sed "s|^|$name  |"
done
if [ "$status" -eq 0 ]; then
    echo "Celery's own tests: no regression with DurableTask"
else
    echo "Celery's own tests: DurableTask regressions (or a broken run), see above" >&2
fi
exit "$status"
