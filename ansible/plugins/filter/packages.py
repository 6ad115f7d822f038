"""Jinja filter: which of a list of apt package names dpkg does not show as installed.

Roles probe with `dpkg-query --show --showformat='${Package} ${db:Status-Abbrev}\\n' NAMES...` (a command
with changed_when: false, run just before the apt task) and run the apt task only when this filter returns
something: the apt module loads the whole package cache even when nothing is missing, one or two seconds
per host on a small controller. A probe is read in the same role, just before the install, never from the
fact cache, so a package removed since an earlier run is installed again.
"""

import re

# A plain Debian package name. Anything else (name=version, wildcards, :arch, a .deb path) is left to apt,
# which alone knows how to match it.
PLAIN_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")


def installed_packages(dpkg_query_stdout):
    """Names that the probe's lines ("NAME WANTED STATUS ERROR") show as installed, without an error flag."""
    installed = set()
    for line in str(dpkg_query_stdout or "").splitlines():
        name, _, abbrev = line.partition(" ")
        # ${db:Status-Abbrev}: wanted (u i r p h), status (n i c U F h W t), error flag (space: none).
        if len(abbrev) >= 2 and abbrev[1] == "i" and abbrev[2:3] in ("", " "):
            installed.add(name)
    return installed


def packages_not_installed(names, dpkg_query_stdout):
    """The names (in order) that apt must still look at: not plain names, or not installed per the probe."""
    installed = installed_packages(dpkg_query_stdout)
    return [name for name in names if not PLAIN_NAME.match(str(name)) or str(name) not in installed]


class FilterModule:
    def filters(self):
        return {"packages_not_installed": packages_not_installed}
