"""Text the store and its readers must get right (issue 31).

Lone surrogates cannot be written as UTF-8, so no terminal, pipe, web page or
export file can carry them: they are refused when a value is recorded, like a
NaN. Bidi controls and C1 controls make a name look like another one: they are
refused in step names. Rows written before those checks, or by hand, are still
shown by every reader, with such characters escaped where they stand.
"""

from __future__ import annotations

import json
import sys
import unicodedata
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from celery import Celery
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner, Result
from sqlalchemy import func, select
from starlette.testclient import TestClient

from celery_duraflow import (
    DurableTask,
    InvalidStepName,
    StepOutputNotSerializable,
    get_run,
    send_signal,
    step,
    wait_for_signal,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._serialization import (
    UNSAFE_TEXT,
    find_unstorable,
    get_serializer,
    visible,
)
from celery_duraflow._store import Delivery, Store, store_for
from celery_duraflow.errors import RunArgumentsNotSerializable
from celery_duraflow.web import create_app

OWNER = "text-test-host|x|1|abc"
JSON = get_serializer("json")
PICKLE = get_serializer("pickle")
#: Characters no reader may print raw: a lone surrogate, bidi controls, a C1 control, ESC.
ODD = ("\ud800", "\udfff", "\u202e", "\u2066", "\u200f", "\u0085", "\u009b", "\x1b")


@dataclass
class Ticket:
    """A user object for the pickle serializer (module level, so pickle finds it)."""

    note: str


def store_of(app: Celery) -> Store:
    return store_for(config_for_app(app))


def encodable(text: str | None) -> bool:
    """True when ``text`` can be written as UTF-8 (what every reader needs)."""
    if text is None:
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def no_odd_text(text: str) -> bool:
    return not any(ch in text for ch in ODD)


# -- refused when recorded -------------------------------------------------------------------


@pytest.mark.parametrize(("value", "where", "code"), [
    ("a\ud800b", "result is str", "U+D800"),
    ({"k": ["x", "\udfff"]}, 'result["k"][1] is str', "U+DFFF"),
    ({"ok": {"key\ud800": 1}}, 'result["ok"]["key\\ud800"] is str (as a dict key', "U+D800"),
    ("\ud83d\ude00", "result is str", "U+D83D"),
])
def test_lone_surrogate_in_a_step_output_is_refused(make_app: Callable[..., Celery],
                                                    value: Any, where: str, code: str) -> None:
    """A step output holding a lone surrogate fails the step for good, naming where it sits."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, name="text.out")
    def out() -> Any:
        with step("pick") as s:
            calls["pick"] += 1
            s.result = value
        return "done"

    result = out.apply()
    assert isinstance(result.result, StepOutputNotSerializable), result.result
    message = str(result.result)
    assert result.id in message and "'pick'" in message
    assert where in message and code in message and "surrogate" in message
    assert encodable(message)
    assert calls["pick"] == 1
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"
    steps = store_of(app).load_steps(result.id)
    assert [(k, s.status, s.output) for k, s in steps.items()] == [("pick", "failed", None)]
    assert encodable(steps["pick"].error) and "surrogate" in (steps["pick"].error or "")
    # Delivered again, nothing runs: the refusal is recorded for good.
    assert isinstance(out.apply(task_id=result.id).result, StepOutputNotSerializable)
    assert calls["pick"] == 1


def test_lone_surrogate_in_a_returned_value_is_refused(make_app: Callable[..., Celery]) -> None:
    """A value returned from a step body with a lone surrogate is refused, nothing stored."""
    app = make_app()

    @app.task(base=DurableTask, name="text.returns")
    def returns() -> Any:
        with step("early"):
            return {"note": "x\udc00"}
        return "late"  # pragma: no cover - the body returns

    result = returns.apply()
    assert isinstance(result.result, StepOutputNotSerializable), result.result
    assert "returned value" in str(result.result) and "U+DC00" in str(result.result)
    step_rows = store_of(app).load_steps(result.id)
    assert [(s.status, s.output, s.returned) for s in step_rows.values()] == [
        ("failed", None, None)]


def test_lone_surrogate_in_a_task_result_is_refused(make_app: Callable[..., Celery]) -> None:
    """A task result with a lone surrogate fails the run; no result is stored."""
    app = make_app()

    @app.task(base=DurableTask, name="text.result")
    def report() -> Any:
        with step("count") as s:
            s.result = 3
        return {"rows": [s.result, "\ud800"]}

    result = report.apply()
    assert isinstance(result.result, StepOutputNotSerializable), result.result
    assert result.id in str(result.result) and 'result["rows"][1]' in str(result.result)
    record = store_of(app).get_run(result.id)
    assert record is not None and record.status == "failed" and record.result is None
    assert encodable(record.error)


def test_lone_surrogate_in_the_arguments_refuses_the_run(
        make_app: Callable[..., Celery]) -> None:
    """Arguments with a lone surrogate refuse the run before anything is recorded."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, name="text.args")
    def book(note: str) -> str:
        calls["body"] += 1
        return note

    task_id = str(uuid.uuid4())
    result = book.apply(kwargs={"note": "hi\ud800"}, task_id=task_id)
    assert isinstance(result.result, RunArgumentsNotSerializable), result.result
    assert task_id in str(result.result) and 'kwargs["note"]' in str(result.result)
    assert calls["body"] == 0
    assert get_run(task_id, app=app) is None


def test_lone_surrogate_in_a_signal_payload_is_refused(make_app: Callable[..., Celery]) -> None:
    """send_signal refuses a payload with a lone surrogate and stores no signal."""
    app = make_app(eager=False, task_default_queue=f"text-{uuid.uuid4().hex[:8]}")

    @app.task(base=DurableTask, name="text.approve")
    def approve() -> Any:
        return wait_for_signal("approval")

    task_id = approve.apply().id
    assert store_of(app).get_run(task_id).status == "waiting"  # type: ignore[union-attr]
    with pytest.raises(StepOutputNotSerializable) as info:
        send_signal(task_id, "approval", {"note": "ok\udfff"}, app=app)
    assert task_id in str(info.value) and "'approval'" in str(info.value)
    signals = store_of(app).tables.signals
    with store_of(app).engine.connect() as conn:
        count = conn.execute(select(func.count()).select_from(signals)
                             .where(signals.c.task_id == task_id)).scalar_one()
    assert count == 0
    assert send_signal(task_id, "approval", {"note": "ok"}, app=app) is True


def test_lone_surrogate_is_refused_under_pickle(make_app: Callable[..., Celery]) -> None:
    """With duraflow_serializer='pickle' a lone surrogate inside an object is refused too."""
    app = make_app(duraflow_serializer="pickle")

    @app.task(base=DurableTask, name="text.pickled")
    def pickled(bad: bool) -> Any:
        with step("ticket") as s:
            s.result = Ticket("x\ud800" if bad else "fine \u00e9")
        return s.result.note

    refused = pickled.apply(args=(True,))
    assert isinstance(refused.result, StepOutputNotSerializable), refused.result
    assert "'ticket'" in str(refused.result) and "surrogate" in str(refused.result)
    steps = store_of(app).load_steps(refused.id)
    assert [(s.status, s.output) for s in steps.values()] == [("failed", None)]
    assert pickled.apply(args=(False,)).get() == "fine \u00e9"


def test_ordinary_text_is_stored_and_read_back_unchanged(
        make_app: Callable[..., Celery]) -> None:
    """Accents, CJK, emoji, a literal backslash-u and odd bytes round-trip; stored as ASCII."""
    app = make_app()
    value = {"caf\u00e9": "\u4e88\u7d04 \U0001f680", "path": "C:\\ud800\\x", "raw": b"\xed\xa0\x80",
             "rtl": "\u05e9\u05dc\u05d5\u05dd"}

    @app.task(base=DurableTask, name="text.fine")
    def fine() -> Any:
        with step("keep") as s:
            s.result = value
        return s.result

    result = fine.apply()
    assert result.get() == value
    output = store_of(app).load_steps(result.id)["keep"].output
    assert output is not None and output.isascii()
    assert JSON.loads(output) == value


def test_pickle_does_not_refuse_bytes_that_look_like_a_surrogate() -> None:
    """Pickled bytes holding the UTF-8 form of a surrogate are data, not text: accepted."""
    data = PICKLE.dumps({"blob": b"\xed\xa0\x80", "text": "\u00e9\U0001f680"})
    assert PICKLE.loads(data) == {"blob": b"\xed\xa0\x80", "text": "\u00e9\U0001f680"}
    with pytest.raises(ValueError, match="surrogate"):
        PICKLE.dumps(["ok", {"k": Ticket("\udfff")}])


def test_find_unstorable_names_a_lone_surrogate() -> None:
    """find_unstorable names the string or dict key holding a lone surrogate, escaped."""
    assert find_unstorable({"a": ["x", "y\ud800"]}, JSON) == (
        'result["a"][1]', "str (holds a lone surrogate, U+D800)")
    assert find_unstorable({"k\udfff": 1}, JSON) == (
        'result["k\\udfff"]', "str (as a dict key, holds a lone surrogate, U+DFFF)")


# -- shown escaped ---------------------------------------------------------------------------


def test_visible_escapes_what_would_mislead_or_break_a_reader() -> None:
    """visible() escapes surrogates, bidi and C0/C1 controls as JSON does, and nothing else."""
    assert visible("a\ud800b") == "a\\ud800b"
    assert visible("pay\u202eusd.exe") == "pay\\u202eusd.exe"
    assert visible("x\u0085y\x1b[31m") == "x\\u0085y\\u001b[31m"
    assert visible("a\u200fb\u2066c") == "a\\u200fb\\u2066c"
    assert visible("tag\U000e0041") == "tag\\udb40\\udc41"
    ordinary = "caf\u00e9 \u4e88\u7d04 \U0001f680 \u05e9\u05dc\u05d5\u05dd 'quoted' \\n"
    assert visible(ordinary) == ordinary
    assert visible("two\nlines\tand tab", lines=True) == "two\nlines\tand tab"
    assert visible("two\nlines") == "two\\u000alines"
    # JSON text stays JSON and reads back the same value.
    text = json.dumps({"k\u202e": "v\ud800\x85"}, ensure_ascii=False)
    assert json.loads(visible(text)) == {"k\u202e": "v\ud800\x85"}


def test_unsafe_text_covers_every_control_format_and_surrogate_character() -> None:
    """The escaped set holds every Cc, Cf, Cs, Zl and Zp character this Python knows."""
    wanted = {"Cc", "Cf", "Cs", "Zl", "Zp"}
    missed = [f"U+{code:04X}" for code in range(sys.maxunicode + 1)
              if unicodedata.category(chr(code)) in wanted and not UNSAFE_TEXT.match(chr(code))]
    assert missed == []
    extra = [f"U+{code:04X}" for code in range(sys.maxunicode + 1)
             if UNSAFE_TEXT.match(chr(code))
             and unicodedata.category(chr(code)) not in wanted | {"Cn"}]
    assert extra == []


def _odd_run(app: Celery) -> str:
    """A run written straight into the tables, as an older version could have left it."""
    store = store_of(app)
    task_id = str(uuid.uuid4())
    now = datetime.now(UTC)
    store.begin_attempt(task_id, Delivery(task_name="text.\u202eodd\u0085", owner=OWNER))
    assert store.record_step(task_id, "pick\u202ekcip", OWNER, status="completed",
                             output='{"k\\udfff": "a\\ud800b", "nel": "x\\u0085y"}',
                             serializer="json", started_at=now, new=True, position=1)
    assert store.record_step(task_id, "pay\u2066", OWNER, status="failed",
                             error="builtins.ValueError: \x1b[31mred\u202e\u0085done",
                             started_at=now, new=True, position=2)
    assert store.finish_run(task_id, OWNER, "succeeded", result='"r\\udc00"', serializer="json")
    return task_id


def duraflow(app: Celery, *args: str, columns: int | None = 400) -> Result:
    """``celery -A <app> duraflow ARGS...`` through click's runner (never a terminal)."""
    env = {"COLUMNS": str(columns) if columns is not None else None}
    return CliRunner().invoke(celery_command, ["-A", app, "duraflow", *args],  # type: ignore[list-item]
                              env=env)


def test_show_runs_and_export_survive_odd_stored_text(make_app: Callable[..., Celery]) -> None:
    """show, show --json, runs and export print a row with lone surrogates and bidi, escaped."""
    app = make_app()
    task_id = _odd_run(app)

    shown = duraflow(app, "show", task_id)
    assert shown.exit_code == 0, (shown.output, shown.exception)
    assert no_odd_text(shown.stdout)
    assert "a\\ud800b" in shown.stdout and "pick\\u202ekcip" in shown.stdout
    assert "\\u001b[31mred\\u202e\\u0085done" in shown.stdout
    assert "text.\\u202eodd\\u0085" in shown.stdout
    lines = shown.stdout.splitlines()
    assert [line.split()[0] for line in lines[-2:]] == ["pick\\u202ekcip", "pay\\u2066"]

    as_json = duraflow(app, "show", task_id, "--json")
    assert as_json.exit_code == 0, (as_json.output, as_json.exception)
    data = json.loads(as_json.stdout)
    assert data["result"] == "r\udc00"
    assert data["steps"][0]["result"] == {"k\udfff": "a\ud800b", "nel": "x\x85y"}

    exported = duraflow(app, "export", task_id)
    assert exported.exit_code == 0, (exported.output, exported.exception)
    assert no_odd_text(exported.stdout)
    history = json.loads(exported.stdout)
    assert "pick\u202ekcip" in json.dumps(history, ensure_ascii=False)

    listed = duraflow(app, "runs")
    assert listed.exit_code == 0, (listed.output, listed.exception)
    assert no_odd_text(listed.stdout) and "text.\\u202eodd\\u0085" in listed.stdout


def test_web_pages_survive_odd_stored_text(make_app: Callable[..., Celery]) -> None:
    """The run page and the runs page answer 200 for such a row, the odd characters escaped."""
    app = make_app()
    task_id = _odd_run(app)
    client = TestClient(create_app(app), base_url="http://localhost")

    page = client.get(f"/runs/{task_id}")
    assert page.status_code == 200, page.text[:500]
    assert no_odd_text(page.text)
    for shown in ("a\\ud800b", "pick\\u202ekcip", "pay\\u2066", "r\\udc00",
                  "\\u001b[31mred\\u202e\\u0085done", "text.\\u202eodd\\u0085"):
        assert shown in page.text, shown
    listing = client.get("/")
    assert listing.status_code == 200 and no_odd_text(listing.text)
    assert "text.\\u202eodd\\u0085" in listing.text


# -- step names ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "code"), [
    ("pay\u202eusd", "U+202E"), ("\u202aleft", "U+202A"), ("iso\u2066late\u2069", "U+2066"),
    ("mark\u200f", "U+200F"), ("ltr\u200e", "U+200E"), ("c1\u0085", "U+0085"),
    ("csi\u009b", "U+009B"), ("zero\u200bwidth", "U+200B"), ("lone\ud800", "U+D800"),
    ("esc\x1b[2J", "U+001B"), ("line\u2028sep", "U+2028"),
])
def test_step_names_with_bidi_or_control_characters_are_refused(
        make_app: Callable[..., Celery], name: str, code: str) -> None:
    """A step name holding a bidi control, mark or C0/C1 control is refused before its body."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, name="text.named")
    def named() -> Any:
        with step(name) as s:
            calls["body"] += 1
            s.result = 1
        return s.result

    result = named.apply()
    assert isinstance(result.result, InvalidStepName), result.result
    message = str(result.result)
    assert result.id in message and code in message and encodable(message)
    assert no_odd_text(message)
    assert calls["body"] == 0
    steps = store_of(app).load_steps(result.id)
    assert all(encodable(key) and s.output is None for key, s in steps.items())


@pytest.mark.parametrize("name", ["caf\u00e9", "\u4e88\u7d04", "\U0001f680-launch",
                                  "\u05e9\u05dc\u05d5\u05dd", "book flight"])
def test_ordinary_unicode_step_names_are_accepted(make_app: Callable[..., Celery],
                                                  name: str) -> None:
    """Accents, CJK, emoji, right-to-left letters and spaces stay valid in step names."""
    app = make_app()

    @app.task(base=DurableTask, name="text.fine_name")
    def named() -> Any:
        with step(name) as s:
            s.result = name
        return s.result

    assert named.apply().get() == name


# -- cutting ---------------------------------------------------------------------------------


def _long_run(app: Celery) -> tuple[str, str, str]:
    store = store_of(app)
    task_id = str(uuid.uuid4())
    now = datetime.now(UTC)
    output = json.dumps({"tail": "x" * 300 + "END"})
    error = "builtins.ValueError: " + "y" * 300 + " ERREND"
    store.begin_attempt(task_id, Delivery(task_name="text.long", owner=OWNER))
    assert store.record_step(task_id, "big", OWNER, status="completed", output=output,
                             serializer="json", started_at=now, new=True, position=1)
    assert store.record_step(task_id, "bad", OWNER, status="failed", error=error,
                             started_at=now, new=True, position=2)
    assert store.finish_run(task_id, OWNER, "failed", error="run " + "z" * 300 + " RUNEND")
    return task_id, output, error


def test_show_never_cuts_piped_output(make_app: Callable[..., Celery]) -> None:
    """Without a terminal (click's runner, no $COLUMNS) show prints outputs and errors whole."""
    app = make_app()
    task_id, output, error = _long_run(app)
    shown = duraflow(app, "show", task_id, columns=None)
    assert shown.exit_code == 0, (shown.output, shown.exception)
    lines = shown.stdout.splitlines()
    assert any(line.endswith(output) for line in lines)
    assert any(line.endswith("error: " + error) for line in lines)
    assert any(line.endswith(" RUNEND") for line in lines)
    assert "..." not in shown.stdout


def test_show_still_fits_a_terminal_width(make_app: Callable[..., Celery]) -> None:
    """With $COLUMNS set (a terminal's width), show's lines are cut to fit it."""
    app = make_app()
    task_id, _, _ = _long_run(app)
    shown = duraflow(app, "show", task_id, columns=100)
    assert shown.exit_code == 0, (shown.output, shown.exception)
    assert all(len(line) <= 100 for line in shown.stdout.splitlines()[-3:])
    assert "END" not in shown.stdout.splitlines()[-2]



def test_an_exception_text_with_a_lone_surrogate_is_recorded_escaped(
        make_app: Callable[..., Celery]) -> None:
    """A body's exception whose text holds a lone surrogate is recorded escaped and propagates."""
    app = make_app()

    @app.task(base=DurableTask, name="text.raises")
    def raises() -> None:
        with step("charge"):
            raise ValueError("card \ud800 declined")

    result = raises.apply()
    assert isinstance(result.result, ValueError), result.result
    steps = store_of(app).load_steps(result.id)
    assert steps["charge"].status == "failed"
    assert "card \\ud800 declined" in (steps["charge"].error or "")


def test_a_run_error_with_a_lone_surrogate_is_recorded_escaped(
        make_app: Callable[..., Celery]) -> None:
    """A task's exception whose text holds a lone surrogate fails the run with its text escaped."""
    app = make_app()

    @app.task(base=DurableTask, name="text.run_raises")
    def raises() -> None:
        with step("look"):
            pass
        raise ValueError("card \ud800 declined")

    result = raises.apply()
    assert isinstance(result.result, ValueError), result.result
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"
    assert "card \\ud800 declined" in (run.error or "")
