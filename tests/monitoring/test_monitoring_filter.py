"""The monitoring role's settings checks (ansible/plugins/filter/monitoring.py): good settings pass, each bad one
is named alone with what to write instead."""
from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
load = runpy.run_path(str(REPO / "ansible" / "plugins" / "module_utils" / "source_tree.py"))["load"]
monitoring = load("ansible/plugins/filter/monitoring.py")

DEFAULTS = yaml.safe_load((REPO / "roles" / "monitoring" / "defaults" / "main.yml").read_text())
GROUPS = {"head": ["node1"], "gpu_nodes": ["node2", "node3"]}
# The role's own defaults, as the task passes them (those that are templates get a resolved value here).
GOOD = {"server_group": "head", "prometheus_retention_time": DEFAULTS["monitoring_prometheus_retention_time"],
        "prometheus_retention_size": DEFAULTS["monitoring_prometheus_retention_size"],
        "prometheus_scrape_interval": DEFAULTS["monitoring_prometheus_scrape_interval"],
        "prometheus_evaluation_interval": DEFAULTS["monitoring_prometheus_evaluation_interval"],
        "alert_node_down_for": DEFAULTS["monitoring_alert_node_down_for"],
        "alert_inference_no_ready_for": DEFAULTS["monitoring_alert_inference_no_ready_for"],
        "collector_interval": DEFAULTS["monitoring_collector_interval"],
        "prometheus_storage_path": "/var/lib/prometheus", "training_runs_dir": "/shared/runs",
        "prometheus_targets_dir": "/etc/prometheus/targets"}
AUTH = {"web_basic_auth_user": "admin", "web_basic_auth_password": "secret",
        "web_basic_auth_password_hash": "$2y$10$abcdefghijklmnopqrstuv", "web_tls_cert_file": "",
        "web_tls_key_file": ""}


def test_the_role_defaults_pass():
    assert monitoring.monitoring_problems("node1", GOOD, GROUPS) == []
    other = {**GOOD, "prometheus_retention_size": "", "collector_interval": "2min",
             "prometheus_retention_time": "1h30m"}
    assert monitoring.monitoring_problems("node1", other, GROUPS) == []


@pytest.mark.parametrize("changed, expected", [
    ({"server_group": "gpu_nodes"}, "node1: monitoring_server_group 'gpu_nodes' holds 2 host(s): Prometheus runs on "
     "exactly one; put one host in that group or name another group. Nothing was changed."),
    ({"server_group": "nowhere"}, "monitoring_server_group 'nowhere' holds 0 host(s)"),
    ({"prometheus_retention_time": "30 days"}, "node1: monitoring_prometheus_retention_time is '30 days': write a "
     "Prometheus duration such as 30d, 15s or 1h30m. Nothing was changed."),
    ({"alert_node_down_for": "5"}, "monitoring_alert_node_down_for is '5': write a Prometheus duration"),
    ({"prometheus_scrape_interval": None}, "monitoring_prometheus_scrape_interval is '': write a Prometheus duration"),
    ({"prometheus_retention_size": "50G"}, "monitoring_prometheus_retention_size is '50G': write a size such as 50GB, "
     'or "" for no limit'),
    ({"collector_interval": "30m"}, "monitoring_collector_interval is '30m': write a systemd time span such as 30s, "
     "2min or 1h"),
    ({"training_runs_dir": "shared/runs"}, "monitoring_training_runs_dir is 'shared/runs': give an absolute path"),
])
def test_each_bad_setting_is_named_alone(changed, expected):
    problems = monitoring.monitoring_problems("node1", {**GOOD, **changed}, GROUPS)
    assert len(problems) == 1 and expected in problems[0], problems


def test_web_auth_with_what_it_needs_passes_with_or_without_tls():
    assert monitoring.monitoring_web_auth_problems("node1", AUTH) == []
    tls = {**AUTH, "web_tls_cert_file": "/etc/prometheus/tls.crt", "web_tls_key_file": "/etc/prometheus/tls.key"}
    assert monitoring.monitoring_web_auth_problems("node1", tls) == []


@pytest.mark.parametrize("changed, expected", [
    ({"web_basic_auth_user": ""}, "node1: monitoring_web_auth_enabled is on, but monitoring_web_basic_auth_user is "
     "empty: set it (the password in Vault). Nothing was changed."),
    ({"web_basic_auth_password": ""}, "monitoring_web_basic_auth_password is empty"),
    ({"web_basic_auth_password_hash": "secret"}, "monitoring_web_basic_auth_password_hash is not a bcrypt hash"),
    ({"web_tls_cert_file": "/etc/prometheus/tls.crt"}, "only one of monitoring_web_tls_cert_file and "
     "monitoring_web_tls_key_file is set: give both (TLS) or neither"),
])
def test_each_missing_auth_setting_is_named_alone(changed, expected):
    problems = monitoring.monitoring_web_auth_problems("node1", {**AUTH, **changed})
    assert len(problems) == 1 and expected in problems[0], problems
