"""The monitoring role's listen address and its optional basic auth/TLS: Prometheus's configuration and the web config
file rendered with the switch on, checked by promtool; with it off, nothing of it appears."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "roles" / "monitoring"
sys.path.insert(0, str(REPO / "ansible" / "plugins" / "filter"))
from cluster_network import cluster_address  # noqa: E402

NO_PROMTOOL = "promtool is not on PATH: `make tools` unpacks it from the distribution's prometheus package"
# A bcrypt hash of "secret" (made with crypt.crypt and a 2b salt of 10 rounds).
HASH = "$2b$10$8RqvmSv9FLZNcDcYr.GE1eoD7h2iOa4E5nv2J41cm/BTvZgUU5o2G"


def render(name, **overrides):
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters.update(to_json=json.dumps, bool=lambda v: str(v).lower() in ("true", "1", "yes"),
                       cluster_address=cluster_address,
                       to_nice_yaml=lambda v, indent=2: yaml.safe_dump(v, indent=indent, default_flow_style=False))
    hostvars = {"head": {"cluster_address": "10.0.0.1", "group_names": ["head"]},
                "gpu1": {"cluster_address": "10.0.0.2", "group_names": ["gpu_nodes"]}}
    auth = overrides.pop("auth", False)
    tls = overrides.pop("tls", False)
    variables = {
        "ansible_managed": "test", "cluster_name": "t", "inventory_hostname": "head", "hostvars": hostvars,
        "groups": {"head": ["head"], "gpu_nodes": ["gpu1"]}, "monitoring_node_hosts": ["head", "gpu1"],
        "monitoring_server_group": "head", "monitoring_gpu_group": "gpu_nodes", "monitoring_storage_group": "storage",
        "monitoring_prometheus_scrape_interval": "15s", "monitoring_prometheus_evaluation_interval": "15s",
        "monitoring_alertmanager_targets": [], "monitoring_prometheus_port": 9090,
        "monitoring_node_exporter_port": 9100,
        "monitoring_gpu_exporter": "collector", "monitoring_dcgm_exporter_port": 9400,
        "monitoring_prometheus_targets_dir": "/etc/prometheus/targets",
        "monitoring_prometheus_extra_scrape_configs": [],
        "monitoring_web_auth_enabled": auth, "monitoring_web_basic_auth_user": "prometheus",
        "monitoring_web_basic_auth_password": "secret", "monitoring_web_basic_auth_password_hash": HASH,
        "monitoring_web_tls_cert_file": "/etc/ssl/node.pem" if tls else "",
        "monitoring_web_tls_key_file": "/etc/ssl/node.key" if tls else "",
        "monitoring_web_tls_ca_file": "/etc/ssl/ca.pem" if tls else "",
        "__monitoring_tls": auth and tls, "__monitoring_probe_host": "10.0.0.1",
        "__monitoring_scheme": "https" if auth and tls else "http",
    }
    variables.update(overrides)
    return env.from_string((ROLE / "templates" / name).read_text()).render(**variables)


def test_without_the_switch_prometheus_scrapes_plain_http_on_the_cluster_addresses():
    config = yaml.safe_load(render("prometheus.yml.j2"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["prometheus"]["static_configs"][0]["targets"] == ["10.0.0.1:9090"]
    assert [c["targets"][0] for c in jobs["node"]["static_configs"]] == ["10.0.0.1:9100", "10.0.0.2:9100"]
    assert "basic_auth" not in jobs["node"] and "scheme" not in jobs["node"]


def test_with_the_switch_prometheus_scrapes_with_the_login_over_tls():
    config = yaml.safe_load(render("prometheus.yml.j2", auth=True, tls=True))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for name in ("prometheus", "node"):
        assert jobs[name]["basic_auth"] == {"username": "prometheus", "password": "secret"}
        assert jobs[name]["scheme"] == "https" and jobs[name]["tls_config"] == {"ca_file": "/etc/ssl/ca.pem"}
    web = yaml.safe_load(render("web-config.yml.j2", auth=True, tls=True))
    assert web == {"tls_server_config": {"cert_file": "/etc/ssl/node.pem", "key_file": "/etc/ssl/node.key"},
                   "basic_auth_users": {"prometheus": HASH}}


@pytest.mark.skipif(shutil.which("promtool") is None, reason=NO_PROMTOOL)
@pytest.mark.parametrize("tls", [False, True])
def test_promtool_accepts_the_configuration_and_the_web_config(tmp_path, tls):
    config = tmp_path / "prometheus.yml"
    config.write_text(render("prometheus.yml.j2", auth=True, tls=tls))
    done = subprocess.run(["promtool", "check", "config", "--syntax-only", str(config)], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    if tls:
        return  # promtool opens the certificate files of a TLS web config; only the login form is checked here
    web = tmp_path / "web.yml"
    web.write_text(render("web-config.yml.j2", auth=True))
    done = subprocess.run(["promtool", "check", "web-config", str(web)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
