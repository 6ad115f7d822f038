"""The e2e tests' playbook runner on the control machine alone (no cluster): ansible-runner's stats and events
become the recap and the list of changed tasks the cluster tests assert on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from e2e_support import REPO, playbook

PLAY = """
- name: Two hosts of the control machine, one task that changes and one that fails on demand
  hosts: all
  gather_facts: false
  tasks:
    - name: Write a file
      ansible.builtin.copy:
        dest: "{{ out }}/{{ inventory_hostname }}.txt"
        content: "x\\n"
        mode: "0644"
    - name: Fail where asked
      ansible.builtin.fail:
        msg: asked to fail
      when: inventory_hostname in (fail_on | default([]))
"""


@pytest.fixture
def local_play(tmp_path: Path) -> tuple[Path, Path]:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all:\n  hosts:\n    one: {ansible_connection: local}\n    two: {ansible_connection: local}\n"
                         f"  vars: {{ansible_python_interpreter: {sys.executable}}}\n")
    play = tmp_path / "play.yml"
    play.write_text(PLAY)
    return inventory, play


def test_recap_and_changed_tasks_come_from_the_runner_stats(local_play, tmp_path):
    inventory, play = local_play
    first = playbook(str(play), "-e", f"out={tmp_path}", inventory_path=inventory, timeout=300)
    assert first.rc == 0 and first.green
    assert set(first.recap) == {"one", "two"}
    assert first.recap["one"]["changed"] == 1 and first.recap["one"]["failed"] == 0
    assert sorted(first.changed_tasks) == ["TASK [Write a file]: one", "TASK [Write a file]: two"]
    with pytest.raises(AssertionError, match="changed something"):
        first.assert_unchanged("the first run")
    second = playbook(str(play), "-e", f"out={tmp_path}", inventory_path=inventory, timeout=300)
    second.assert_unchanged("the second run")
    assert second.changed_tasks == []


def test_runs_keep_strict_host_keys_and_the_project_fact_cache(tmp_path):
    """ansible-runner would turn host key checking off and move the fact cache into its artifacts: the settings
    Ansible sees inside a run are the project's."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(f"all:\n  hosts:\n    one: {{ansible_connection: local, ansible_python_interpreter: "
                         f"{sys.executable}}}\n")
    play = tmp_path / "settings.yml"
    play.write_text("""
- name: Print the settings Ansible runs with
  hosts: one
  gather_facts: false
  tasks:
    - name: Print them
      ansible.builtin.debug:
        msg: "host_key_checking={{ lookup('ansible.builtin.config', 'HOST_KEY_CHECKING') }}
          cache={{ lookup('ansible.builtin.config', 'CACHE_PLUGIN') }}:{{ lookup('ansible.builtin.config',
          'CACHE_PLUGIN_CONNECTION') }}"
""")
    run = playbook(str(play), inventory_path=inventory, timeout=300)
    assert "host_key_checking=True" in run.stdout, run.stdout
    # The repository's cache (ansible.cfg's), by its absolute path, not one in the runner's private folder.
    assert f"cache=jsonfile:{REPO / '.cache' / 'ansible-facts'}\"" in run.stdout, run.stdout


def test_a_failed_host_is_named_and_stops_a_checked_run(local_play, tmp_path):
    inventory, play = local_play
    args = ("-e", f"out={tmp_path}", "-e", '{"fail_on": ["two"]}')
    failed = playbook(str(play), *args, inventory_path=inventory, check=False, timeout=300)
    assert failed.rc != 0 and not failed.green
    assert failed.recap["two"]["failed"] == 1 and failed.recap["one"]["failed"] == 0
    assert "asked to fail" in failed.stdout
    with pytest.raises(AssertionError, match=r"failed hosts \{'two'"):
        playbook(str(play), *args, inventory_path=inventory, timeout=300)
