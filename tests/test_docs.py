"""The docs say what the code does: the reference tables, the tests the guarantees name, the links.

docs/reference.md is the reference users read for option names, CLI flags and metric names; each of its
tables is compared with the code both ways (nothing missing, nothing extra), and a failure names the
difference. Every ``tests/test_x.py::name`` a document cites must be a test that exists, and every
relative link in README.md and docs/*.md must reach an existing file (and heading, for a ``#fragment``),
and the Python examples of the README and the guide must name only what the package exports.
No Redis is needed: the tables are read from the code, the metrics from the registries the package fills.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from dramatiq_leases import Leases
from dramatiq_leases.cli import build_parser
from dramatiq_leases.exporter.observer import LeaseObserver
from dramatiq_leases.middleware import ACTOR_OPTIONS, LeaseMiddleware
from dramatiq_leases.prometheus import PrometheusMetrics

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"
#: Every document users read: the landing page, the changelog and the manual.
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])


# --- reading Markdown ---------------------------------------------------------------------------------


def section(text: str, heading: str) -> str:
    """The body of the section under ``heading`` (a whole heading line), up to the next heading of its level
    or higher."""
    lines = text.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        raise AssertionError(f"docs/reference.md has no heading {heading!r}") from None
    level = len(heading) - len(heading.lstrip("#"))
    body = []
    for line in lines[start + 1 :]:
        hashes = len(line) - len(line.lstrip("#"))
        if 0 < hashes <= level and line[hashes : hashes + 1] == " ":
            break
        body.append(line)
    return "\n".join(body)


def first_column(body: str, header: str) -> list[str]:
    """The backticked names in the first column of the first table whose first header cell is ``header``."""
    rows = [line for line in body.splitlines() if line.startswith("|")]
    for i, row in enumerate(rows):
        if row.split("|")[1].strip() == header:
            names = []
            for line in rows[i + 2 :]:
                if line.split("|")[1].strip() == header:
                    break  # the next table
                names.extend(re.findall(r"`([^`]+)`", line.split("|")[1]))
            return names
    raise AssertionError(f"no table headed {header!r} in this section of docs/reference.md")


def exactly(documented: Iterable[str], actual: Iterable[str], what: str) -> None:
    """Fail naming what the docs miss and what they list that the code lacks."""
    documented, actual = list(documented), set(actual)
    twice = sorted({name for name in documented if documented.count(name) > 1})
    missing, extra = sorted(actual - set(documented)), sorted(set(documented) - actual)
    assert not (missing or extra or twice), (
        f"{what}: missing from docs/reference.md: {missing}; listed but not in the code: {extra}; listed twice: {twice}"
    )


REFERENCE_TEXT = REFERENCE.read_text()


# --- (a) options --------------------------------------------------------------------------------------


def test_the_options_table_lists_exactly_the_options_the_middleware_accepts() -> None:
    table = first_column(section(REFERENCE_TEXT, "## Actor and message options"), "option")
    exactly(table, ACTOR_OPTIONS, "actor/message options (dramatiq_leases.middleware.ACTOR_OPTIONS)")


def test_the_middleware_parameters_are_the_options_and_the_store_wide_table() -> None:
    """Each option is also a LeaseMiddleware parameter (its default); the rest are documented store-wide."""
    params = set(inspect.signature(LeaseMiddleware.__init__).parameters) - {"self"}
    assert ACTOR_OPTIONS - {"lock_key"} <= params, f"options without a middleware default: {ACTOR_OPTIONS - params}"
    table = first_column(section(REFERENCE_TEXT, "## Middleware parameters"), "parameter")
    exactly(table, params - ACTOR_OPTIONS, "LeaseMiddleware's store-wide parameters")


# --- (b) the CLI --------------------------------------------------------------------------------------

#: A long flag as the synopsis writes it: ``--name``, not a metavar nor a choice.
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?:\.[a-z][a-z0-9-]*)*")  # --web.config.file, as Prometheus writes it


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name, aliases included."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def long_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The parser's long flags, but those hidden from ``--help`` (removed flags, refused naming their replacement)."""
    return {
        s
        for a in parser._actions
        if a.help != argparse.SUPPRESS
        for s in a.option_strings
        if s.startswith("--") and s != "--help"
    }


def synopsis() -> tuple[set[str], dict[str, set[str]], set[str]]:
    """The synopsis block of the CLI section: its global flags, each command's flags, and the aliases."""
    body = section(REFERENCE_TEXT, "## CLI")
    block = body.split("```", 2)[1]
    global_flags: set[str] = set()
    commands: dict[str, set[str]] = {}
    aliases: set[str] = set()
    current: set[str] = global_flags
    for line in block.splitlines():
        if line.startswith("dramatiq-leases"):
            match = re.match(r"dramatiq-leases\s+(?:\[[^\]]*\]\s*)*(\S+)", line)
            assert match, f"a synopsis line without a command: {line!r}"
            command = match.group(1)
            current = global_flags if command == "COMMAND" else commands.setdefault(command, set())
            aliases.update(re.findall(r"\(alias: ([\w-]+)\)", line))
        current.update(FLAG.findall(line))
    return global_flags, commands, aliases


def test_the_cli_synopsis_names_every_command_and_flag_of_the_parser() -> None:
    parser = build_parser()
    global_flags, commands, aliases = synopsis()
    subs = subcommands(parser)
    exactly([*commands, *aliases], subs, "dramatiq-leases commands (aliases included)")
    exactly(global_flags, long_flags(parser), "global flags of dramatiq-leases")
    for name, flags in commands.items():
        # Every subcommand inherits the global flags; the synopsis writes them once.
        exactly(flags, long_flags(subs[name]) - long_flags(parser), f"flags of dramatiq-leases {name}")


def test_each_command_has_a_table_of_exactly_its_flags() -> None:
    parser = build_parser()
    table = first_column(section(REFERENCE_TEXT, "### Global flags"), "flag")
    exactly(table, long_flags(parser), "the global flags table")
    _, commands, _ = synopsis()
    for name in commands:
        table = first_column(section(REFERENCE_TEXT, f"### `{name}`"), "flag")
        exactly(table, long_flags(subcommands(parser)[name]) - long_flags(parser), f"the table of `{name}`")


def test_the_exit_codes_table_matches_the_commands_help() -> None:
    from dramatiq_leases.cli import EXIT_CODES_HELP

    helped = re.findall(r"^  (\d+) ", EXIT_CODES_HELP, flags=re.MULTILINE)
    table = re.findall(r"^\| (\d+) \|", section(REFERENCE_TEXT, "### Exit codes"), flags=re.MULTILINE)
    exactly(table, helped, "exit codes (dramatiq_leases.cli.EXIT_CODES_HELP)")


# --- (c) metrics --------------------------------------------------------------------------------------


def exposed(families: Iterable[Metric]) -> dict[str, str]:
    """Metric families as their exposition names them (a counter's ``_total``), with their type."""
    names = {}
    for family in families:
        name, kind = family.name, family.type
        names[f"{name}_total" if kind == "counter" else name] = kind
    return names


def metrics_table(heading: str) -> dict[str, str]:
    rows = [line for line in section(REFERENCE_TEXT, heading).splitlines() if line.startswith("| `")]
    documented = {}
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        name = cells[0].strip("`")
        assert name not in documented, f"{heading}: {name} listed twice"
        documented[name] = cells[1]
    return documented


def test_the_worker_metrics_table_lists_exactly_what_the_middleware_emits() -> None:
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    metrics.declare_process()  # creates every metric on this registry, as a worker's boot does
    emitted = exposed(registry.collect())
    documented = metrics_table("### Worker metrics")
    exactly(documented, emitted, "worker metrics (PrometheusMetrics)")
    wrong = {name: (documented[name], kind) for name, kind in emitted.items() if documented[name] != kind}
    assert not wrong, f"worker metrics documented with the wrong type (documented, emitted): {wrong}"


def test_the_exporter_metrics_table_lists_exactly_what_the_exporter_emits() -> None:
    # collect() serves the last scan and never calls Redis: an address with nothing behind it will do.
    observer = LeaseObserver(Leases.from_url("redis://127.0.0.1:1/0"))
    emitted = exposed(observer.collect())
    documented = metrics_table("### Exporter metrics")
    exactly(documented, emitted, "exporter metrics (LeaseObserver)")
    wrong = {name: (documented[name], kind) for name, kind in emitted.items() if documented[name] != kind}
    assert not wrong, f"exporter metrics documented with the wrong type (documented, emitted): {wrong}"


# --- (d) the tests the docs cite ----------------------------------------------------------------------

#: ``tests/test_x.py::name`` or ``tests/test_x.py::Class::name``.
CITED_TEST = re.compile(r"tests/([\w/]+\.py)::([\w:]+)")


def defined_tests(path: Path) -> set[str]:
    """Names of the functions a test module defines, classes' as ``Class::name``."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}::{m.name}" for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
    return names


def citations() -> Iterator[tuple[str, str, str]]:
    for doc in DOCUMENTS:
        for module, name in CITED_TEST.findall(doc.read_text()):
            yield doc.relative_to(ROOT).as_posix(), module, name


def test_every_test_the_docs_cite_exists() -> None:
    cited = list(citations())
    assert len({(m, n) for _, m, n in cited}) >= 40, "docs/guarantees.md should cite the tests of each promise"
    missing = []
    for doc, module, name in cited:
        path = ROOT / "tests" / module
        if not path.is_file() or name not in defined_tests(path):
            missing.append(f"{doc}: tests/{module}::{name}")
    assert not missing, "cited tests that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_every_test_module_the_docs_name_exists() -> None:
    missing = {
        f"{doc.relative_to(ROOT)}: {path}"
        for doc in DOCUMENTS
        for path in re.findall(r"tests/[\w/]+\.py", doc.read_text())
        if not (ROOT / path).is_file()
    }
    assert not missing, "test modules named that do not exist:\n" + "\n".join(sorted(missing))


def test_every_guarantee_names_a_test() -> None:
    text = (ROOT / "docs" / "guarantees.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    assert len(sections) >= 15
    bare = [s.splitlines()[0] for s in sections if not CITED_TEST.search(s)]
    assert not bare, f"guarantees without a test: {bare}"


# --- (e) links ----------------------------------------------------------------------------------------

#: The target of a Markdown link or image, ``[text](target)``.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            name, n = base, 0
            while name in found:  # GitHub numbers repeated headings
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where ``](`` is not a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


@pytest.mark.parametrize("doc", [d for d in DOCUMENTS if d.name != "CHANGELOG.md"], ids=lambda d: d.name)
def test_every_relative_link_reaches_a_file_and_heading(doc: Path) -> None:
    broken = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{target}: no heading #{fragment} in {path.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(sorted(set(broken)))


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("doc", [ROOT / "README.md", ROOT / "docs" / "guide.md"], ids=lambda d: d.name)
def test_the_python_examples_parse_and_name_what_the_package_exports(doc: Path) -> None:
    """A renamed export breaks the example that shows it: every name imported from the package, and every
    attribute read from a module so imported (``web.try_acquire``), must exist."""
    import importlib

    blocks = python_blocks(doc.read_text())
    assert blocks, f"{doc.name} has no Python example"
    wrong = []
    for block in blocks:
        tree = ast.parse(block)
        modules: dict[str, object] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dramatiq_leases"):
                package = importlib.import_module(node.module or "")
                for alias in node.names:
                    try:  # a name the package defines, or a submodule of it (``from dramatiq_leases import web``)
                        value = getattr(package, alias.name, None) or importlib.import_module(
                            f"{node.module}.{alias.name}"
                        )
                    except ImportError:
                        wrong.append(f"from {node.module} import {alias.name}")
                    else:
                        modules[alias.asname or alias.name] = value
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner = modules.get(node.value.id)
                if inspect.ismodule(owner) and not hasattr(owner, node.attr):
                    wrong.append(f"{node.value.id}.{node.attr}")
    assert not wrong, f"{doc.name}'s examples name what the package does not have: {sorted(set(wrong))}"


def test_the_readme_is_a_landing_page() -> None:
    """About 150 lines: install, quickstart, the promises in a line each, where to read on."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 180
    for needed in ("pip install dramatiq-leases", "LeaseMiddleware", "lock_key", "current_lease", "make demo"):
        assert needed in text, f"README.md does not mention {needed}"
    assert "docs/guarantees.md" in text and "docs/guide.md" in text and "docs/reference.md" in text


# --- (f) the architecture names every module, in its layer -----------------------------------------------

PACKAGE = ROOT / "dramatiq_leases"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def package_modules() -> set[str]:
    """Every module of the package and every Lua script, as paths under ``dramatiq_leases/``."""
    found = [*PACKAGE.rglob("*.py"), *(PACKAGE / "core" / "lua").glob("*.lua")]
    return {path.relative_to(PACKAGE).as_posix() for path in found}


def architecture_layers() -> list[tuple[str, list[str]]]:
    """The ``###`` layers of docs/architecture.md's module list, bottom first, with the modules each names
    (the backticked paths in its tables' first column)."""
    body = section(ARCHITECTURE.read_text(), "## What each module owns")
    layers = []
    for part in re.split(r"^### ", body, flags=re.MULTILINE)[1:]:
        title, _, rest = part.partition("\n")
        rows = [line for line in rest.splitlines() if line.startswith("| `")]
        layers.append((title.strip(), [name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])]))
    return layers


def imported_modules(module: str) -> set[str]:
    """The package's modules that ``module`` (a path under ``dramatiq_leases/``) imports, ``TYPE_CHECKING``
    imports and imports inside functions too."""
    here = module.split("/")[:-1]

    def resolve(parts: list[str], names: Iterable[str]) -> Iterator[str]:
        base = "/".join(parts)
        package = (PACKAGE / base / "__init__.py").is_file()
        yield f"{base}/__init__.py".lstrip("/") if package else f"{base}.py"
        for name in names:  # ``from . import web``: a submodule too
            if package and (PACKAGE / base / f"{name}.py").is_file():
                yield f"{base}/{name}.py".lstrip("/")

    found: set[str] = set()
    for node in ast.walk(ast.parse((PACKAGE / module).read_text())):
        if isinstance(node, ast.ImportFrom):
            dotted = (node.module or "").split(".") if node.module else []
            if node.level:
                parts = here[: len(here) - node.level + 1] + dotted
            elif dotted[:1] == ["dramatiq_leases"]:
                parts = dotted[1:]
            else:
                continue
            found.update(resolve(parts, [] if node.module else [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                dotted = alias.name.split(".")
                if dotted[0] == "dramatiq_leases":
                    found.update(resolve(dotted[1:], []))
    return found


def test_the_architecture_names_every_module_in_its_layer() -> None:
    """docs/architecture.md names every module and Lua script once, in one of its layers (core, integrations,
    tools), and no module imports one of a layer above its own."""
    layers = architecture_layers()
    assert len(layers) == 3 and layers[0][0] == "Core", (
        f"docs/architecture.md's module list should have three layers, core first: {[t for t, _ in layers]}"
    )
    named = [name for _, names in layers for name in names]
    actual = package_modules()
    missing, extra = sorted(actual - set(named)), sorted(set(named) - actual)
    twice = sorted({name for name in named if named.count(name) > 1})
    assert not (missing or extra or twice), (
        f"docs/architecture.md's module list: missing {missing}; names what does not exist {extra}; twice {twice}"
    )
    layer = {name: i for i, (_, names) in enumerate(layers) for name in names}
    upward = [
        f"{module} ({layers[layer[module]][0]}) imports {target} ({layers[layer[target]][0]})"
        for module in sorted(m for m in actual if m.endswith(".py"))
        for target in sorted(imported_modules(module))
        if layer[target] > layer[module]
    ]
    assert not upward, "imports pointing up a layer of docs/architecture.md:\n" + "\n".join(upward)


# --- (g) the guide's contents -------------------------------------------------------------------------------

GUIDE = ROOT / "docs" / "guide.md"


def headings(text: str, level: int) -> list[str]:
    """The text of every heading of ``level`` outside fenced code, in order."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#" * level + " "):
            found.append(line[level + 1 :].strip())
    return found


def test_the_guide_contents_list_every_section_in_order() -> None:
    """The list at the top of docs/guide.md (before its first ``##``) links every ``##`` section, in the
    document's order, by its heading's text and anchor; ``###`` subsections are left to their section."""
    text = GUIDE.read_text()
    top = text.split("\n## ", 1)[0]
    entries = re.findall(r"^- \[(.+)\]\(#([^)\s]+)\)\s*$", top, flags=re.MULTILINE)
    sections = headings(text, 2)
    listed = [title for title, _ in entries]
    missing = [s for s in sections if s not in listed]
    extra = [t for t in listed if t not in sections]
    assert not (missing or extra), f"docs/guide.md's contents: missing {missing}; no such section {extra}"
    assert listed == sections, f"docs/guide.md's contents are not in the sections' order: {listed}"
    wrong = [f"{title} -> #{anchor}" for title, anchor in entries if anchor != slug(title)]
    assert not wrong, f"docs/guide.md's contents link anchors other than their headings': {wrong}"


# --- (h) the changelog ------------------------------------------------------------------------------------

#: Keep a Changelog's kinds of change (and ours, Renamed), each a ``###`` heading, with what changed after.
CHANGE_KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security", "Renamed")


def test_the_changelog_headings_say_what_changed_not_tracker_numbers() -> None:
    """Releases are ``## [version]`` headings, each linked at the bottom; changes are ``### Kind`` headings
    (``### Fixed: what``); no heading or entry names an issue, a ticket or a stop of the tracker."""
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = headings(text, 2)
    assert releases and releases[0] == "[Unreleased]", f"CHANGELOG.md should open with [Unreleased]: {releases[:1]}"
    wrong = [r for r in releases if not re.fullmatch(r"\[(Unreleased|\d+\.\d+\.\d+)\]( - \d{4}-\d{2}-\d{2})?", r)]
    unlinked = [r for r in releases if not re.search(rf"^{re.escape(r.split()[0])}: https://", text, flags=re.M)]
    kinds = [h for h in headings(text, 3) if not h.startswith(CHANGE_KINDS)]
    tracker = re.findall(r"^.*\b(?:issues?|tickets?|stops?) #?\d+\b.*$|^.*(?<![\w&])#\d+\b.*$", text, flags=re.M)
    assert not (wrong or unlinked or kinds or tracker), (
        f"CHANGELOG.md: releases not [version]: {wrong}; releases without a link: {unlinked}; "
        f"change headings not of a kind {CHANGE_KINDS}: {kinds}; lines naming tracker numbers: {tracker}"
    )
