"""Action plugin: make sure apt packages are installed, in one task that asks apt only when one is missing.

The apt module loads the whole package cache (one or two seconds a host on a small control machine) even
when it finds nothing to do, so this action first asks dpkg (one short command, no module) and hands apt
only the names dpkg does not show as installed: a plain name that is not installed, a pin (NAME=VERSION)
whose package is not installed at exactly that version, and any name only apt can match. The probe runs
every time, never from a fact cache, so a package removed since an earlier run is installed again. Its
arguments are documented in ansible/plugins/modules/apt_packages.py; allow_change_held_packages and
policy_rc_d go to the apt module unchanged.
"""
from __future__ import annotations

import runpy
import shlex
from pathlib import Path

from ansible.plugins.action import ActionBase

# Action plugins cannot import module_utils: the repository's Python comes through module_utils/source_tree.py.
_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
apt_rules = _load("ansible/plugins/module_utils/apt_rules.py")

ARGUMENT_SPEC = {
    "name": {"type": "list", "elements": "str", "required": True},
    "update_cache": {"type": "bool", "default": True},
    "cache_valid_time": {"type": "int", "default": 3600},
    "install_recommends": {"type": "bool", "default": False},
    "allow_change_held_packages": {"type": "bool", "default": False},
    "policy_rc_d": {"type": "int"},
}


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = True
    _supports_check_mode = True
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp
        _, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        names = [str(name).strip() for name in args["name"] if str(name).strip()]
        result.update(changed=False, installed=[], missing=[])
        if not names:
            result["msg"] = "no package names given"
            return result

        probed = apt_rules.probe_names(names)
        stdout = ""
        if probed:
            probe = self._low_level_execute_command(shlex.join(apt_rules.DPKG_QUERY + probed), sudoable=False)
            # 1: some name is unknown to dpkg (so not installed); anything else is a failure to read dpkg.
            if probe["rc"] not in (0, 1):
                result.update(failed=True, rc=probe["rc"], stderr=probe.get("stderr", ""),
                              msg=f"dpkg-query could not read the package database (exit {probe['rc']}): "
                                  f"{str(probe.get('stderr', '')).strip()}")
                return result
            stdout = probe.get("stdout", "")
        missing = apt_rules.packages_not_installed(names, stdout)
        result["missing"] = missing
        if not missing:
            result["msg"] = "all installed"
            return result

        if self._task.check_mode:
            # apt is not asked: a source added earlier in the same check run has no package lists yet, and a
            # fresh node lacks python3-apt, which the apt module needs for check mode.
            result.update(changed=True, installed=missing,
                          msg="check mode: would install " + ", ".join(missing))
            return result

        apt_args = {"name": missing, "state": "present", "install_recommends": args["install_recommends"],
                    "allow_change_held_packages": args["allow_change_held_packages"]}
        if args["policy_rc_d"] is not None:
            apt_args["policy_rc_d"] = args["policy_rc_d"]
        if args["update_cache"]:
            apt_args.update(update_cache=True, cache_valid_time=args["cache_valid_time"])
        apt = self._execute_module(module_name="ansible.legacy.apt", module_args=apt_args, task_vars=task_vars)
        for key in ("failed", "msg", "stdout", "stderr", "rc", "cache_updated", "cache_update_time"):
            if key in apt:
                result[key] = apt[key]
        result["changed"] = bool(apt.get("changed"))
        result["installed"] = missing if result["changed"] and not apt.get("failed") else []
        if apt.get("failed"):
            result["msg"] = f"apt could not install {', '.join(missing)}: {apt.get('msg', '')}"
        elif "msg" not in result or not result["msg"]:
            result["msg"] = "installed " + ", ".join(missing)
        return result
