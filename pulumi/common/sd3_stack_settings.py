"""Stack settings of both Pulumi programs (pulumi/aws, pulumi/k8s): one way to read a project's namespace, to
turn each setting into a typed value, and to refuse a key the program does not know.

Every problem stops `pulumi up` with a ConfigError whose message names the key (`sd3-cluster-aws:gpuNodeCount`,
or `sd3-cluster-k8s:serving.minReplicas` for a key inside a map) and says what to set instead. The programs'
packages put this folder on sys.path (their `__init__.py`), so neither needs it installed.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class ConfigError(ValueError):
    """A stack setting is wrong; the message names the key and the fix."""


def refuse_unknown_keys(given: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    """A misspelled key would be ignored without a word and its default used: refuse it, naming the closest known
    key, and list every known key, closest first (the right one is then at the front even when no hint fits)."""
    unknown = sorted(str(name) for name in set(given) - set(known))
    if not unknown:
        return

    def closeness(candidate: str) -> float:
        return max(difflib.SequenceMatcher(None, name.lower(), candidate.lower()).ratio() for name in unknown)

    # Compared without case: `EFA` for `efa` is the same slip as a missing letter.
    by_lower = {candidate.lower(): candidate for candidate in known}
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
        hints.append(f"'{name}'" + (f" (did you mean '{by_lower[close[0]]}'?)" if close else ""))
    ordered = sorted(known, key=closeness, reverse=True)
    raise ConfigError(f"{where} has unknown keys: {', '.join(hints)}; the known keys, closest first: "
                      f"{', '.join(ordered)}")


@dataclass(frozen=True)
class Namespace:
    """The settings of one Pulumi project (`sd3-cluster-aws`, `sd3-cluster-k8s`)."""

    project: str

    def key(self, name: str, section: str = "") -> str:
        return f"{self.project}:{section}{name}"

    @staticmethod
    def set_hint(name: str, section: str, example: str) -> str:
        if section:
            return f"`pulumi config set --path {section}{name} {example}`"
        return f"`pulumi config set {name} {example}`"

    # -- reading the stack ---------------------------------------------------------------------------------
    def read(self, structured: Mapping[str, str]) -> dict[str, Any]:
        """Every key set in this project's namespace (so a misspelled one can be refused, not ignored), with
        the structured ones (lists, maps: `structured` gives an example of each) parsed from their JSON form.

        Pulumi's own `get_object` raises a bare ConfigTypeError for a list or map set as plain text
        (`pulumi config set adminCidrs 203.0.113.7/32`): the most likely slip, so it is explained here."""
        import pulumi

        configured = {**pulumi.runtime.config.get_config_env(), **pulumi.runtime.config.CONFIG.get()}
        values: dict[str, Any] = {}
        for full_key, raw in configured.items():
            project, _, name = full_key.partition(":")
            if project != self.project or not name:
                continue
            value = raw
            if name in structured and isinstance(raw, str):
                try:
                    value = json.loads(raw)
                except ValueError:
                    raise ConfigError(f"{self.key(name)} is '{raw}', plain text, but it is a "
                                      f"{structured[name]}") from None
            values[name] = value
        return values

    # -- typed values ----------------------------------------------------------------------------------------
    def integer(self, values: Mapping[str, Any], name: str, default: int | None, section: str = "",
                minimum: int | None = None, maximum: int | None = None, unit: str = "") -> int | None:
        raw = values.get(name, default)
        if raw is None:
            return None
        problem = (f"{self.key(name, section)} is '{raw}', not a whole number: set it with "
                   f"{self.set_hint(name, section, 'N')}")
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ConfigError(problem)
        try:
            value = int(raw)
        except (TypeError, ValueError):
            raise ConfigError(problem) from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            if maximum is None:
                allowed = f"{minimum}{unit} or more"
            elif minimum is None:
                allowed = f"at most {maximum}{unit}"
            else:
                allowed = f"{minimum} to {maximum}{unit}"
            raise ConfigError(f"{self.key(name, section)} is {value}: use {allowed}")
        return value

    def boolean(self, values: Mapping[str, Any], name: str, default: bool, section: str = "") -> bool:
        raw = values.get(name, default)
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("true", "false"):
            return str(raw).lower() == "true"
        raise ConfigError(f"{self.key(name, section)} is '{raw}': use true or false")

    def string(self, values: Mapping[str, Any], name: str, default: str | None, section: str = "",
               pattern: re.Pattern[str] | None = None, form: str = "") -> str | None:
        """A text setting; with `pattern`, refused unless it matches, with `form` (an example) in the message."""
        raw = values.get(name, default)
        if raw is None:
            return None
        if isinstance(raw, (Mapping, list, bool)):
            raise ConfigError(f"{self.key(name, section)} is {json.dumps(raw)}: give a single text value"
                              + (f", {form}" if form else ""))
        value = str(raw)
        if pattern is not None and not pattern.match(value):
            raise ConfigError(f"{self.key(name, section)} is '{value}': {form}")
        return value

    def label(self, values: Mapping[str, Any], name: str, default: str, section: str = "") -> str:
        value = str(values.get(name, default))
        if not DNS_LABEL.match(value) or len(value) > 40:
            raise ConfigError(f"{self.key(name, section)} is '{value}': use up to 40 lower-case letters, digits and "
                              "dashes (a Kubernetes name; pods are named after it)")
        return value

    def mapping(self, values: Mapping[str, Any], name: str, section: str = "", what: str = "node labels",
                example: str = "{team: vision}") -> dict[str, str]:
        """A map of text to text (labels, tags); nested maps or lists as values are refused."""
        raw = values.get(name) or {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{self.key(name, section)} must be a map of {what} to values, not '{raw}', e.g. "
                              f"{example}")
        for item_key, item in raw.items():
            if isinstance(item, (Mapping, list)):
                raise ConfigError(f"{self.key(name, section)}.{item_key} is {json.dumps(item)}: each value of "
                                  f"the map is one text value, e.g. {example}")
        return {str(k): str(v) for k, v in raw.items()}

    def string_list(self, values: Mapping[str, Any], name: str, example: str, section: str = "") -> list[str]:
        """A list of text values; a lone text value or a map is refused with an example of the list form."""
        raw = values.get(name)
        if raw is None:
            return []
        if not isinstance(raw, list) or not all(isinstance(item, (str, int, float)) for item in raw):
            raise ConfigError(f"{self.key(name, section)} is {json.dumps(raw)}, not a list of text values: "
                              f"{example}")
        return [str(item) for item in raw]
