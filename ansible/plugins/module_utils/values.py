"""How the filters that check inputs in Python read a variable's value the way the playbooks read it.

A value reaches a filter as the inventory, group_vars or `-e` gave it: `-e` makes every value a string, YAML
may make it a bool or a number. The rules must read it as the role's tasks would (Jinja's `int`, Ansible's
`bool`), or a check in Python would pass what a task then reads differently. One copy of each reading for
every filter (they load this file through source_tree.load).

module_utils/topology.py keeps its own two readers: a module (gluster_volume) imports it on the node, where
this file is not shipped.
"""

from __future__ import annotations

import re

_ANSIBLE_TRUE = ("yes", "on", "1", "true", "y", "t")


def text(value):
    """The value as text, '' for none."""
    return "" if value is None else str(value)


def jinja_int(value):
    """Jinja's `int` filter: the number (a float's whole part), or 0 for anything that is not one."""
    try:
        return int(value)
    except (TypeError, ValueError):
        try:
            return int(float(value))
        except (TypeError, ValueError):
            return 0


def number(value):
    """The value as a float, NaN for none or anything that is not a number (so every comparison with it fails)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def ansible_bool(value):
    """Ansible's `bool` filter: True, 1 and the words yes, on, 1, true, y, t (any case) are true; all else false."""
    if isinstance(value, bool):
        return value
    return text(value).strip().lower() in _ANSIBLE_TRUE


def whole_number(value):
    """The value as an int when it is one (an int, or a string of digits as `-e` gives it, '-' allowed), else None.
    A bool is not a number here, so `true` in a count is reported rather than read as 1; the caller's range
    check words the message for a number out of range."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        return int(value)
    return None
