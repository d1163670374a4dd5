"""The Lua as Redis runs it: helpers written once, every constant one value shared with Python, every argument
named once. These read the scripts' text (``core/lua/*.lua`` and what the loader builds from it) and load it on
a real Redis; the argument bounds are tried on the server in test_script_arguments.py."""

from __future__ import annotations

import re
from importlib.resources import files

import pytest
import redis

from dramatiq_leases.core import scripts

LUA = files("dramatiq_leases.core").joinpath("lua")
#: The .lua files, by name, as written (before the loader).
SOURCES = {
    name: LUA.joinpath(f"{scripts.FILES.get(name, name)}.lua").read_text(encoding="utf-8") for name in scripts.ALL
}
#: A numbered header line: ``--   N name: what it is`` (``N..`` for the rest of the arguments).
ARGUMENT = re.compile(r"^--   (\d+)(\.\.)? (\w+): ")
#: A field of an argument carrying several: ``--       name: what it is``.
FIELD = re.compile(r"^--       (\w+): ")


def code(source: str) -> str:
    """The script without its comments (none of the scripts has ``--`` inside a string)."""
    return re.sub(r"--[^\n]*", "", source)


def header(name: str) -> dict[str, list[str]]:
    """The names a script's header gives its KEYS and ARGV, in order (with the fields of an argument after it)."""
    lines = SOURCES[name].splitlines()
    sections: dict[str, list[str]] = {"KEYS": [], "ARGV": []}
    current = ""
    for text in lines:
        if not text.startswith("--") or text.startswith("--#"):
            break
        if text in ("-- KEYS:", "-- ARGV:") or text == "-- ARGV: none":
            current = text[3:7]
            continue
        match = ARGUMENT.match(text)
        field = FIELD.match(text)
        if current and match:
            assert int(match.group(1)) == len([n for n in sections[current] if not n.startswith(".")]) + 1, text
            sections[current].append(match.group(3))
        elif current and field:
            sections[current].append("." + field.group(1))  # a field of the argument before it
        elif not text.startswith("--     "):
            current = ""  # the replies and the rest of the header
    return sections


@pytest.mark.parametrize("name", sorted(scripts.ALL))
def test_each_header_names_each_key_and_argument_on_its_own_line_as_the_script_does(name: str) -> None:
    """The header is the script's interface: one line per key and argument, numbered in order, and each argument
    named as the script names it (its local, or the error that refuses it): one name per argument."""
    assert SOURCES[name].startswith("-- KEYS:\n"), name
    names = header(name)
    assert names["KEYS"], name
    body = code(SOURCES[name])
    for argument in names["ARGV"]:
        assert re.search(rf"\b{argument.lstrip('.')}\b", body), f"{name}.lua never names its argument {argument}"
    # Every argument an error refuses by one name is refused under its header's name.
    arguments = {a.lstrip(".") for a in names["ARGV"]}
    refused = set(re.findall(r"\bbad\('(\w+)'[,)]", body))
    assert refused <= arguments, f"{name}.lua refuses {refused - arguments}, not in its header"
    # And its number is the header's: bad('ttl_ms', ARGV[2]) is the header's line "2 ttl_ms".
    numbered = [n for n in names["ARGV"] if not n.startswith(".")]
    for argument, index in re.findall(r"\bbad\('(\w+)', ARGV\[(\d+)\]", body):
        assert numbered.index(argument) + 1 == int(index), f"{name}.lua: {argument} is not ARGV[{index}]"


def test_every_constant_the_lua_uses_is_declared_by_the_loader_from_python() -> None:
    """No number is written twice: the .lua files declare no constant, the loader declares each one a script
    names (after the header) with the value Python has, and every constant Python declares is used."""
    prelude = LUA.joinpath("prelude.lua").read_text(encoding="utf-8")
    for name, source in [*SOURCES.items(), ("prelude", prelude)]:
        assert not re.search(r"\blocal\s+[A-Z][A-Z0-9_]*\s*=\s*[\d-]", code(source)), (
            f"{name}.lua declares a number: it belongs in scripts.LUA_CONSTANTS"
        )
    used: set[str] = set()
    for name, built in scripts.ALL.items():
        body = re.sub(r"'[^'\n]*'", "''", code(built))  # Redis commands are strings
        locals_ = set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", " ".join(re.findall(r"\blocal ([\w, ]+) =", body))))
        named = set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", body)) - {"KEYS", "ARGV"}
        constants = {n for n in named if n in locals_ and f"local {n} = " in built and n in scripts.LUA_CONSTANTS}
        assert named - (locals_ - set(scripts.LUA_CONSTANTS)) <= set(scripts.LUA_CONSTANTS), (
            f"{name}: {named - locals_ - set(scripts.LUA_CONSTANTS)} never declared"
        )
        for constant in named & set(scripts.LUA_CONSTANTS):
            assert f"\nlocal {constant} = {scripts.LUA_CONSTANTS[constant]}\n" in built, (name, constant)
            assert built.count(f"local {constant} =") == 1, (name, constant)
        used |= constants
    assert used == set(scripts.LUA_CONSTANTS), f"declared, never used: {set(scripts.LUA_CONSTANTS) - used}"


def test_the_constants_keep_the_scripts_arithmetic_exact() -> None:
    """Python imports the scripts' own constants (one definition); their sums must stay exact in Lua."""
    # Sums of a time and two bounded arguments (now + park_ms + promote_ms) stay exact in Lua's doubles.
    assert scripts.MAX_TIMESTAMP_MS + 2 * scripts.MAX_MS < 2**53


def test_each_helper_is_written_once_in_the_prelude() -> None:
    """The helpers the scripts share live in lua/prelude.lua only; a script gets them by --#include."""
    prelude = LUA.joinpath("prelude.lua").read_text(encoding="utf-8")
    helpers = re.findall(r"^local function (\w+)", prelude, re.MULTILINE)
    assert {"whole", "bad", "server_time", "declared_slots", "entry", "line_front", "call_forward"} <= set(helpers)
    for name, source in SOURCES.items():
        for helper in helpers:
            assert not re.search(rf"\bfunction {helper}\b", source), f"{name}.lua defines {helper} again"
            if re.search(rf"\b{helper}\(", code(source)):
                assert scripts.ALL[name].count(f"local function {helper}(") == 1, (name, helper)
        assert "redis.call('TIME')" not in source, f"{name}.lua reads the server time itself: use server_time"


def test_the_uncontended_paths_create_no_line_helper() -> None:
    """Figure 1's path (acquire of a free key with no line, release without one) runs past no closure it does
    not call: the line's helpers are included after it."""
    for name, fast_path_end in (
        ("acquire", "if count == 0 and not lined and grace_left <= 0 and rate_left <= 0 then"),
        ("acquire_latest", "if count == 0 and not lined and not older and grace_left <= 0 and rate_left <= 0 then"),
        ("release", "if waiter == '' and"),
    ):
        built = scripts.ALL[name]
        before = built[: built.index(fast_path_end)]
        assert "local function entry(" not in before and "local function call_forward(" not in before, name
        assert "local function entry(" in built, name


def test_the_loader_refuses_an_unknown_or_repeated_section() -> None:
    sections = {"args": "local function whole() end\n"}
    with pytest.raises(ValueError, match="unknown"):
        scripts._build("-- KEYS:\n--#include clock\nreturn 1\n", sections)
    with pytest.raises(ValueError, match="twice"):
        scripts._build("-- KEYS:\n--#include args\n--#include args\nreturn 1\n", sections)


def test_every_script_as_built_compiles_on_the_server(redis_client: redis.Redis) -> None:
    """Redis compiles each script once loaded: Lua 5.1 and no global (Redis 7 refuses them)."""
    for name, built in scripts.ALL.items():
        sha = redis_client.script_load(built)
        assert redis_client.script_exists(sha) == [True], name


def test_the_suite_runs_every_script_with_the_declared_keys_check() -> None:
    """tests/__init__.py turns the check on for every process of the suite: no script here runs without it."""
    assert scripts.CHECK_KEYS
    for name, built in scripts.ALL.items():
        assert "local function __check(" in built, name
        calls = code(built).replace("return redis.call(cmd", "").replace("return redis.pcall(cmd", "")
        assert "redis.call(" not in calls and "redis.pcall(" not in calls, name


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ("return redis.call('GET', 'other')", "undeclared key other (GET)"),
        ("return redis.pcall('HGET', 'other', 'f')", "undeclared key other (HGET)"),
        ("return redis.call('EXISTS', KEYS[1], 'other')", "undeclared key other (EXISTS)"),
        ("return redis.call('DEL', 'other', KEYS[1])", "undeclared key other (DEL)"),
        ("return redis.call('RENAME', KEYS[1], 'other')", "command not checked: RENAME"),
    ],
)
def test_the_check_fails_a_script_on_a_key_it_was_not_given(redis_client: redis.Redis, body: str, refused: str) -> None:
    """What makes a key built inside a script fail the suite, as Dragonfly would fail it in production; keys
    given, and commands without keys, pass."""
    built = scripts._build(f"-- KEYS:\n{body}\n", {}, check=True)
    with pytest.raises(redis.ResponseError, match=re.escape(refused)):
        redis_client.eval(built, 1, "mine")
    allowed = "redis.call('SET', KEYS[1], 1) redis.call('PUBLISH', 'channel', 1) return redis.call('EXISTS', KEYS[1])"
    assert redis_client.eval(scripts._build(f"-- KEYS:\n{allowed}\n", {}, check=True), 1, "mine") == 1
