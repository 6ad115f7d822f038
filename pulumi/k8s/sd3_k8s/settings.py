"""Reading one stack setting into a typed value, or stopping with a message that names the key and the fix.

Keys of structured settings (a map such as `serving`) are named by their path: `sd3-cluster-k8s:serving.minReplicas`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class ConfigError(ValueError):
    """A stack setting is wrong; the message names the key and the fix."""


def key(name: str, section: str = "") -> str:
    return f"sd3-cluster-k8s:{section}{name}"


def _set_hint(name: str, section: str, example: str) -> str:
    if section:
        return f"`pulumi config set --path {section}{name} {example}`"
    return f"`pulumi config set {name} {example}`"


def integer(values: Mapping[str, Any], name: str, default: int | None, section: str = "") -> int | None:
    raw = values.get(name, default)
    if raw is None:
        return None
    problem = f"{key(name, section)} is '{raw}', not a whole number: set it with {_set_hint(name, section, 'N')}"
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
        raise ConfigError(problem)
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ConfigError(problem) from None


def boolean(values: Mapping[str, Any], name: str, default: bool, section: str = "") -> bool:
    raw = values.get(name, default)
    if isinstance(raw, bool):
        return raw
    if str(raw).lower() in ("true", "false"):
        return str(raw).lower() == "true"
    raise ConfigError(f"{key(name, section)} is '{raw}': use true or false")


def label(values: Mapping[str, Any], name: str, default: str, section: str = "") -> str:
    value = str(values.get(name, default))
    if not DNS_LABEL.match(value) or len(value) > 40:
        raise ConfigError(f"{key(name, section)} is '{value}': use up to 40 lower-case letters, digits and dashes "
                          "(a Kubernetes name; pods are named after it)")
    return value


def mapping(values: Mapping[str, Any], name: str, section: str = "") -> dict[str, str]:
    raw = values.get(name) or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key(name, section)} must be a map of node labels to values, not '{raw}'")
    return {str(k): str(v) for k, v in raw.items()}


def refuse_unknown_keys(given: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    """A misspelled key would be ignored without a word and its default used: refuse it, naming a close match."""
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hints.append(f"'{name}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    raise ConfigError(f"{where} has unknown keys: {', '.join(hints)}; the keys are: {', '.join(known)}")
