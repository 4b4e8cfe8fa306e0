"""Turning step outputs into text for the store, and back.

JSON is the default, through kombu's encoder, so ``datetime``, ``date``,
``time``, ``Decimal``, ``UUID`` and ``bytes`` survive the round trip. Pickle is
only used when ``duraflow_serializer = "pickle"`` asks for it, because loading
a pickle runs code chosen by whoever could write to the table. Any other value
is a dotted path to an object with ``dumps(obj) -> str`` and ``loads(str)``.

Every stored value carries the name of the serializer that wrote it, and that
name is only ever compared with the configuration: a row is read when it names
``duraflow_serializer`` or one of ``duraflow_accept_serializers``, and is
unreadable otherwise. Nothing is imported, built or called because a row named
it, so whoever can write one row cannot run code on the workers or the web host.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib
import json
import math
import pickle
import pickletools
import re
import reprlib
from collections.abc import Iterable
from typing import Any, Protocol

from kombu.utils import json as kombu_json

from .errors import ConfigurationError, DuraflowError, RunArgumentsNotSerializable


class Serializer(Protocol):
    """What a custom ``duraflow_serializer`` object must provide."""

    def dumps(self, obj: Any) -> str: ...

    def loads(self, data: str) -> Any: ...


# kombu's encoder and decoder hook, each built once: ``kombu_json.dumps`` and ``loads``
# build a new encoder or decoder object on every call (json.dumps does for any cls or
# option), which costs as much as encoding a small value. Neither keeps state between
# calls, so one object serves every thread.
# allow_nan=False: NaN and infinity are not JSON and other readers choke on them.
_ENCODER = kombu_json.JSONEncoder(allow_nan=False, separators=(",", ":"))
# The canonical form fingerprints are taken of: sorted keys, NaN written as JSON cannot.
_CANONICAL = kombu_json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_DECODER = json.JSONDecoder(object_hook=kombu_json.object_hook)
# The same encoder writing text as it is, for the rare value whose JSON holds a
# surrogate escape: only that text tells a lone surrogate from a character outside the BMP.
_RAW_ENCODER = kombu_json.JSONEncoder(allow_nan=False, separators=(",", ":"),
                                      ensure_ascii=False)
# UTF-8 (with surrogatepass, as pickle writes str) of a surrogate: ED A0..BF xx.
_PICKLED_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


class UnencodableText(ValueError):
    """A string that UTF-8 cannot encode: it holds a lone surrogate.

    Raised by the built-in serializers' ``dumps``. Such a string could be kept
    in the store (JSON escapes it, pickle passes it through), but no reader
    could print it: a terminal, a pipe, a web page and an export file all need
    UTF-8, so it is refused when it is recorded.
    """

    def __init__(self, code: int) -> None:
        self.code = code
        super().__init__(
            f"a string holds a lone surrogate (U+{code:04X}), which UTF-8 cannot encode, so "
            "no reader could show it; repair the text first, for example with "
            ".encode('utf-8', 'replace').decode()")


def _check_text(text: str) -> None:
    """Raise :class:`UnencodableText` unless ``text`` can be written as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UnencodableText(ord(exc.object[exc.start])) from None


def _check_pickled(data: bytes) -> None:
    """Raise :class:`UnencodableText` for a string in a pickle that UTF-8 cannot encode.

    Only called when the pickle's bytes hold what looks like an encoded
    surrogate; the strings are read from its opcodes, so bytes objects that
    happen to hold the same bytes are not taken for text.
    """
    for _, arg, _ in pickletools.genops(data):
        if isinstance(arg, str) and not arg.isascii():
            _check_text(arg)


def canonical_json(value: Any) -> str:
    """``value`` as canonical JSON (kombu's types, sorted keys, no spaces)."""
    return _CANONICAL.encode(value)


class JSONSerializer:
    """kombu's JSON with its type markers; refuses what JSON cannot hold.

    The text is ASCII (anything else is escaped), so it fits a database of any
    encoding. A string holding a lone surrogate is refused
    (:class:`UnencodableText`): it is written as a surrogate escape, which
    only appears in the text at all when a value holds a surrogate or a
    character outside the BMP (an emoji), so only such a value is encoded
    again to be looked at; any other costs a search of its text for a
    backslash (and, when it has one, for a surrogate escape).
    """

    def dumps(self, obj: Any) -> str:
        data = _ENCODER.encode(obj)
        # A surrogate escape needs a backslash: most texts have none, and looking for
        # one character is much cheaper than looking for three.
        if "\\" in data and "\\ud" in data:
            _check_text(_RAW_ENCODER.encode(obj))
        return data

    def loads(self, data: str) -> Any:
        if isinstance(data, str):
            return _DECODER.decode(data)
        return kombu_json.loads(data)


class PickleSerializer:
    """Pickle, base64-armoured so that it fits the same text column."""

    def dumps(self, obj: Any) -> str:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if 0xED in data and _PICKLED_SURROGATE.search(data) is not None:
            _check_pickled(data)  # a lone surrogate: refused, as with JSON
        return base64.b64encode(data).decode("ascii")

    def loads(self, data: str) -> Any:
        return pickle.loads(base64.b64decode(data))  # only when configured: see module docstring


_BUILTIN: dict[str, type[JSONSerializer] | type[PickleSerializer]] = {
    "json": JSONSerializer,
    "pickle": PickleSerializer,
}


@functools.cache
def get_serializer(name: str) -> Serializer:
    """Resolve ``duraflow_serializer`` to an object with ``dumps``/``loads``."""
    return _build(name, f"duraflow_serializer = {name!r}")


@functools.cache
def _accepted_serializer(name: str) -> Serializer:
    """Resolve an entry of ``duraflow_accept_serializers``."""
    return _build(name, f"{name!r} in duraflow_accept_serializers")


def _build(name: str, setting: str) -> Serializer:
    """The serializer a setting names; ``setting`` says which, for the error messages.

    Only ever called with a name taken from the configuration, never with one
    read from a row.
    """
    builtin = _BUILTIN.get(name)
    if builtin is not None:
        return builtin()
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        raise ConfigurationError(
            f"{setting} is unknown: use 'json' (the default), 'pickle', "
            "or a dotted path such as 'myproject.serializers.MySerializer'."
        )
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            f"{setting} could not be imported ({exc}). Check the dotted path."
        ) from None
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:
            raise ConfigurationError(
                f"{setting} is a class that cannot be built without "
                f"arguments ({exc}). Point it at an instance or a class with a no-argument "
                "constructor."
            ) from None
    if not (callable(getattr(obj, "dumps", None)) and callable(getattr(obj, "loads", None))):
        raise ConfigurationError(
            f"{setting} has no dumps()/loads(): a serializer must provide "
            "dumps(obj) -> str and loads(str) -> obj."
        )
    serializer: Serializer = obj
    return serializer


#: Characters of a serializer name read from a row that a message shows.
_NAME_SHOWN = 60

# The characters no reader prints as they are, by Unicode category: controls (Cc: C0,
# DEL and C1, ESC of terminal sequences among them), invisible format characters (Cf:
# bidi embeddings, overrides, isolates and marks, zero-width characters, tag
# characters), surrogates (Cs), and the line and paragraph separators (Zl, Zp). Each
# can make a name or a value look like another one, garble a terminal or break a
# UTF-8 writer. A few unassigned code points inside these ranges are included.
_UNSAFE_RANGES = (
    "\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
    "\u200b-\u200f\u2028-\u202e\u2060-\u206f\ud800-\udfff\ufeff\ufff9-\ufffb"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f")
#: What :func:`visible` escapes.
UNSAFE_TEXT = re.compile(f"[\\x00-\\x1f{_UNSAFE_RANGES}]")
# The same, leaving tabs and line ends alone, for text shown on several lines.
_UNSAFE_IN_LINES = re.compile(f"[\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f{_UNSAFE_RANGES}]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code > 0xFFFF:  # as JSON writes it: a surrogate pair of escapes
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def visible(text: str, *, lines: bool = False) -> str:
    """``text`` fit to print anywhere: each character of :data:`UNSAFE_TEXT` escaped.

    A lone surrogate, a bidi override or mark, a C0 or C1 control (ESC among
    them), a zero-width or other invisible format character becomes a JSON
    escape (``\\u202e``), so that it is seen where it stands instead of
    reordering, hiding or garbling what is around it, and UTF-8 can always
    write the result. In JSON text, which holds such characters only inside
    strings, the result is still JSON and reads back as the same value.
    ``lines`` keeps tabs and line ends (text shown on several lines). All
    other text is returned as it is; text that is all printable is not looked
    at further. The one helper of every reader: the CLI, the web view and the
    Django admin.
    """
    if text.isprintable():
        return text
    return (_UNSAFE_IN_LINES if lines else UNSAFE_TEXT).sub(_escaped, text)


def stored_text(text: str, *, limit: int = 4000) -> str:
    """An exception's text as a run's or a step's error column keeps it.

    Escaped like :func:`visible` (lines kept), so that a lone surrogate in the text
    of the user's exception cannot make the driver refuse the row and replace the
    user's error with its own; cut to ``limit`` characters.
    """
    text = visible(text, lines=True)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def shown_name(name: str) -> str:
    """A serializer name read from a row, fit to print: quoted, escaped, cut short."""
    return repr(name if len(name) <= _NAME_SHOWN else name[:_NAME_SHOWN] + "...")


class Unreadable:
    """Stands in for a stored value whose row names a serializer that is not accepted.

    The read-only views (:func:`~celery_duraflow.get_run`, ``celery duraflow
    show``, the web view) hand it out in place of the value, which is never
    decoded. ``str()`` is a short placeholder; ``reason`` says what was refused
    and what to do; ``serializer`` is the name as the row holds it.
    """

    def __init__(self, serializer: str, reason: str) -> None:
        self.serializer = serializer
        self.reason = reason

    def __str__(self) -> str:
        return (f"<unreadable: stored with serializer {shown_name(self.serializer)}, "
                "which is not accepted>")

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Unreadable) and other.serializer == self.serializer
                and other.reason == self.reason)

    def __hash__(self) -> int:
        return hash((self.serializer, self.reason))


def _accepted(name: str, configured: str, accept: Iterable[str]) -> Serializer | None:
    """The serializer for a row that names ``name``, if the configuration accepts it.

    ``name`` is only compared: what is resolved is the configuration's own entry.
    """
    if name == configured:
        return get_serializer(configured)
    for allowed in accept:
        if name == allowed:
            return _accepted_serializer(allowed)
    return None


def _subject(task_id: str, step_key: str | None, what: str | None) -> str:
    if step_key is None:
        return f"the stored {what or 'value'} of task {task_id}"
    return f"the stored {what or 'output'} of step {step_key!r} of task {task_id}"


def _not_accepted(name: str, configured: str, accept: Iterable[str], *, task_id: str,
                  step_key: str | None, what: str | None) -> str:
    how = "pickle" if name == "pickle" else f"serializer {shown_name(name)}"
    again = (f"retry the run from that step (celery duraflow retry {task_id} --from-step "
             f"{step_key}) so that it is stored again" if step_key is not None
             else "retry the run so that it is stored again")
    return (
        f"{_subject(task_id, step_key, what)} is unreadable: it was stored with {how}, "
        f"which is not accepted (duraflow_serializer is {configured!r}, "
        f"duraflow_accept_serializers is {list(accept)!r}). A serializer named by a stored "
        "row is never imported or run unless the configuration accepts it. If you trust "
        f"the rows written with {shown_name(name)}, add it to duraflow_accept_serializers; "
        f"otherwise {again}."
    )


def decode(data: str | None, stored_with: str | None, configured: str, *,
           accept: Iterable[str] = (), task_id: str, step_key: str | None,
           what: str | None = None, placeholder: bool = False) -> Any:
    """Load a stored value, with the serializer its row says wrote it.

    ``stored_with`` (the row's serializer column; ``None`` means
    ``configured``) is only compared with ``configured``
    (``duraflow_serializer``) and ``accept`` (``duraflow_accept_serializers``).
    A row naming anything else is unreadable, pickle included: it raises
    :class:`~celery_duraflow.errors.ConfigurationError` saying what to do,
    or, with ``placeholder`` (the read-only views), returns an
    :class:`Unreadable` in place of the value. ``what`` names the value in
    messages ("returned value", "signal payload", "result"; by default the
    "output" of a step, or the "value" of a task).
    """
    if data is None:
        return None
    accept = tuple(accept)
    name = configured if stored_with is None else stored_with
    serializer = _accepted(name, configured, accept)
    if serializer is None:
        reason = _not_accepted(name, configured, accept, task_id=task_id, step_key=step_key,
                               what=what)
        if placeholder:
            return Unreadable(name, reason)
        raise ConfigurationError(reason, task_id=task_id, step_key=step_key)
    try:
        return serializer.loads(data)
    except DuraflowError:
        raise
    except Exception as exc:
        raise ConfigurationError(
            f"{_subject(task_id, step_key, what)} could not be read with the {name!r} "
            f"serializer ({exc}). Check duraflow_serializer and duraflow_accept_serializers.",
            task_id=task_id,
            step_key=step_key,
        ) from exc


def encode_arguments(args: Any, kwargs: Any, serializer: Serializer, *,
                     task_id: str | None = None, task_name: str | None = None,
                     serializer_name: str | None = None) -> tuple[str, str]:
    """A task's arguments as stored text, and their fingerprint; both always set.

    The fingerprint is a SHA-256 of canonical JSON (sorted keys, tuples and
    lists alike), so the same arguments match whether they came through a
    broker or an eager call. Arguments kombu's JSON cannot write (objects,
    with ``duraflow_serializer = "pickle"``) are fingerprinted through the
    serializer's own text instead.

    Arguments the serializer cannot store at all raise
    :class:`~celery_duraflow.errors.RunArgumentsNotSerializable`, naming the
    task, the argument (``args[1]``, ``kwargs["when"]["price"]``), its type
    and the serializer's reason: without stored arguments the recovery sweep
    could not send the run again, and the same task id re-sent with other
    arguments could not be told apart. The serializer is asked first, so a
    NaN (which canonical JSON would write) is refused by the JSON serializer.
    """
    payload = {"args": list(args), "kwargs": dict(kwargs)}
    try:
        blob = serializer.dumps(payload)
    except Exception as error:
        raise _arguments_refused(payload, serializer, error, task_id=task_id,
                                 task_name=task_name,
                                 serializer_name=serializer_name) from error
    try:
        canonical = canonical_json(payload)
    except Exception:
        canonical = blob
    return blob, hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _arguments_refused(payload: dict[str, Any], serializer: Serializer, error: Exception, *,
                       task_id: str | None, task_name: str | None,
                       serializer_name: str | None) -> RunArgumentsNotSerializable:
    """The error for arguments ``serializer`` refused: which one, what it is, and why."""
    where, kind, why = "its arguments", _kind(payload, error), error
    try:
        candidates = [(f"args[{index}]", arg) for index, arg in enumerate(payload["args"])]
        candidates += [(f"kwargs{_segment(key)}", arg)
                       for key, arg in payload["kwargs"].items()]
        for root, arg in candidates:
            arg_error = _refusal(arg, serializer)
            if arg_error is None:
                continue
            found = _walk(arg, serializer, root, arg_error)
            where, kind, why = found if found is not None else (root, _kind(arg, arg_error),
                                                                 arg_error)
            break
    except Exception:  # a part that breaks while being looked at: say "its arguments"
        pass
    if task_id is not None:
        who = f"task {task_id}" + (f" ({task_name})" if task_name else "")
    else:
        who = f"a run of {task_name}" if task_name else "a run"
    using = (f"the {serializer_name!r} serializer" if serializer_name
             else "the configured serializer")
    subject = "its arguments are" if where == "its arguments" else f"its argument {where} is"
    return RunArgumentsNotSerializable(
        f"{who} was refused before it started: {subject} {_article(kind)} {kind}, which "
        f"{using} cannot store ({_short(why)}). Nothing was run or recorded: without its "
        "arguments the run could not be sent again after a crash, nor told apart from "
        "another run sent under the same task id. Pass plain data (ids rather than objects; "
        "strings, numbers, lists and dicts), or configure duraflow_serializer (for example "
        "'pickle', or a dotted path to your own) to store such arguments.",
        task_id=task_id,
    )


#: How deep :func:`find_unstorable` follows a value before calling it too deep.
MAX_DEPTH = 1000
# How many dumps() calls find_unstorable may spend before settling for what it found.
_MAX_TRIES = 10_000
# Path segments kept at each end of a long path, and characters kept of a long key.
_PATH_ENDS = 4
_KEY_CHARS = 40


def find_unstorable(value: Any, serializer: Serializer,
                    root: str = "result") -> tuple[str, str] | None:
    """Where in ``value`` the part ``serializer`` refuses sits, and what it is.

    Returns ``(path, type)``: ``path`` starts with ``root`` and goes down
    through dicts (``["key"]`` for a string key, ``[3]`` or ``[(1, 2)]`` for
    others, by a shortened repr) and lists and tuples (``[i]``), for example
    ``('result["flights"][3]', "Flight")``. ``type`` is the refused part's
    type name, with a note in parentheses where the name alone would mislead:

    * ``"float (nan)"``, ``"float (inf)"``, ``"float (-inf)"``: a number JSON cannot hold;
    * ``"tuple (as a dict key)"``: the path's last segment is a key the serializer refuses;
    * ``"list (contains itself)"``: a reference cycle;
    * ``"dict (nested too deep)"``: the serializer gave up on the nesting
      (``RecursionError``) although every part on its own is fine;
    * ``"dict (nested more than 1000 levels deep)"``: the walk stops at
      :data:`MAX_DEPTH` levels and names the part there.

    A path with more than eight segments keeps the first and last four, with
    ``[...N levels...]`` in between. The smallest refused part is found by
    calling ``serializer.dumps`` on the parts, top down, one level at a time,
    without recursion. Meant for error messages, after a ``dumps()`` failed:
    it never raises, and returns ``None`` when ``value`` can be stored after
    all or when it cannot tell.
    """
    try:
        found = _walk(value, serializer, root, None)
    except Exception:
        return None
    return None if found is None else (found[0], found[1])


def _walk(value: Any, serializer: Serializer, root: str,
          error: Exception | None) -> tuple[str, str, Exception] | None:
    """find_unstorable's loop, also returning the serializer's error for the part."""
    if error is None:
        error = _refusal(value, serializer)
        if error is None:
            return None
    segments: list[str] = []
    ancestors = {id(value)}
    node = value
    tries = 1
    jumped = False
    while True:
        if len(segments) >= MAX_DEPTH:
            return (_path(root, segments),
                    f"{type(node).__name__} (nested more than {MAX_DEPTH} levels deep)", error)
        children = _children(node)
        if children is None:
            return _path(root, segments), _kind(node, error), error
        if isinstance(error, RecursionError) and not jumped:
            # Too deep for the serializer: every dumps() below would go as deep again,
            # so jump down the nesting instead of trying each level.
            jump = _deep_jump(node, len(segments), ancestors, serializer)
            tries += jump[2]
            if jump[0]:
                for key, child in jump[0]:
                    segments.append(_segment(key))
                    ancestors.add(id(child))
                node, error, jumped = jump[0][-1][1], jump[1] or error, True
                continue
        step: tuple[Any, Any, Exception] | None = None
        cycle: tuple[Any, Any] | None = None
        for key, child in children:
            if tries >= _MAX_TRIES:
                break
            if isinstance(child, (dict, list, tuple)) and id(child) in ancestors:
                # Every part on the path is refused already; a cycle is named only if
                # nothing else under this node is.
                cycle = cycle or (key, child)
                continue
            tries += 1
            child_error = _refusal(child, serializer)
            if child_error is not None:
                step = (key, child, child_error)
                break
        if step is None and cycle is not None:
            return (_path(root, [*segments, _segment(cycle[0])]),
                    f"{type(cycle[1]).__name__} (contains itself)", error)
        if step is None and isinstance(node, dict):
            for key, _ in children:
                if tries >= _MAX_TRIES:
                    break
                tries += 1
                key_error = _refusal({key: None}, serializer)
                if key_error is not None:
                    note = (f", {_surrogate_note(key_error)}"
                            if isinstance(key_error, UnencodableText) else "")
                    return (_path(root, [*segments, _segment(key)]),
                            f"{type(key).__name__} (as a dict key{note})", key_error)
        if step is None:
            return _path(root, segments), _kind(node, error), error
        key, node, error = step
        segments.append(_segment(key))
        jumped = False
        if isinstance(node, (dict, list, tuple)):
            ancestors.add(id(node))


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """(key or index, part) of a dict, list or tuple; None for anything else."""
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    return None


def _deep_jump(node: Any, depth: int, ancestors: set[int], serializer: Serializer,
               ) -> tuple[list[tuple[Any, Any]], Exception | None, int]:
    """The way down from ``node`` to the deepest part that is still refused.

    Follows the first dict, list or tuple at each level (down to
    :data:`MAX_DEPTH`) and binary-searches that chain with ``dumps()``: a
    handful of calls instead of one per level. Returns the chain of
    (key, part) to that part (empty if none below ``node`` is refused), its
    error, and how many ``dumps()`` calls it spent.
    """
    chain: list[tuple[Any, Any]] = []
    seen = set(ancestors)
    current = node
    while depth + len(chain) < MAX_DEPTH:
        below = next(((key, child) for key, child in _children(current) or ()
                      if isinstance(child, (dict, list, tuple)) and id(child) not in seen),
                     None)
        if below is None:
            break
        chain.append(below)
        seen.add(id(below[1]))
        current = below[1]
    if not chain:
        return [], None, 0
    spent = 1
    last = _refusal(chain[-1][1], serializer)
    if last is not None:
        return chain, last, spent
    # chain[low] is refused (low = -1: node itself), chain[high] is not.
    low, high, error = -1, len(chain) - 1, None
    while high - low > 1:
        middle = (low + high) // 2
        spent += 1
        middle_error = _refusal(chain[middle][1], serializer)
        if middle_error is None:
            high = middle
        else:
            low, error = middle, middle_error
    return chain[: low + 1], error, spent


def _refusal(value: Any, serializer: Serializer) -> Exception | None:
    """The error ``serializer.dumps(value)`` raises, or None when it can store ``value``."""
    try:
        serializer.dumps(value)
    except Exception as exc:
        return exc
    return None


def _kind(value: Any, error: BaseException) -> str:
    """A refused value's type name, with a note where the name alone would mislead."""
    name = type(value).__name__
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name} ({value!r})"
    if isinstance(error, RecursionError):
        return f"{name} (nested too deep)"
    if isinstance(error, UnencodableText) and isinstance(value, str):
        return f"{name} ({_surrogate_note(error)})"
    return name


def _surrogate_note(error: UnencodableText) -> str:
    return f"holds a lone surrogate, U+{error.code:04X}"


def _segment(key: Any) -> str:
    """One step of a path into a dict: ``["key"]`` for a string, a short repr otherwise."""
    if isinstance(key, str):
        shown = key if len(key) <= _KEY_CHARS else key[: _KEY_CHARS - 3] + "..."
        return f"[{visible(json.dumps(shown, ensure_ascii=False))}]"
    short = reprlib.Repr()
    short.maxstring = short.maxother = short.maxlong = _KEY_CHARS
    short.maxlevel = 2
    try:
        text = short.repr(key)
    except Exception:
        text = f"<{type(key).__name__}>"
    return f"[{text[:_KEY_CHARS]}]"


def _path(root: str, segments: list[str]) -> str:
    """``root`` followed by ``segments``, the middle left out of a long path."""
    if len(segments) <= 2 * _PATH_ENDS:
        return root + "".join(segments)
    middle = len(segments) - 2 * _PATH_ENDS
    return (root + "".join(segments[:_PATH_ENDS]) + f"[...{middle} levels...]"
            + "".join(segments[-_PATH_ENDS:]))


def _short(error: BaseException) -> str:
    """The first line of an error's text, cut to a length fit for a message."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _article(kind: str) -> str:
    return "an" if kind[:1].lower() in "aeiou" else "a"


def fingerprint(value: Any, serializer: Serializer) -> str:
    """A stable hash of a value: SHA-256 of its canonical JSON (sorted keys).

    Values JSON cannot hold are hashed through the configured serializer; a
    value neither can write gets the hash of its ``repr``.
    """
    try:
        canonical = canonical_json(value)
    except Exception:
        try:
            canonical = serializer.dumps(value)
        except Exception:
            canonical = repr(value)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
