"""Dashboards are valid Grafana JSON on the provisioned datasource, and every metric a dashboard or an alert
rule names is one that our collectors or node_exporter (recorded from the molecule nodes) really emit."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import subprocess

import jinja2
import pytest
import yaml
from monitoring_support import FIXTURES, REPO
from promtext import parse

ROLE = REPO / "roles" / "monitoring"
DASHBOARDS = sorted((ROLE / "files" / "dashboards").glob("*.json"))
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
            "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, label matchers, groupings and durations left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\boffset\s+\w+", "", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", text):
        name, call = match.groups()
        if not call and name.lower() not in KEYWORDS:
            names.add(name)
    return names


@pytest.fixture(scope="module")
def emitted(gpu, training, slurm, gluster, textfile, tmp_path_factory):
    """Every metric name our collectors write (fed with the fixtures) and node_exporter serves."""
    runs = tmp_path_factory.mktemp("runs")
    (runs / "r" / "checkpoints").mkdir(parents=True)
    (runs / "r" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0, "lr": 0.1, "images_per_s": 2.0, "mfu": 0.1, '
                                              '"time": 5.0, "total_steps": 9}\n')
    (runs / "r" / "checkpoints" / "latest").write_text("step-00000001\n")
    families = [
        *gpu.collect((FIXTURES / "nvidia_smi_h200x8.csv").read_text(), "",
                     (FIXTURES / "kernel_log_xid.txt").read_text().splitlines(), 0.0),
        *training.collect(runs, ["*/metrics.jsonl"], 0.0, ["checkpoints/latest"]),
        *slurm.collect((FIXTURES / "squeue_states.txt").read_text(), (FIXTURES / "sinfo_nodes.txt").read_text(), 0.0),
        *gluster.collect((FIXTURES / "gluster_volume_status.xml").read_text(),
                         {"shared": (FIXTURES / "gluster_heal_summary.xml").read_text()}, 0.0),
    ]
    names = set(parse(textfile.render(families)))
    # The backup role writes its own textfile metrics (its script needs restic to run; the names are its code's).
    backup_script = (REPO / "roles" / "backup" / "files" / "sd3_backup.py").read_text()
    names |= set(re.findall(r'metrics\.add\("(sd3_backup\w+)"', backup_script))
    # The node_health role's check writes its metrics with the same textfile writer.
    health = runpy.run_path(str(REPO / "ansible" / "plugins" / "module_utils" / "source_tree.py"))["load"](
        "roles/node_health/files/sd3_node_health.py")
    results = [health.Result("free_disk", health.FAIL, ""), health.Result("nvlink", health.SKIP, "")]
    names |= set(parse(health.metrics(results, {"health_check": 1, "admin": 0}, 0.0)))
    names |= {line.split()[0] for line in (FIXTURES / "node_exporter_metric_names.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    return names | serve_metric_names() | {"up"}


def serve_metric_names() -> set[str]:
    """The series `sd3cluster serve` exposes (its Metrics class, read from the source: the GPU gauges exist only
    on CUDA), with the suffixes prometheus_client adds to counters and histograms."""
    source = (REPO / "workloads" / "src" / "sd3cluster" / "serve.py").read_text()
    suffixes = {"Counter": ["_total"], "Gauge": [""], "Histogram": ["_bucket", "_sum", "_count"]}
    names = {name + suffix for kind, name in re.findall(r'\b(Counter|Gauge|Histogram)\("(sd3_serve_\w+)"', source)
             for suffix in suffixes[kind]}
    assert {"sd3_serve_requests_total", "sd3_serve_ready", "sd3_serve_stage_seconds_bucket"} <= names, names
    return names


def test_metric_names_of_an_expression():
    expr = ('100 * node_filesystem_avail_bytes{fstype!~"tmpfs|x"} / sum by (instance) (rate(node_cpu_seconds_total'
            '{mode="idle"}[5m])) and on (instance, run) sd3_x == 1 or abs(sd3_y offset 1h) > 1e30')
    assert metric_names(expr) == {"node_filesystem_avail_bytes", "node_cpu_seconds_total", "sd3_x", "sd3_y"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_valid_and_names_only_emitted_metrics(path, emitted):
    board = json.loads(path.read_text())
    assert board["uid"].startswith("sd3-") and board["title"] and board["panels"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "sd3-prometheus", f"{path.name}: {panel['title']}"
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        assert panel["targets"], f"{path.name}: panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            unknown = metric_names(target["expr"]) - emitted
            assert not unknown, f"{path.name}: panel {panel['title']!r} queries {sorted(unknown)}, which nothing emits"


def test_every_dashboard_is_installed_by_the_role():
    listed = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())["__monitoring_dashboards"]
    assert sorted(listed) == [p.name for p in DASHBOARDS]


def _rules() -> dict:
    """The rules template with every [[ variable ]] replaced by a value of its kind (a duration for *_for)."""
    text = (ROLE / "templates" / "alert_rules.yml.j2").read_text()
    text = re.sub(r"\[\[ *([^\]]*?) *\]\]", lambda m: "2m" if m.group(1).endswith("_for") else "1", text)
    return yaml.safe_load(text)


def test_alert_rules_name_only_emitted_metrics(emitted):
    rules = [r for g in _rules()["groups"] for r in g["rules"]]
    wanted = {"NodeDown", "GpuXidError", "GpuUncorrectableEccErrors", "GpuHot", "GlusterBrickDown",
              "GlusterHealBacklog", "TrainingStalled", "DiskNearlyFull", "BackupFailed", "BackupRestoreCheckFailed",
              "BackupTooOld", "NodeDrainedByHealthCheck", "NodeHealthCheckFailing", "InferenceNoReadyWorker",
              "InferenceWorkerNotReady", "InferenceLatencyHigh", "InferenceQueueGrowing", "InferenceErrorRate"}
    assert wanted <= {r["alert"] for r in rules}
    for rule in rules:
        unknown = metric_names(rule["expr"]) - emitted
        assert not unknown, f"alert {rule['alert']} uses {sorted(unknown)}, which nothing emits"
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


NO_PROMTOOL = "promtool is not on PATH: `make tools` unpacks it from the distribution's prometheus package"


@pytest.mark.skipif(shutil.which("promtool") is None, reason=NO_PROMTOOL)
def test_promtool_accepts_the_rules(tmp_path):
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(_rules()))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason=NO_PROMTOOL)
def test_inference_alerts_fire_as_designed_with_the_default_thresholds(tmp_path):
    """promtool's unit tests of the inference alerts on the rules rendered with the role's real defaults."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    env = jinja2.Environment(variable_start_string="[[", variable_end_string="]]", undefined=jinja2.StrictUndefined)
    rules = env.from_string((ROLE / "templates" / "alert_rules.yml.j2").read_text()).render(ansible_managed="test",
                                                                                           **defaults)
    (tmp_path / "rules.yml").write_text(rules)
    tests = tmp_path / "inference_alerts_test.yml"
    tests.write_text((FIXTURES / "inference_alerts_test.yml").read_text())
    done = subprocess.run(["promtool", "test", "rules", str(tests)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
