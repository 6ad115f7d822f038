"""Reading a Containerfile and its ignore file the way a builder does, for checks that need no builder.

The module has a name of its own so it cannot clash with other test folders' helpers.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str
    line: int

    def exec_form(self) -> list[str]:
        """The JSON array of ENTRYPOINT/CMD; a shell form gives an error (signals would not reach the command)."""
        value = json.loads(self.value)
        if not isinstance(value, list):
            raise ValueError(f"line {self.line}: {self.keyword} is not an exec-form array")
        return value

    def words(self) -> list[str]:
        return shlex.split(self.value)


def instructions(text: str) -> list[Instruction]:
    """Instructions in order, continuation lines joined, comments and blank lines dropped."""
    result: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction is not part of it
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(part for part in pending if part)
        keyword, _, value = joined.partition(" ")
        result.append(Instruction(keyword.upper(), value.strip(), start))
        pending = []
    return result


def arg_defaults(items: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for item in items:
        if item.keyword == "ARG":
            name, _, default = item.value.partition("=")
            defaults[name] = default.strip('"')
    return defaults


def _pattern_matches(pattern: str, path: str) -> bool:
    regex = fnmatch.translate(pattern.replace("**/", "\0")).replace("\\x00", "(?:.*/)?").replace("\0", "(?:.*/)?")
    return re.match(regex, path) is not None


def kept_by_ignore_file(ignore_text: str, path: str) -> bool:
    """True when a builder sends `path` (relative to the context) under these .dockerignore rules: the last rule
    that matches the path or one of its parent folders decides; `!` rules keep."""
    rules = [line.strip() for line in ignore_text.splitlines() if line.strip() and not line.strip().startswith("#")]
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    kept = True
    for rule in rules:
        keep = rule.startswith("!")
        pattern = rule[1:] if keep else rule
        if any(_pattern_matches(pattern.strip("/"), candidate) for candidate in candidates):
            kept = keep
    return kept
