"""A small reader of Prometheus's text format, enough to check what our collectors write."""

from __future__ import annotations

import re

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)]; raises on a line that is not a comment and not a sample."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    types: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in types, f"line {number}: TYPE of {name} twice"
            types[name] = kind
            continue
        if line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        assert match, f"line {number} is not a sample: {line!r}"
        name, labels, value = match.groups()
        assert name in types, f"line {number}: {name} has no TYPE line before it"
        out.setdefault(name, []).append((dict(LABEL.findall(labels or "")), float(value)))
    return out


def value(metrics: dict, name: str, **labels: str) -> float:
    hits = [v for lab, v in metrics.get(name, []) if all(lab.get(k) == w for k, w in labels.items())]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples in {metrics.get(name)}"
    return hits[0]
