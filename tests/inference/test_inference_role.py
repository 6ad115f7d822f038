"""The inference role without a cluster: its filters (workers, serve settings, the balancer's numbers, Prometheus's
targets, the settings' problems), the balancer's health checker against loopback HTTP answers, the rendered unit
and nginx configuration, and that every knob is documented and specified."""

from __future__ import annotations

import http.server
import importlib.util
import json
import re
import socket
import sys
import threading
from pathlib import Path

import jinja2
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "roles" / "inference"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


inf = load("inference_filter", REPO / "ansible" / "plugins" / "filter" / "inference.py")
net = load("cluster_network_filter", REPO / "ansible" / "plugins" / "filter" / "cluster_network.py")
health = load("sd3_inference_health", ROLE / "files" / "sd3_inference_health.py")


# -- filters ----------------------------------------------------------------------------------------------------
def test_a_gpu_node_runs_one_worker_per_gpu_on_consecutive_ports():
    workers = inf.inference_workers("gpu01", "10.10.0.11", "8", 8100)
    assert [w["port"] for w in workers] == list(range(8100, 8108))
    assert [w["index"] for w in workers] == list(range(8))
    assert {w["device"] for w in workers} == {"cuda"}
    assert workers[3]["name"] == "gpu01-cuda3" and workers[3]["url"] == "http://10.10.0.11:8103"


def test_a_cpu_node_runs_one_cpu_worker():
    (worker,) = inf.inference_workers("node2", "10.213.0.102", 0, 8100)
    assert (worker["device"], worker["port"], worker["index"], worker["name"]) == ("cpu", 8100, 0, "node2-cpu0")


def test_a_negative_gpu_count_is_refused():
    with pytest.raises(inf.InferenceError, match="GPU count"):
        inf.inference_workers("n", "1.2.3.4", -1, 8100)


def test_the_cluster_address_rule():
    hostvars = {"a": {"cluster_address": "10.0.0.1", "ansible_host": "192.168.0.1"}, "b": {"ansible_host": "10.0.0.2"},
                "c": {"cluster_address": ""}}
    assert [net.cluster_address(h, hostvars) for h in "abc"] == ["10.0.0.1", "10.0.0.2", "c"]


def test_serve_settings_put_the_workers_own_address_over_the_roles():
    (worker,) = inf.inference_workers("node2", "10.213.0.102", 0, 8100)
    doc = inf.inference_serve_config(worker, {"pretrained": "", "request_timeout_s": 60, "dtype": "auto"},
                                     {"max_batch": 2}, "tiny")
    assert doc["serve"] == {"host": "10.213.0.102", "port": 8100, "name": "node2-cpu0", "device": "cpu",
                            "job_prefix": "node2-cpu0", "request_timeout_s": 60, "dtype": "auto",
                            "max_batch": 2}  # empty pretrained left out
    assert doc["model"] == {"preset": "tiny"}
    assert "model" not in inf.inference_serve_config(worker, {}, {}, "")


def test_serve_settings_may_not_repeat_a_knob_of_the_role():
    (worker,) = inf.inference_workers("n", "1.2.3.4", 0, 8100)
    with pytest.raises(inf.InferenceError, match=r"request_timeout_s \(set it with inference_request_timeout_s\)"):
        inf.inference_serve_config(worker, {}, {"request_timeout_s": 5})


def test_systemd_waits_longer_than_the_drain():
    assert inf.inference_stop_timeout_s(600, 5) == 635 > 600 + 5


def test_the_balancer_waits_longer_than_the_service_and_takes_its_body_limit():
    b = inf.inference_balancer_settings(300, 65536, 3)
    assert b["read_timeout_s"] > 300 and b["next_upstream_timeout_s"] >= b["read_timeout_s"]
    assert (b["client_max_body_bytes"], b["next_upstream_tries"]) == (65536, 3)


def test_prometheus_targets_keep_two_workers_of_a_node_apart():
    targets = inf.inference_targets(inf.inference_workers("gpu01", "10.10.0.11", 2, 8100), "sd3-inference")
    assert [t["targets"] for t in targets] == [["10.10.0.11:8100"], ["10.10.0.11:8101"]]
    assert [t["labels"]["instance"] for t in targets] == ["gpu01:8100", "gpu01:8101"]
    assert {t["labels"]["job"] for t in targets} == {"sd3-inference"}


GOOD = {"host": "gpu01", "worker": True, "balancer": False, "gpus": 8, "base_port": 8100, "balancer_port": 8080,
        "reserved_ports": {"9100": "node_exporter (monitoring_node_exporter_port)"}, "model_dir": "/shared/models/sd3",
        "preset": "", "request_timeout_s": 300, "drain_timeout_s": 600, "drain_grace_s": 5, "max_body_bytes": 65536,
        "tries": 3, "serve_settings": {"max_batch": 8}}


@pytest.mark.parametrize(("changes", "message"), [
    ({"base_port": 80}, "inference_base_port is 80: use a value from 1024 to 65535"),
    ({"base_port": "x"}, "inference_base_port is 'x': give a whole number"),
    ({"base_port": 65530}, "runs past port 65535"),
    ({"base_port": 9095}, "ports 9095-9102 include 9100, used by node_exporter"),
    ({"balancer": True, "base_port": 8080, "gpus": 0}, "include 8080, used by the balancer"),
    ({"balancer": True, "balancer_port": 9100}, "inference_balancer_port 9100 is used by node_exporter"),
    ({"model_dir": "models/sd3"}, "inference_model_dir is 'models/sd3': give the absolute path"),
    ({"model_dir": ""}, "neither inference_model_dir"),
    ({"tries": 1}, "inference_balancer_tries is 1: use a value from 2 to 10"),
    ({"gpus": -2}, "the GPU count"),
    ({"max_body_bytes": 10}, "inference_max_body_bytes is 10"),
    ({"drain_timeout_s": 0}, "inference_drain_timeout_s is 0: use a value 1 or more"),
    ({"serve_settings": {"port": 1}}, "inference_serve_settings sets port: set it with inference_base_port"),
])
def test_bad_settings_are_named_with_the_fix(changes, message):
    assert inf.inference_problems(GOOD) == []
    problems = inf.inference_problems({**GOOD, **changes})
    assert any(message in p for p in problems), problems
    assert all(p.startswith("gpu01: ") for p in problems)


def test_a_preset_without_a_model_folder_is_enough():
    assert inf.inference_problems({**GOOD, "model_dir": "", "preset": "tiny"}) == []


# -- the health checker -----------------------------------------------------------------------------------------
def checker_settings(tmp_path: Path, workers: list[dict]) -> health.Settings:
    return health.Settings(upstream="sd3_inference", upstream_file=str(tmp_path / "upstream.conf"), workers=workers,
                           server_options="max_fails=1 fail_timeout=10s", keepalive=8, interval_s=0.1, timeout_s=1,
                           fall=2, rise=2, reload_command=["true"], state_file=str(tmp_path / "state.json"))


def test_fall_and_rise_need_probes_in_a_row():
    state = health.WorkerState()
    health.update(state, True, "", 2, 2)
    assert state.up is True  # the first probe decides at once
    health.update(state, False, "HTTP 503", 2, 2)
    assert state.up is True
    health.update(state, True, "", 2, 2)  # a good probe resets the count
    health.update(state, False, "HTTP 503", 2, 2)
    assert state.up is True
    health.update(state, False, "refused", 2, 2)
    assert state.up is False and state.last_error == "refused"
    health.update(state, True, "", 2, 2)
    assert state.up is False
    health.update(state, True, "", 2, 2)
    assert state.up is True


def test_the_upstream_block_marks_unready_workers_down(tmp_path):
    workers = [{"name": "a", "address": "10.0.0.1", "port": 8100}, {"name": "b", "address": "10.0.0.2", "port": 8100},
               {"name": "c", "address": "10.0.0.3", "port": 8100}]
    states = {"a": health.WorkerState(up=True), "b": health.WorkerState(up=False, last_error="HTTP 503 (draining)")}
    text = health.render(checker_settings(tmp_path, workers), states)
    assert "upstream sd3_inference {" in text and "keepalive 8;" in text
    assert "server 10.0.0.1:8100 max_fails=1 fail_timeout=10s;  # a" in text
    assert "server 10.0.0.2:8100 down;  # b: HTTP 503 (draining)" in text
    assert "server 10.0.0.3:8100 max_fails=1 fail_timeout=10s;  # c" in text  # not probed yet: not down


class Readyz(http.server.BaseHTTPRequestHandler):
    ready = True

    def do_GET(self):
        code = 200 if type(self).ready and self.path == "/readyz" else 503
        body = json.dumps({"ready": code == 200, "reason": "draining"}).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def readyz_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Readyz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    Readyz.ready = True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probes_mark_a_draining_and_a_dead_worker_down_and_write_only_on_change(tmp_path, readyz_server):
    workers = [{"name": "live", "address": "127.0.0.1", "port": readyz_server.server_address[1]},
               {"name": "dead", "address": "127.0.0.1", "port": free_port()}]
    settings = checker_settings(tmp_path, workers)
    states: dict = {}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        assert health.check_once(settings, states, pool) is True
        text = Path(settings.upstream_file).read_text()
        assert re.search(r"server 127\.0\.0\.1:\d+ max_fails=1 fail_timeout=10s;  # live\n", text), text
        assert re.search(r"server 127\.0\.0\.1:\d+ down;  # dead: .*refused", text), text
        assert json.loads(Path(settings.state_file).read_text())["live"] == {"up": True, "error": ""}
        assert health.check_once(settings, states, pool) is False  # same answers: no rewrite, no reload

        Readyz.ready = False  # the live one drains: 503 twice in a row takes it out
        assert health.check_once(settings, states, pool) is False
        assert health.check_once(settings, states, pool) is True
        assert "down;  # live: HTTP 503 (draining)" in Path(settings.upstream_file).read_text()


def test_once_prints_whether_the_block_changed(tmp_path, readyz_server, capsys):
    workers = [{"name": "live", "address": "127.0.0.1", "port": readyz_server.server_address[1], "device": "cpu"}]
    config = tmp_path / "balancer.json"
    settings = checker_settings(tmp_path, workers)
    config.write_text(json.dumps({k: getattr(settings, k) for k in health.Settings.__dataclass_fields__}))
    assert health.main(["--config", str(config), "--once"]) == 0
    assert health.main(["--config", str(config), "--once"]) == 0
    assert capsys.readouterr().out.split() == ["changed", "unchanged"]


def test_unknown_checker_settings_are_refused(tmp_path):
    config = tmp_path / "balancer.json"
    config.write_text(json.dumps({"upstream": "u", "upstream_file": "f", "workers": [], "intervall_s": 1}))
    with pytest.raises(SystemExit, match="unknown settings intervall_s"):
        health.Settings.load(str(config))


# -- the role's files -------------------------------------------------------------------------------------------
def defaults() -> dict:
    return yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())


def render(template: str, **extra) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROLE / "templates"), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    env.filters.update(load("inference_filter_for_templates", REPO / "ansible" / "plugins" / "filter" /
                            "inference.py").FilterModule().filters())
    env.filters["basename"] = lambda p: Path(p).name
    env.filters["dirname"] = lambda p: str(Path(p).parent)
    role_vars = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    os_vars = yaml.safe_load((ROLE / "vars" / "Debian.yml").read_text())
    values = {**defaults(), **{k: v for k, v in role_vars.items() if "{{" not in str(v)}, **os_vars,
              "ansible_managed": "managed", "inference_config_dir": "/etc/sd3-inference", **extra}
    return env.get_template(template).render(**values)


def test_the_worker_unit_drains_before_systemd_kills_and_restarts_on_failure():
    d = defaults()
    gpu = render("sd3-inference@.service.j2", __inference_workers=inf.inference_workers("g", "10.0.0.1", 8, 8100))
    timeout = int(re.search(r"^TimeoutStopSec=(\d+)$", gpu, re.M).group(1))
    assert timeout > d["inference_drain_timeout_s"] + d["inference_drain_grace_s"]
    for line in ("Restart=on-failure", "KillSignal=SIGTERM", "Environment=CUDA_VISIBLE_DEVICES=%i",
                 f"User={d['inference_user']}", "ExecStart=/opt/sd3cluster/venv/bin/sd3cluster serve --config "
                 "/etc/sd3-inference/worker-%i.yaml", "WantedBy=multi-user.target"):
        assert f"\n{line}\n" in gpu, line
    cpu = render("sd3-inference@.service.j2", __inference_workers=inf.inference_workers("c", "10.0.0.2", 0, 8100))
    assert "\nEnvironment=CUDA_VISIBLE_DEVICES=\n" in cpu and "RequiresMountsFor" not in cpu
    with_model = render("sd3-inference@.service.j2", __inference_workers=inf.inference_workers("g", "1.1.1.1", 1, 8100),
                        inference_model_dir="/shared/models/sd3")
    assert "\nRequiresMountsFor=/shared/models/sd3\n" in with_model


def test_nginx_retries_elsewhere_waits_past_the_deadline_and_limits_the_body():
    d = defaults()
    workers = inf.inference_workers("gpu01", "10.0.0.1", 2, 8100) + inf.inference_workers("cpu01", "10.0.0.2", 0, 8100)
    conf = render("nginx.conf.j2", __inference_all_workers=workers)
    assert "include /etc/nginx/sd3-inference/upstream.conf;" in conf
    assert f"listen {d['inference_balancer_port']};" in conf
    assert "proxy_next_upstream error timeout http_502 http_503 non_idempotent;" in conf  # a 429 goes to the client
    assert f"proxy_next_upstream_tries {d['inference_balancer_tries']};" in conf
    read = int(re.search(r"proxy_read_timeout (\d+)s;", conf).group(1))
    assert read > d["inference_request_timeout_s"]
    assert f"client_max_body_size {d['inference_max_body_bytes']};" in conf
    assert "proxy_pass http://sd3_inference;" in conf and 'proxy_set_header Connection "";' in conf


def test_nginx_sends_a_job_to_the_worker_that_holds_it():
    workers = inf.inference_workers("gpu01", "10.0.0.1", 2, 8100) + inf.inference_workers("cpu01", "10.0.0.2", 0, 8100)
    conf = render("nginx.conf.j2", __inference_all_workers=workers)
    mapping = re.search(r"map \$sd3_job_route \$sd3_job_worker \{(.*?)\n\}", conf, re.S).group(1)
    routes = dict(line.strip().rstrip(";").split() for line in mapping.splitlines() if line.strip())
    assert routes == {"default": '""', "gpu01-cuda0": "10.0.0.1:8100", "gpu01-cuda1": "10.0.0.1:8101",
                      "cpu01-cpu0": "10.0.0.2:8100"}
    location = re.search(r'location ~ "(.*?)" \{(.*?)\n    \}', conf, re.S)
    pattern = location.group(1).replace("?<", "?P<")  # PCRE's named group, in Python's spelling
    job_id = "gpu01-cuda1-" + "0123456789abcdef" * 2  # what that worker's serve hands out (serve.job_prefix)
    assert re.match(pattern, f"/v1/jobs/{job_id}").group("sd3_job_route") == "gpu01-cuda1"
    assert re.match(pattern, "/v1/jobs/0123456789abcdef0123456789abcdef") is None  # no worker named: balanced
    body = location.group(2)
    assert "proxy_pass http://$sd3_job_worker;" in body and "proxy_next_upstream off;" in body


def test_every_knob_is_specified_and_documented():
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    knobs = set(defaults())
    assert knobs <= set(specs), sorted(knobs - set(specs))
    assert {k for k in specs if k.startswith("inference_")} == knobs
    for name, spec in specs.items():
        assert spec.get("description"), name
        if name in knobs and "default" in spec:
            assert spec["default"] == defaults()[name], name
    lines = (ROLE / "defaults" / "main.yml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^inference_\w+:", line):
            above = [x for x in lines[:i] if x.strip()]
            assert above[-1].startswith("#") or lines[i - 1].startswith("inference_"), f"{line}: no comment says why"


@pytest.mark.parametrize("inventory", ["defaults", "local"])
def test_the_worker_settings_are_valid_for_sd3cluster_serve(inventory, tmp_path):
    """What the role writes into worker-<i>.yaml (defaults, or the local inventory's) loads with the package's own
    configuration class: the service would start with it, on the worker's address, port and device."""
    sys.path.insert(0, str(REPO / "workloads" / "src"))  # this checkout's package
    import sd3cluster.config
    from sd3cluster.config import load_config

    assert Path(sd3cluster.config.__file__).is_relative_to(REPO), \
        f"sd3cluster comes from {sd3cluster.config.__file__}, not this checkout: run with PYTHONPATH=workloads/src"

    values = defaults()
    if inventory == "local":
        values |= yaml.safe_load((REPO / "inventories" / "local" / "group_vars" / "all" / "inference.yml").read_text())
    else:
        values["inference_model_dir"] = str(tmp_path)  # a folder; the service checks its files only at start
    base = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())["__inference_serve_base"]
    env = jinja2.Environment()
    env.filters["bool"] = bool
    settings = {key: env.from_string(str(value)).render(**values) for key, value in base.items()}
    settings = {key: yaml.safe_load(value) if value else value for key, value in settings.items()}
    for worker in inf.inference_workers("gpu01", "10.10.0.11", 2 if inventory == "defaults" else 0, 8100):
        doc = inf.inference_serve_config(worker, settings, values["inference_serve_settings"],
                                         values["inference_preset"])
        path = tmp_path / f"worker-{worker['index']}.yaml"
        path.write_text(yaml.safe_dump(doc))
        cfg = load_config(path)
        assert (cfg.serve.host, cfg.serve.port, cfg.serve.device) == ("10.10.0.11", worker["port"], worker["device"])
        assert cfg.serve.job_prefix == worker["name"]  # the balancer's job route
        assert cfg.serve.request_timeout_s == values["inference_request_timeout_s"]
        assert cfg.serve.drain_timeout_s == values["inference_drain_timeout_s"]
        assert cfg.serve.max_body_bytes == values["inference_max_body_bytes"]
        if inventory == "local":
            assert cfg.model.preset == "tiny" and cfg.serve.pretrained is None and cfg.serve.default_size == 64
        else:
            assert cfg.serve.pretrained == tmp_path


def test_serving_is_off_in_prod_and_on_in_the_local_inventory():
    prod = yaml.safe_load((REPO / "inventories" / "prod" / "group_vars" / "all.yml").read_text())
    local = yaml.safe_load((REPO / "inventories" / "local" / "group_vars" / "all" / "inference.yml").read_text())
    assert prod["inference_enabled"] is False and defaults()["inference_enabled"] is False
    assert local["inference_enabled"] is True and local["inference_preset"] == "tiny"
    site = yaml.safe_load((REPO / "site.yml").read_text())
    assert any(p["ansible.builtin.import_playbook"].endswith("/inference.yml") for p in site)
    (play,) = yaml.safe_load((REPO / "ansible" / "playbooks" / "inference.yml").read_text())
    assert play["tags"] == ["inference"] and play["roles"][0]["when"] == "inference_enabled | default(false) | bool"
