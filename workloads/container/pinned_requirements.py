"""Print the sd3cluster package's dependencies, each pinned as the repository's requirements.txt pins it.

The image installs these before it copies the package's source, so a change to the source rebuilds one small
layer, not torch's. One list of pins (requirements.txt) serves the project's own venv, the nodes and the image.
Usage: pinned_requirements.py PYPROJECT REQUIREMENTS [--torch REQUIREMENT] [--extra NAME ...]
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str) -> dict[str, str]:
    """requirements.txt lines of the form name==version (extras dropped), by canonical name."""
    pins: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;]+)$", line)
        if match:
            pins[canonical(match.group(1))] = f"{match.group(1)}=={match.group(3)}"
    return pins


def pinned(pyproject: dict, pins: dict[str, str], extras: list[str], torch: str | None) -> list[str]:
    """Every dependency of the project (and of the named extras), pinned where requirements.txt pins it;
    an unpinned one keeps the range pyproject.toml gives. `torch` replaces torch's requirement."""
    project = pyproject["project"]
    wanted = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"pinned_requirements: pyproject.toml has no extra '{extra}' "
                             f"(it has: {', '.join(sorted(optional)) or 'none'})")
        wanted += optional[extra]
    lines = []
    for requirement in wanted:
        name = canonical(_NAME.match(requirement).group(1))
        if name == "torch" and torch:
            lines.append(torch)
        else:
            lines.append(pins.get(name, requirement))
    return list(dict.fromkeys(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("requirements", type=Path)
    parser.add_argument("--torch", default="", help="torch requirement instead of the pinned one")
    parser.add_argument("--extra", action="append", default=[], help="an optional-dependencies group too")
    args = parser.parse_args(argv)
    pyproject = tomllib.loads(args.pyproject.read_text())
    pins = read_pins(args.requirements.read_text())
    print("\n".join(pinned(pyproject, pins, args.extra, args.torch or None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
