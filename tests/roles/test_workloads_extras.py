"""workloads_extras: the sd3cluster package's extras the workloads role installs with it.

The role offers exactly the extras pyproject.toml defines; the pip argument and the install digest it derives
(rendered by Ansible itself, on this machine, nothing changed); and the fa4 extra, which the example production
inventory sets for gpu_nodes, resolves beside the role's torch pin without moving it.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "roles" / "workloads"
PYPROJECT = tomllib.loads((REPO / "workloads" / "pyproject.toml").read_text())
ANSIBLE = REPO / ".venv" / "bin" / "ansible-playbook"
SOURCE_DIGEST = "a.py:0123;b.py:4567;"
PLAY = """
- name: What the workloads role derives from workloads_extras
  hosts: localhost
  gather_facts: false
  vars_files: [{vars}]
  tasks:
    - name: The control machine's source digest, as package.yml takes it
      ansible.builtin.set_fact:
        __workloads_source_digest: "{digest}"
    - name: Print the derived values
      ansible.builtin.debug:
        msg: "RESULT {{{{ {{'spec': __workloads_package_spec, 'digest': __workloads_install_digest}} | to_json }}}}"
"""


def test_the_role_offers_exactly_the_packages_extras():
    spec = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["workloads_extras"]
    assert sorted(option["choices"]) == sorted(PYPROJECT["project"]["optional-dependencies"])
    assert option["default"] == yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())["workloads_extras"] == []


def test_the_example_production_inventory_installs_fa4_on_the_gpu_nodes():
    gpu_nodes = yaml.safe_load((REPO / "inventories" / "prod" / "group_vars" / "gpu_nodes.yml").read_text())
    assert gpu_nodes["workloads_extras"] == ["fa4"]


def _derived(tmp_path: Path, extras) -> dict:
    play = tmp_path / "play.yml"
    play.write_text(PLAY.format(vars=ROLE / "vars" / "main.yml", digest=SOURCE_DIGEST))
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_FACT_CACHING="memory")
    result = subprocess.run([str(ANSIBLE), "-i", "localhost,", "-c", "local", str(play),
                             "-e", f"ansible_python_interpreter={sys.executable}",
                             "-e", json.dumps({"workloads_extras": extras, "workloads_venv": "/opt/v",
                                               "workloads_remote_source_dir": "/opt/src"})],
                            check=False, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if "RESULT " in line)
    return json.loads(line.split("RESULT ", 1)[1].rstrip('"').replace('\\"', '"'))


@pytest.mark.parametrize(("extras", "spec", "digested"), [
    ([], "/opt/src", SOURCE_DIGEST),  # the source's digest alone: installs made before extras existed stay
    (["torchao", "fa4"], "/opt/src[fa4,torchao]", SOURCE_DIGEST + " extras=fa4,torchao"),
    ("fa4, bnb", "/opt/src[bnb,fa4]", SOURCE_DIGEST + " extras=bnb,fa4"),  # a string, as Ansible's list type reads
])
def test_the_pip_argument_and_the_install_digest_carry_the_extras(tmp_path, extras, spec, digested):
    derived = _derived(tmp_path, extras)
    assert derived == {"spec": spec, "digest": hashlib.sha256(digested.encode()).hexdigest()}


def test_the_fa4_extra_resolves_beside_the_roles_torch_pin(tmp_path):
    """pip's resolver (a dry run: nothing installed) on the package with its fa4 extra and the role's torch pin:
    torch stays the pinned version, and both CUDA flavours of the CUTLASS DSL come (it loads the newest the
    node's driver supports)."""
    torch_version = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())["workloads_torch_version"]
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                             "--report", str(report), f"torch=={torch_version}", f"{REPO / 'workloads'}[fa4]"],
                            check=False, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    chosen = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
              for item in json.loads(report.read_text())["install"]}
    assert chosen["torch"].split("+")[0] == torch_version
    pins = dict(req.replace("[cu13]", "").split("==") for req in PYPROJECT["project"]["optional-dependencies"]["fa4"]
                if "==" in req)
    for name, version in pins.items():
        assert chosen[name] == version, name
    dsl = pins["nvidia-cutlass-dsl"]
    assert chosen["nvidia-cutlass-dsl-libs-cu13"] == chosen["nvidia-cutlass-dsl-libs-cu12"] == dsl
