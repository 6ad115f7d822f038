"""The efa role run on this machine (connection local): with efa_interfaces 0 it changes nothing; promised EFA on a
machine without an EFA device (this one) stops before anything is downloaded or written, with the reason. Only
/sys/bus/pci is read. The installer itself cannot run here (no EFA device, no AWS endpoint)."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / ".venv" / "bin" / "ansible-playbook"
PLAY = """
- name: The efa role on this machine
  hosts: localhost
  gather_facts: false
  roles:
    - role: efa
"""


def _run(tmp_path, *extra):
    play = tmp_path / "efa.yml"
    play.write_text(PLAY)
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_FACT_CACHING="memory")
    return subprocess.run([str(ANSIBLE), "-i", "localhost,", "-c", "local", str(play),
                           "-e", f"ansible_python_interpreter={REPO / '.venv' / 'bin' / 'python'}",
                           "-e", f"efa_installer_dir={tmp_path / 'installer'}",
                           "-e", f"efa_job_env_file={tmp_path / 'sd3-efa.sh'}", *extra],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=False)


def test_a_node_without_efa_is_left_alone(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "changed=0" in done.stdout and "skipped=1" in done.stdout
    assert not (tmp_path / "installer").exists() and not (tmp_path / "sd3-efa.sh").exists()


def test_efa_promised_on_a_machine_without_it_stops_with_the_reason(tmp_path):
    done = _run(tmp_path, "-e", "efa_interfaces=4", "-e", "efa_installer_checksum=sha256:" + "0" * 64)
    assert done.returncode != 0
    assert "efa_interfaces is 4 but the node has no EFA device on its PCI bus" in done.stdout
    assert "nothing was changed" in done.stdout
    assert not (tmp_path / "installer").exists() and not (tmp_path / "sd3-efa.sh").exists()


def test_an_unchecked_installer_is_refused(tmp_path):
    done = _run(tmp_path, "-e", "efa_interfaces=4")
    assert done.returncode != 0
    assert "efa_installer_checksum is '': give sha256:<64 hex digits>" in done.stdout
