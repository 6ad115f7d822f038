"""What every end-to-end test of the local cluster uses: commands, the inventory, the nodes, playbook runs.

Playbooks run through ansible-runner, so a test reads the run's structured stats and task events (which host
failed, which task changed) instead of parsing the PLAY RECAP text. Host state is read with testinfra's podman
backend (`host("node2").service("slurmd").is_running`), or `node()` for a plain shell command.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "inventories" / "local" / "hosts.yml"
BIN = Path(sys.executable).parent
ENV = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
           CONTAINERS_CONF=str(REPO / "localcluster" / "containers.conf"),
           PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def run(*args: str, timeout: int = 900, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=timeout, check=False)
    if check:
        assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    return result


def inventory() -> dict:
    assert INVENTORY.exists(), "no inventories/local/hosts.yml: run `make cluster-up` first"
    return yaml.safe_load(INVENTORY.read_text())


def hosts() -> list[str]:
    return list(inventory()["all"]["hosts"])


def cluster_up(nodes: int) -> None:
    run(str(BIN / "python"), "localcluster/cluster.py", "up", "--nodes", str(nodes), timeout=900)


def node(name: str, command: str, check: bool = True, timeout: int = 120) -> str:
    """A shell command inside a node's container; its stdout without the trailing whitespace."""
    result = subprocess.run(["podman", "exec", f"sd3-{name}", "bash", "-c", command], capture_output=True,
                            text=True, timeout=timeout, check=False, env=ENV)
    if check:
        assert result.returncode == 0, f"{name}: {command}\n{result.stdout}\n{result.stderr}"
    return result.stdout.rstrip()


def host(name: str):
    """testinfra's view of a node (services, files, sockets, packages), through `podman exec`."""
    import testinfra

    os.environ.setdefault("CONTAINERS_CONF", ENV["CONTAINERS_CONF"])
    return testinfra.get_host(f"podman://sd3-{name}")


def wait_for(what: str, probe, timeout: float, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def job_field(head: str, job: str, field: str) -> str:
    """One field of a Slurm job as the controller on `head` shows it ('' once the job is gone)."""
    text = node(head, f"scontrol show job {job} -o", check=False)
    match = re.search(rf"\b{field}=(\S+)", text)
    return match.group(1) if match else ""


@dataclass
class PlaybookRun:
    """One ansible-playbook run as ansible-runner reports it."""

    rc: int
    stdout: str
    recap: dict[str, dict[str, int]]  # {host: {ok, changed, failed, unreachable, skipped, rescued, ignored}}
    changed_tasks: list[str] = field(default_factory=list)  # "TASK NAME: host" of every changed result
    seconds: float = 0.0  # wall time of the run

    @property
    def green(self) -> bool:
        return self.rc == 0 and all(not h["failed"] and not h["unreachable"] for h in self.recap.values())

    def assert_green(self) -> dict[str, dict[str, int]]:
        assert self.recap, self.stdout[-3000:]
        bad = {name: h for name, h in self.recap.items() if h["failed"] or h["unreachable"]}
        assert not bad and self.rc == 0, f"rc {self.rc}, failed hosts {bad}:\n{self.stdout[-4000:]}"
        return self.recap

    def assert_unchanged(self, what: str) -> None:
        changed = {name: h["changed"] for name, h in self.recap.items()}
        assert all(count == 0 for count in changed.values()), \
            f"{what} changed something: {changed}; the tasks:\n" + "\n".join(self.changed_tasks)


# ansible.cfg's fact cache, by its absolute path: ansible-runner starts ansible-playbook in its own private folder,
# where the relative path of ansible.cfg would make a new, empty cache every run. A later run with --tags (the
# inference test's) reads the facts of the plays it skips from there, as a user's runs do.
FACT_CACHE = {"ANSIBLE_CACHE_PLUGIN": "jsonfile",
              "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(REPO / ".cache" / "ansible-facts")}

# ansible-runner's stats keys -> the names of Ansible's PLAY RECAP.
_RECAP_KEYS = {"ok": "ok", "changed": "changed", "failures": "failed", "dark": "unreachable",
               "skipped": "skipped", "rescued": "rescued", "ignored": "ignored"}


def playbook(path: str, *args: str, check: bool = True, timeout: int = 3600,
             inventory_path: Path = REPO / "inventories" / "local") -> PlaybookRun:
    """ansible-playbook PATH -i INVENTORY ARGS through ansible-runner; check: assert a green run. PATH is
    relative to the repository (or absolute); the run's working folder is the repository."""
    import ansible_runner

    private = Path(tempfile.mkdtemp(prefix="sd3-e2e-runner-"))
    started = time.monotonic()
    try:
        runner = ansible_runner.run(
            private_data_dir=str(private), project_dir=str(REPO), playbook=str(REPO / path),
            inventory=str(inventory_path), cmdline=shlex.join(args), quiet=True, timeout=timeout,
            # ansible-runner turns host key checking off unless the environment says otherwise: the project's
            # promise (strict host keys, ansible.cfg) holds in the tests too.
            envvars={**{k: ENV[k] for k in ("ANSIBLE_CONFIG", "ANSIBLE_NOCOLOR", "CONTAINERS_CONF", "PATH")},
                     "ANSIBLE_HOST_KEY_CHECKING": "True", **FACT_CACHE},
            # Any type but 'jsonfile' keeps ansible-runner from pointing the fact cache into its throw-away
            # artifacts (FACT_CACHE says where it is instead).
            fact_cache_type="project")
        stdout = runner.stdout.read()
        stats = runner.stats or {}
        recap = {name: {label: int(stats.get(key, {}).get(name, 0)) for key, label in _RECAP_KEYS.items()}
                 for name in stats.get("processed", {})}
        changed = [f"TASK [{event['event_data'].get('task', '?')}]: {event['event_data'].get('host', '?')}"
                   for event in runner.events
                   if event.get("event") == "runner_on_ok" and event["event_data"].get("res", {}).get("changed")]
        result = PlaybookRun(int(runner.rc), stdout, recap, changed, time.monotonic() - started)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if check:
        result.assert_green()
    return result
