"""Jinja filter packages_not_installed: the apt_packages action's rule (ansible/plugins/module_utils/apt_rules.py,
loaded by path so both read one copy), for task files not yet moved to that action."""

import importlib.util
import sys
from pathlib import Path

_MODULE = Path(__file__).resolve().parents[1] / "module_utils" / "apt_rules.py"
_spec = importlib.util.spec_from_file_location("sd3cluster_apt_rules", _MODULE)
if _spec.name not in sys.modules:
    sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_spec.name])


class FilterModule:
    def filters(self):
        return {"packages_not_installed": sys.modules[_spec.name].packages_not_installed}
