"""Filters that turn verify.yml's check results into one table a person reads.

A check result is a dict: layer, check, host ('cluster' for cluster-wide ones), passed (bool),
value and unit (what was measured), threshold (what passing needs, as text) and detail.
"""
from __future__ import annotations


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def verify_table(checks: list[dict]) -> str:
    """A fixed-width table, one line per check, failed checks marked, then a one-line verdict."""
    header = ("layer", "check", "host", "measured", "needs", "verdict")
    rows = []
    for check in sorted(checks, key=lambda c: (c.get("layer", ""), c.get("check", ""), c.get("host", ""))):
        measured = _cell(check.get("value"))
        if check.get("unit") and check.get("value") is not None:
            measured = f"{measured} {check['unit']}"
        rows.append((check.get("layer", "?"), check.get("check", "?"), check.get("host", "cluster"), measured,
                     _cell(check.get("threshold")),
                     "skip" if check.get("skipped") else "pass" if check.get("passed") else "FAIL"))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in [header, tuple("-" * w for w in widths), *rows]]
    failed = verify_failed(checks)
    skipped = [c for c in checks if c.get("skipped")]
    lines.append("")
    passed = len(checks) - len(failed) - len(skipped)
    summary = f"checks: {passed} passed, {len(failed)} failed, {len(skipped)} skipped"
    lines.append(summary if checks else "no checks ran")
    for check in failed:
        lines.append(f"FAIL {check.get('layer')}/{check.get('check')} on {check.get('host', 'cluster')}: "
                     f"{check.get('detail') or 'see the report'}")
    return "\n".join(lines)


def verify_failed(checks: list[dict]) -> list[dict]:
    """The checks that did not pass (a skipped check is not a failure)."""
    return [check for check in checks if not check.get("passed") and not check.get("skipped")]


class FilterModule:
    def filters(self):
        return {"verify_table": verify_table, "verify_failed": verify_failed}
