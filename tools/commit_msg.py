"""A ``commit-msg`` hook: a commit's subject (its first line) is at most 72 characters.

pre-commit runs it on the message file git hands the hook (``.pre-commit-config.yaml``); by hand,
``python -m tools.commit_msg FILE``. Git's comment lines (``#``) and blank lines before the subject are
not the subject; an empty message is left to git to refuse.
"""

from __future__ import annotations

import sys
from pathlib import Path

#: The longest subject: what ``git log --oneline`` and most tools show without cutting it.
MAX_SUBJECT = 72


def subject(message: str) -> str:
    """The message's first line that is neither blank nor a git comment."""
    for line in message.splitlines():
        if line.strip() and not line.startswith("#"):
            return line.rstrip()
    return ""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tools.commit_msg MESSAGE_FILE", file=sys.stderr)
        return 2
    line = subject(Path(args[0]).read_text(encoding="utf-8", errors="replace"))
    if len(line) > MAX_SUBJECT:
        print(f"commit subject is {len(line)} characters, at most {MAX_SUBJECT}: {line!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
