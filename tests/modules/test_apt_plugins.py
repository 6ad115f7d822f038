"""The apt_packages and signed_apt_repository actions run by ansible-playbook against this machine, in check
mode wherever they would change it (the rules they share are tested in test_apt_rules.py; writing files and
installing packages is checked on the molecule nodes: base, gpu_stack, monitoring)."""
from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]


def play(tmp_path, tasks, *extra):
    """Run the tasks on localhost; (rc, {task name: result}) read from the json callback."""
    playbook = tmp_path / "play.yml"
    playbook.write_text(json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}]))
    # The project's plugin paths with a JSON report and none of its timing callbacks (they print too).
    config = tmp_path / "ansible.cfg"
    config.write_text("[defaults]\n" + "".join(f"{key} = {REPO / 'ansible' / 'plugins' / folder}\n" for key, folder in (
        ("library", "modules"), ("action_plugins", "action"), ("module_utils", "module_utils"),
        ("filter_plugins", "filter"))) + "stdout_callback = ansible.posix.json\ninterpreter_python = auto_silent\n")
    env = dict(os.environ, ANSIBLE_CONFIG=str(config), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={sys.executable}", str(playbook), *extra],
                          capture_output=True, text=True, env=env, cwd=tmp_path, check=False)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON from ansible-playbook (rc {proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    results = {task["task"]["name"]: task["hosts"]["localhost"] for p in report["plays"] for task in p["tasks"]}
    return proc.returncode, results


# ---- apt_packages

def test_installed_packages_do_not_start_apt(tmp_path):
    # Not check mode: with everything installed the action must not call apt (which would need the cache).
    rc, results = play(tmp_path, [{"name": "probe", "apt_packages": {"name": ["dpkg", "coreutils"]}}])
    assert rc == 0
    assert results["probe"]["changed"] is False
    assert results["probe"]["missing"] == []
    assert results["probe"]["installed"] == []
    assert "cache_updated" not in results["probe"]


def test_check_mode_lists_the_missing_and_the_names_only_apt_can_match(tmp_path):
    names = ["dpkg", "sd3-no-such-package", "coreutils=0.0-0", "bash"]
    rc, results = play(tmp_path, [{"name": "probe", "apt_packages": {"name": names}}], "--check")
    assert rc == 0
    result = results["probe"]
    assert result["changed"] is True
    assert result["missing"] == ["sd3-no-such-package", "coreutils=0.0-0"]
    assert result["installed"] == ["sd3-no-such-package", "coreutils=0.0-0"]
    assert "would install sd3-no-such-package, coreutils=0.0-0" in result["msg"]
    # Nothing was installed.
    probe = subprocess.run(["dpkg-query", "--show", "sd3-no-such-package"], capture_output=True, check=False)
    assert probe.returncode == 1


def test_a_missing_name_argument_is_named(tmp_path):
    rc, results = play(tmp_path, [{"name": "probe", "apt_packages": {"update_cache": False}}], "--check")
    assert rc == 2
    assert results["probe"]["failed"] is True
    assert "name" in results["probe"]["msg"]


def test_an_unknown_argument_is_refused(tmp_path):
    rc, results = play(tmp_path, [{"name": "probe", "apt_packages": {"name": ["dpkg"], "state": "latest"}}])
    assert rc == 2
    assert "state" in results["probe"]["msg"]



def test_a_pin_at_the_installed_version_does_not_start_apt(tmp_path):
    version = subprocess.run(["dpkg-query", "--show", "--showformat=${Version}", "dpkg"],
                             capture_output=True, text=True, check=True).stdout
    rc, results = play(tmp_path, [{"name": "probe", "apt_packages": {"name": [f"dpkg={version}", "coreutils"]}}])
    assert rc == 0, results
    assert results["probe"]["changed"] is False
    assert results["probe"]["missing"] == []
    assert "cache_updated" not in results["probe"]


def test_check_mode_takes_the_held_package_and_policy_rc_d_options(tmp_path):
    args = {"name": ["dpkg", "sd3-no-such-package=1.0-1"], "allow_change_held_packages": True, "policy_rc_d": "101"}
    rc, results = play(tmp_path, [{"name": "probe", "apt_packages": args}], "--check")
    assert rc == 0, results
    assert results["probe"]["changed"] is True
    assert results["probe"]["missing"] == ["sd3-no-such-package=1.0-1"]


class _Node:
    """What the action asks of the node, answered from fixed text: the dpkg probe's output, and the apt
    module's result (the arguments it was given are kept)."""

    def __init__(self, probe_stdout, apt_result):
        self.probe_stdout, self.apt_result = probe_stdout, apt_result
        self.commands, self.apt_args = [], []

    def action(self, args):
        action_class = runpy.run_path(str(REPO / "ansible" / "plugins" / "action" / "apt_packages.py"))["ActionModule"]
        task = SimpleNamespace(args=args, async_val=0, check_mode=False, action="apt_packages")
        connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/tmp/sd3-test"))
        action = action_class(task, connection, None, None, None)
        action._low_level_execute_command = self.execute
        action._execute_module = self.module
        return action

    def execute(self, command, sudoable=True):
        self.commands.append(command)
        return {"rc": 0, "stdout": self.probe_stdout, "stderr": ""}

    def module(self, module_name, module_args, task_vars=None):
        assert module_name == "ansible.legacy.apt"
        self.apt_args.append(module_args)
        return dict(self.apt_result)


def test_held_packages_and_policy_rc_d_reach_the_apt_module():
    node = _Node("nvidia-smi\thi \t535.247.01-1\n", {"changed": True})
    result = node.action({"name": ["nvidia-smi=535.261.03-1"], "allow_change_held_packages": True,
                          "policy_rc_d": 101, "update_cache": False}).run(task_vars={})
    assert "nvidia-smi" in node.commands[0].split()
    assert node.apt_args == [{"name": ["nvidia-smi=535.261.03-1"], "state": "present", "install_recommends": False,
                              "allow_change_held_packages": True, "policy_rc_d": 101}]
    assert result["changed"] is True
    assert result["installed"] == ["nvidia-smi=535.261.03-1"]


def test_without_the_options_apt_keeps_holds_and_gets_no_policy_rc_d():
    node = _Node("", {"changed": True})
    node.action({"name": ["chrony"]}).run(task_vars={})
    assert node.apt_args == [{"name": ["chrony"], "state": "present", "install_recommends": False,
                              "allow_change_held_packages": False, "update_cache": True, "cache_valid_time": 3600}]


def test_a_held_package_pinned_at_its_version_is_not_given_to_apt():
    node = _Node("nvidia-smi\thi \t535.261.03-1\n", {"changed": True})
    result = node.action({"name": ["nvidia-smi=535.261.03-1"], "allow_change_held_packages": True,
                          "policy_rc_d": 101}).run(task_vars={})
    assert node.apt_args == []
    assert result["changed"] is False
    assert result["missing"] == []


# ---- signed_apt_repository

@pytest.fixture(scope="module")
def key(tmp_path_factory):
    """An armored key made by gpg: (path, fingerprint)."""
    if not shutil.which("gpg"):
        pytest.skip("gpg is not installed here")
    home = tmp_path_factory.mktemp("gnupg")
    home.chmod(0o700)
    gpg = ["gpg", "--batch", "--homedir", str(home), "--passphrase", ""]
    subprocess.run([*gpg, "--quick-gen-key", "Repo <repo@example.org>", "ed25519", "sign", "never"],
                   check=True, capture_output=True)
    out = subprocess.run([*gpg, "--with-colons", "--list-keys"], check=True, capture_output=True, text=True).stdout
    path = home / "repo.asc"
    path.write_bytes(subprocess.run([*gpg, "--armor", "--export"], check=True, capture_output=True).stdout)
    return path, next(line.split(":")[9] for line in out.splitlines() if line.startswith("fpr:"))


def repository(**overrides):
    args = {"name": "sd3-test-repo", "uris": ["https://example.org/repo/"], "suites": ["/"], "update_cache": False}
    return {"name": "repo", "signed_apt_repository": {**args, **overrides}}


def test_check_mode_with_the_right_key_would_write_key_and_source(tmp_path, key):
    path, fingerprint = key
    rc, results = play(tmp_path, [repository(key_src=str(path), key_fingerprint=fingerprint)], "--check", "--diff")
    assert rc == 0, results
    result = results["repo"]
    assert result["changed"] is True
    assert result["fingerprints"] == [fingerprint]
    assert result["changed_paths"] == ["/etc/apt/keyrings/sd3-test-repo.asc",
                                       "/etc/apt/sources.list.d/sd3-test-repo.sources"]
    assert not Path("/etc/apt/sources.list.d/sd3-test-repo.sources").exists()
    assert not Path("/etc/apt/keyrings/sd3-test-repo.asc").exists()


def test_a_wrong_key_fails_naming_the_repository_and_both_fingerprints(tmp_path, key):
    path, fingerprint = key
    wrong = "EB693B3035CD5710E231E123A4B469963BF863CC"
    rc, results = play(tmp_path, [repository(key_src=str(path), key_fingerprint=wrong)], "--check")
    assert rc == 2
    message = results["repo"]["msg"]
    assert "repository sd3-test-repo" in message
    assert wrong in message and fingerprint in message
    assert str(path) in message
    assert "changed_paths" not in results["repo"]


def test_a_file_that_is_no_key_fails_before_anything_is_written(tmp_path):
    (tmp_path / "page.html").write_text("<html>Not Found</html>")
    rc, results = play(tmp_path, [repository(key_src=str(tmp_path / "page.html"),
                                             key_fingerprint="EB693B3035CD5710E231E123A4B469963BF863CC")], "--check")
    assert rc == 2
    assert "none (not an OpenPGP public key" in results["repo"]["msg"]
    assert "changed_paths" not in results["repo"]


@pytest.mark.parametrize("overrides, says", [
    ({"key_fingerprint": "3BF863CC"}, "not a full fingerprint"),
    ({"components": ["main"]}, "takes no components"),
    ({"key_src": "", "key_url": ""}, "give exactly one of key_url"),
    ({"key_path": "/etc/apt/keyrings/x.gpg"}, "ending in .asc"),
])
def test_bad_arguments_fail_naming_the_repository_and_changing_nothing(tmp_path, key, overrides, says):
    path, fingerprint = key
    rc, results = play(tmp_path, [repository(**{"key_src": str(path), "key_fingerprint": fingerprint, **overrides})])
    assert rc == 2
    assert results["repo"]["msg"].startswith("repository sd3-test-repo: ")
    assert says in results["repo"]["msg"]
    assert "Nothing was changed" in results["repo"]["msg"]


def test_check_mode_without_the_key_on_the_node_says_it_is_checked_later(tmp_path):
    rc, results = play(tmp_path, [repository(key_url="https://example.org/key.asc",
                                             key_fingerprint="EB693B3035CD5710E231E123A4B469963BF863CC")], "--check")
    assert rc == 0
    assert results["repo"]["changed"] is True
    assert "fingerprint is checked on the real run" in results["repo"]["msg"]


def test_check_mode_removal_of_an_absent_repository_changes_nothing(tmp_path):
    rc, results = play(tmp_path, [repository(state="absent")], "--check")
    assert rc == 0
    assert results["repo"]["changed"] is False
