"""Render the generated part of docs/api.md from the public API's names, signatures and docstrings.

``python -m tools.apidoc`` rewrites it; tests/test_api.py fails when the file and the code disagree, so the
reference cannot drift from what the package exports.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

#: The public modules: their ``__all__`` is the public API (every other module is internal).
PUBLIC_MODULES = ("dramatiq_leases", "dramatiq_leases.web", "dramatiq_leases.embedded")

MARKER = "<!-- Generated below by `python -m tools.apidoc` from the code: do not edit by hand. -->"
API_MD = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _summary(obj: Any) -> str:
    """The first paragraph of ``obj``'s own docstring, on one line."""
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _signature(obj: Any) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    text = re.sub(r"ForwardRef\('([^']*)'\)", r"'\1'", text)
    text = re.sub(r"<([\w.]+) object at 0x[0-9a-f]+>", r"\1()", text)  # defaults that are instances
    return text.replace("dramatiq_leases.core.metrics.LeaseMetrics()", "LeaseMetrics()")  # the no-op default


def _fields(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "_fields", ()))


def public_members(cls: type) -> list[tuple[str, Any]]:
    """The members a user may rely on: defined on ``cls`` itself or a base of this package, not ``_``-named
    (fields are listed apart)."""
    fields = _fields(cls)
    out: list[tuple[str, Any]] = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("dramatiq_leases"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in dict(out) or name in fields:
                continue
            if isinstance(cls, enum.EnumMeta) and name in cls.__members__:
                continue
            out.append((name, value))
    return sorted(out)


def _member(cls: type, name: str, value: Any) -> str:
    if isinstance(value, property):
        return f"- `{name}` (property): {_summary(value)}"
    if isinstance(value, (classmethod, staticmethod)):
        func = value.__func__
        return f"- `{name}{_signature(getattr(cls, name))}`: {_summary(func)}"
    if callable(value):
        return f"- `{name}{_signature(value)}`: {_summary(value)}"
    if inspect.ismemberdescriptor(value):
        return f"- `{name}` (attribute)"
    return f"- `{name}` = `{value!r}`"


def _entry(module: str, name: str, obj: Any) -> list[str]:
    lines = [f"### `{module}.{name}`", ""]
    if inspect.isclass(obj):
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        head = f"class `{name}({', '.join(bases)})`" if bases else f"class `{name}`"
        if not issubclass(obj, enum.Enum) and not issubclass(obj, BaseException):
            head += f", constructed as `{name}{_signature(obj)}`"
        lines += [head, "", _summary(obj), ""]
        if issubclass(obj, enum.Enum):
            lines += [f"- `{m.name}` = `{m.value!r}`" for m in obj]
        elif dataclasses.is_dataclass(obj):
            lines += [f"- `{f.name}`: `{f.type}`" for f in dataclasses.fields(obj)]
        elif issubclass(obj, tuple) and hasattr(obj, "_fields"):
            hints = {
                k: v if isinstance(v, str) else getattr(v, "__forward_arg__", repr(v))
                for k, v in obj.__annotations__.items()
            }
            lines += [f"- `{f}`: `{hints.get(f, '')}`" for f in obj._fields]
        lines += [_member(obj, n, v) for n, v in public_members(obj)]
    elif callable(obj):
        lines += [f"`{name}{_signature(obj)}`", "", _summary(obj)]
    else:
        lines += [f"`{name}` = `{obj!r}`"]
    return [*lines, ""]


def render() -> str:
    """The generated part of docs/api.md."""
    out = [MARKER, ""]
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        out += [f"## `{module_name}`", "", _summary(module), ""]
        for name in sorted(module.__all__):
            if name == "__version__":
                out += ["### `dramatiq_leases.__version__`", "", "The version (pyproject reads it from here).", ""]
                continue
            out += _entry(module_name, name, getattr(module, name))
    return "\n".join(out).rstrip() + "\n"


def current() -> str:
    """docs/api.md as it is."""
    return API_MD.read_text()


def rewritten() -> str:
    """docs/api.md with its generated part rendered anew (its hand-written head kept)."""
    head = current().split(MARKER, 1)[0]
    return head + render()


def main() -> int:
    API_MD.write_text(rewritten())
    print(f"wrote {API_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
