"""The monitoring role's settings checks (roles/monitoring/tasks/validate.yml): one sentence per setting that
cannot work, naming the variable and what to write instead; [] means the settings may go on. Unit-tested in
tests/monitoring/test_monitoring_filter.py."""
from __future__ import annotations

import re
import runpy
from pathlib import Path

# Filters cannot import module_utils or each other: the repository's Python comes through module_utils/source_tree.py.
_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
text = _load("ansible/plugins/module_utils/values.py").text

# What Prometheus accepts as a duration (30d, 15s, 1h30m) and as a retention size ("" for none).
PROMETHEUS_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
PROMETHEUS_SIZE = re.compile(r"^([0-9]+(B|KB|MB|GB|TB|PB|EB))?$")
# The collectors' systemd timer interval.
SYSTEMD_SPAN = re.compile(r"^[0-9]+(s|min|h)$")
# bcrypt, as Prometheus's web configuration takes it.
BCRYPT = re.compile(r"^\$2[aby]\$")

DURATIONS = ("prometheus_retention_time", "prometheus_scrape_interval", "prometheus_evaluation_interval",
             "alert_node_down_for", "alert_inference_no_ready_for")
PATHS = ("prometheus_storage_path", "training_runs_dir", "prometheus_targets_dir")


def monitoring_problems(host, settings, groups):
    """settings: the role's variables without their monitoring_ prefix (server_group, the DURATIONS and PATHS,
    prometheus_retention_size, collector_interval, web_auth_enabled and the web_basic_auth_* and web_tls_* files)."""
    problems = []
    server_group = text(settings.get("server_group"))
    servers = list(groups.get(server_group) or [])
    if len(servers) != 1:
        problems.append(f"monitoring_server_group '{server_group}' holds {len(servers)} host(s): Prometheus runs on "
                        "exactly one; put one host in that group or name another group")
    for name in DURATIONS:
        if not PROMETHEUS_DURATION.match(text(settings.get(name))):
            problems.append(f"monitoring_{name} is '{text(settings.get(name))}': write a Prometheus duration such as "
                            "30d, 15s or 1h30m")
    if not PROMETHEUS_SIZE.match(text(settings.get("prometheus_retention_size"))):
        problems.append(f"monitoring_prometheus_retention_size is '{text(settings.get('prometheus_retention_size'))}': "
                        'write a size such as 50GB, or "" for no limit')
    if not SYSTEMD_SPAN.match(text(settings.get("collector_interval"))):
        problems.append(f"monitoring_collector_interval is '{text(settings.get('collector_interval'))}': write a "
                        "systemd time span such as 30s, 2min or 1h")
    for name in PATHS:
        if not text(settings.get(name)).startswith("/"):
            problems.append(f"monitoring_{name} is '{text(settings.get(name))}': give an absolute path")
    return [f"{host}: {problem}. Nothing was changed." for problem in problems]


def monitoring_web_auth_problems(host, settings):
    """With monitoring_web_auth_enabled: the user, password and bcrypt hash it needs, and both TLS files or none."""
    problems = []
    for name in ("user", "password"):
        if not text(settings.get(f"web_basic_auth_{name}")):
            problems.append(f"monitoring_web_basic_auth_{name} is empty: set it (the password in Vault)")
    if not BCRYPT.match(text(settings.get("web_basic_auth_password_hash"))):
        problems.append("monitoring_web_basic_auth_password_hash is not a bcrypt hash (it starts with $2y$ or $2b$): "
                        "make it from the password, e.g. with htpasswd -nbB")
    if (text(settings.get("web_tls_cert_file")) == "") != (text(settings.get("web_tls_key_file")) == ""):
        problems.append("only one of monitoring_web_tls_cert_file and monitoring_web_tls_key_file is set: give both "
                        "(TLS) or neither")
    return [f"{host}: monitoring_web_auth_enabled is on, but {problem}. Nothing was changed." for problem in problems]


class FilterModule:
    def filters(self):
        return {"monitoring_problems": monitoring_problems,
                "monitoring_web_auth_problems": monitoring_web_auth_problems}
