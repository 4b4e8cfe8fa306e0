"""What the documentation tells a user to type works: settings, install commands, versions.

The pages (README.md and docs/**/*.md) and the package's docstrings are read as text
and compared with the package itself: the settings it knows, the extras pyproject.toml
declares, the schema version it migrates to, and the CLI reference as Sphinx builds it.
"""

from __future__ import annotations

import ast
import io
import re
import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_duraflow import DurableTask, _config
from celery_duraflow._config import DJANGO_KEYS, KNOWN_KEYS, check_keys, load_config
from celery_duraflow._schema import LATEST_VERSION, build_tables
from celery_duraflow._send import RECORDED_HEADER
from celery_duraflow.errors import ConfigurationError
from celery_duraflow.testing import plugin

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PACKAGE = ROOT / "celery_duraflow"


def pages() -> list[Path]:
    """README.md and every page of docs/ (not the built site)."""
    return [README, *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]


def docstrings() -> Iterator[tuple[Path, str]]:
    """Every docstring of the package (modules, classes, functions)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                          | ast.AsyncFunctionDef):
                text = ast.get_docstring(node)
                if text:
                    yield path, text


# -- every setting the docs name is one the package knows --------------------------------------

NAME = re.compile(r"(?<![A-Za-z0-9_])(?:CELERY_DURAFLOW_[A-Z0-9_]*|DURAFLOW_[A-Z0-9_]*|"
                  r"duraflow_[a-z0-9_]+)")
#: Misspellings the configuration page shows as examples of what is refused.
TYPO_EXAMPLES = {"duraflow_databse_url", "CELERY_DURAFLOW_DATABSE_URL", "DURAFLOW_DATABSE_URL"}
#: Where the project's own test suites, CI and benchmarks read their variables.
TEST_SOURCES = [ROOT / "tests", ROOT / "benchmarks", ROOT / ".ci", ROOT / "Makefile"]


def _fixtures() -> set[str]:
    """The fixtures the pytest plugin defines."""
    return {name for name, value in vars(plugin).items()
            if hasattr(value, "_pytestfixturefunction")
            or type(value).__name__ == "FixtureFunctionDefinition"}


def _read_by_test_sources(name: str) -> bool:
    """True when the project's tests, CI scripts or benchmarks contain ``name``."""
    this = Path(__file__).resolve()
    for source in TEST_SOURCES:
        files = [source] if source.is_file() else (
            sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [])
        for path in files:
            if path.resolve() == this or path.suffix in (".pyc", ".sqlite3"):
                continue
            try:
                if name in path.read_text(encoding="utf-8"):
                    return True
            except UnicodeDecodeError:
                continue
    return False


def classify(name: str) -> str | None:
    """What a ``duraflow_*`` / ``DURAFLOW_*`` / ``CELERY_DURAFLOW_*`` name in the docs is, or
    None when it is nothing the package, its plugin or its test suites know."""
    if name in TYPO_EXAMPLES:
        return "typo example"
    if name in ("DURAFLOW_", "CELERY_DURAFLOW_"):
        return "prefix"
    if name.startswith("CELERY_DURAFLOW_"):
        key = name.removeprefix("CELERY_DURAFLOW_").lower()
        return "setting" if key in KNOWN_KEYS or key in DJANGO_KEYS else None
    if name.startswith("DURAFLOW_"):
        key = name.removeprefix("DURAFLOW_").lower()
        if key in KNOWN_KEYS:
            return "setting"
        if key in DJANGO_KEYS:
            return "django setting"
        if name in _config._OTHER_ENVIRONMENT:
            return "environment variable"
        if name in _config._RESERVED_ENVIRONMENT:
            return "prefix"
        if name.startswith(_config._RESERVED_ENVIRONMENT):
            return "test variable" if _read_by_test_sources(name) else None
        return None
    key = name.removeprefix("duraflow_")
    if key in KNOWN_KEYS or key in DJANGO_KEYS:
        return "setting"
    if name in vars(DurableTask):
        return "task option"
    if name in _fixtures():
        return "fixture"
    if name in {table.name for table in build_tables(_config.DEFAULT_TABLE_PREFIX)
                .metadata.sorted_tables}:
        return "table"
    if name == RECORDED_HEADER:
        return "message header"
    return None


def documented_names() -> dict[str, set[str]]:
    """Every such name in the pages and the docstrings, with where it appears."""
    found: dict[str, set[str]] = {}
    for page in pages():
        for name in NAME.findall(page.read_text(encoding="utf-8")):
            found.setdefault(name, set()).add(str(page.relative_to(ROOT)))
    for path, text in docstrings():
        for name in NAME.findall(text):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_documented_setting_is_a_known_key() -> None:
    """Each duraflow_*/DURAFLOW_*/CELERY_DURAFLOW_* name in the docs is known for what it is."""
    found = documented_names()
    assert "DURAFLOW_CELERY_APP" in found and "duraflow_database_url" in found
    unknown = {name: sorted(where) for name, where in found.items() if classify(name) is None}
    assert unknown == {}, ("names in the docs that are no setting, variable, fixture or table "
                           f"of the package: {unknown}")


def test_documented_settings_pass_the_unknown_key_check() -> None:
    """Every documented setting passes check_keys where the docs say it goes."""
    for name in documented_names():
        kind = classify(name)
        if kind in ("setting", "django setting") and not name.startswith("DURAFLOW_"):
            check_keys({name: "x"}, {}, django_project=kind == "django setting"
                       or name.lower().removeprefix("celery_duraflow_") in DJANGO_KEYS
                       or name.removeprefix("duraflow_") in DJANGO_KEYS)
        elif kind in ("setting", "django setting"):
            # A DURAFLOW_* name is a Django setting (the Django app reads them all).
            check_keys({name: "x"}, {}, django_project=True)
            key = name.removeprefix("DURAFLOW_").lower()
            if kind == "setting" and key not in _config._NOT_FROM_ENVIRONMENT:
                check_keys({}, {name: "x"})
        elif kind in ("environment variable", "test variable"):
            check_keys({}, {name: "x"})
    for typo in TYPO_EXAMPLES:
        where = ({}, {typo: "x"}) if typo.startswith("DURAFLOW_") else ({typo: "x"}, {})
        with pytest.raises(ConfigurationError, match="Did you mean"):
            load_config(*where)


@pytest.mark.parametrize("name", ["DURAFLOW_CELERY_APPS", "duraflow_databse_url_x",
                                  "DURAFLOW_TEST_NOTHING_READS_THIS", "CELERY_DURAFLOW_WEB_TOKEN",
                                  "duraflow_tabels"])
def test_the_classifier_refuses_unknown_names(name: str) -> None:
    """A made-up name (a typo, a test variable nothing reads) is not classified as known."""
    assert classify(name) is None


# -- the README's install command brings what its example needs --------------------------------

#: The distribution that gives Celery (kombu) each broker transport of a URL scheme.
BROKER_CLIENTS = {"redis": {"redis"}, "rediss": {"redis"}, "amqp": set(), "pyamqp": set(),
                  "memory": set()}


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _requirement_names(extras: set[str]) -> set[str]:
    """The distributions (with Celery's extras, as ``celery[redis]``) an install of the
    package with ``extras`` asks for, following its own extras that name the package."""
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    optional = project["optional-dependencies"]
    names: set[str] = set()
    todo, seen = list(extras), set()
    requirements = list(project["dependencies"])
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        assert extra in optional, f"the docs install the extra {extra!r}, which is not declared"
        requirements += optional[extra]
    for requirement in requirements:
        match = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]+)\])?", requirement)
        assert match is not None
        name, inner = match.group(1).lower(), match.group(2)
        if name == "celery-duraflow":
            todo = [e.strip() for e in (inner or "").split(",") if e.strip()]
            names |= _requirement_names(set(todo)) - names
            continue
        names.add(name)
        for extra in (inner or "").split(","):
            if extra.strip():
                names.add(f"{name}[{extra.strip()}]")
    return names


def _provides(names: set[str], client: str) -> bool:
    """Whether the requirements bring the client (directly, or through celery[client])."""
    return client in names or f"celery[{client}]" in names or f"kombu[{client}]" in names


def _install_section(text: str) -> str:
    match = re.search(r"^## Install\n(.*?)(?=^## )", text, re.S | re.M)
    assert match is not None, "the README has no Install section"
    return match.group(1)


def test_readme_install_command_brings_the_client_of_the_readme_broker() -> None:
    """The README's first install command installs the client of its example's broker."""
    text = README.read_text(encoding="utf-8")
    schemes = set(re.findall(r"broker=[\"']([a-z]+)://", text))
    assert "redis" in schemes, schemes
    commands = re.findall(r"^pip install (.+?)(?:\s+#.*)?$", _install_section(text), re.M)
    assert commands, "the README's Install section has no pip install command"
    first = commands[0]
    extras = set(re.findall(r"\[([^\]]+)\]", first)[0].split(",")) if "[" in first else set()
    names = _requirement_names({e.strip() for e in extras})
    for scheme in schemes:
        for client in BROKER_CLIENTS[scheme]:
            assert _provides(names, client), (
                f"the README's example uses a {scheme}:// broker, but `pip install {first}` "
                f"does not install {client}")


# -- every install command works from a clone ---------------------------------------------------

#: A pip install of the package by its name, which fetches it from an index.
FROM_INDEX = re.compile(r"pip install\s+(?:-[A-Za-z-]+\s+)*['\"]?celery-duraflow(?:\[|\b)")
#: The package named as a requirement in prose (`celery-duraflow[otel]`).
PROSE_REQUIREMENT = re.compile(r"`celery-duraflow\[[^\]]+\]`")


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_install_commands_work_from_a_clone(page: Path) -> None:
    """No page installs celery-duraflow by name from an index: it is installed from a clone."""
    text = page.read_text(encoding="utf-8")
    bad = [line.strip() for line in text.splitlines()
           if FROM_INDEX.search(line) or PROSE_REQUIREMENT.search(line)]
    assert bad == [], f"{page.relative_to(ROOT)} installs the package from an index: {bad}"


def test_the_index_pattern_catches_what_it_must() -> None:
    """The install-command check flags index installs and passes installs from a clone."""
    for line in ("pip install 'celery-duraflow[web]'", 'pip install "celery-duraflow[otel]" x',
                 "$ pip install -U celery-duraflow", "pip install celery-duraflow"):
        assert FROM_INDEX.search(line), line
    for line in ("pip install -e 'path/to/celery-duraflow[web]'", "pip install -e '.[web]'",
                 "pip install -e path/to/celery-duraflow"):
        assert not FROM_INDEX.search(line), line


# -- schema versions quoted in the docs ---------------------------------------------------------

CURRENT_SCHEMA = re.compile(r"schema is (?:up to date \(version|at version) (\d+)")
DJANGO_MIGRATION = re.compile(r"\b(\d{4}_schema_v\d+)\b")


def test_schema_versions_in_the_docs_are_the_current_one() -> None:
    """Every 'schema is up to date (version N)' in the docs says the current version."""
    quoted: list[tuple[str, int]] = []
    for page in pages():
        for number in CURRENT_SCHEMA.findall(page.read_text(encoding="utf-8")):
            quoted.append((str(page.relative_to(ROOT)), int(number)))
    assert quoted, "no page quotes the schema version any more: drop or adapt this test"
    assert [q for q in quoted if q[1] != LATEST_VERSION] == [], (
        f"the current schema version is {LATEST_VERSION}")


def test_django_migrations_named_in_the_docs_exist() -> None:
    """Every NNNN_schema_vN migration a page names is one the Django app ships."""
    shipped = {p.stem for p in (PACKAGE / "contrib" / "django" / "migrations").glob("*.py")}
    for page in pages():
        for name in DJANGO_MIGRATION.findall(page.read_text(encoding="utf-8")):
            assert name in shipped, f"{page.relative_to(ROOT)} names migration {name}"


# -- the CLI reference as Sphinx builds it ------------------------------------------------------

TYPOGRAPHIC = "\u2013\u2014\u2018\u2019\u201c\u201d"


def test_docs_configuration_keeps_quotes_and_dashes_as_typed() -> None:
    """docs/conf.py turns docutils' smart quotes off and enables no MyST typography."""
    namespace: dict[str, object] = {"__file__": str(DOCS / "conf.py")}
    exec(compile((DOCS / "conf.py").read_text(encoding="utf-8"), "conf.py", "exec"), namespace)
    assert namespace.get("smartquotes") is False
    extensions = namespace.get("myst_enable_extensions", [])
    assert isinstance(extensions, list | tuple | set)
    assert not {"smartquotes", "replacements"} & set(extensions)


# Sphinx's extensions (MyST, sphinx-click) use APIs that Sphinx 11 removes; it warns.
@pytest.mark.filterwarnings("ignore::DeprecationWarning",
                            "ignore::PendingDeprecationWarning")
def test_built_cli_reference_has_no_typographic_quotes_or_dashes(tmp_path: Path) -> None:
    """The CLI reference, built with the docs' configuration, keeps -- and quotes as typed."""
    sphinx_application = pytest.importorskip("sphinx.application")
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(DOCS / "reference" / "cli.md", source / "index.md")
    out = tmp_path / "html"
    app = sphinx_application.Sphinx(
        srcdir=str(source), confdir=str(DOCS), outdir=str(out),
        doctreedir=str(tmp_path / "doctrees"), buildername="html", status=io.StringIO(),
        warning=io.StringIO(), freshenv=True)
    app.build()
    html = (out / "index.html").read_text(encoding="utf-8")
    body = html[html.index("<article"):html.index("</article>")]
    text = re.sub(r"<[^>]+>", "", body)
    assert "--from-step" in text and "duraflow retry" in text
    bad = [line.strip() for line in text.splitlines() if any(c in line for c in TYPOGRAPHIC)]
    assert bad == [], f"typographic characters in the CLI reference: {bad[:5]}"
