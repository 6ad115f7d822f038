"""localcluster/molecule_failure.py and run-scenarios.sh's use of it: the step a scenario failed in, read from
molecule's coloured log (the retry of create/prepare depends on it), and the summary printed at the end of a run,
which must name a failed loop item (a loop prints `failed: [host] (item=...)`, no fatal line) rather than an
earlier failure a verify rescued."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "localcluster"))

from molecule_failure import failed_step, failure_summary  # noqa: E402

SCRIPT = REPO / "localcluster" / "molecule_failure.py"


def colour(text: str) -> str:
    return f"\x1b[2m\x1b[31m│\x1b[0m \x1b[31m{text}\x1b[0m"


def step_line(scenario: str, step: str, result: str) -> str:
    return (f"\x1b[31mERROR   \x1b[0m \x1b[32m{scenario}\x1b[0m ➜ \x1b[33m{step}\x1b[0m: "
            f"\x1b[31mExecuted: {result}\x1b[0m")


BENIGN = "\x1b[31m\x1b[1mCRITICAL\x1b[0m 'molecule/default/molecule.yml' glob failed.  Exiting."
RESCUED = [
    colour("TASK [glusterfs : Stop when the storage layout cannot be built] ***"),
    colour('fatal: [storage-node3]: FAILED! => {"msg": "replica 4 but only 3 storage node(s)"}'),
    colour("TASK [Check the message names the host] ***"),
    colour("ok: [storage-node3]"),
]
LOOP_FAILURE = [
    colour("TASK [glusterfs : Converge every volume (create, add bricks, set options, start)] ***"),
    colour('failed: [storage-node1] (item=shared) => {"msg": "`gluster volume add-brick shared` failed: busy"}'),
    colour("PLAY RECAP *********"),
    colour("storage-node1 : ok=40 changed=3 unreachable=0 failed=1 skipped=2 rescued=1 ignored=0"),
]


def log(*parts: list[str] | str) -> str:
    lines = [BENIGN]
    for part in parts:
        lines += part if isinstance(part, list) else [part]
    return "\n".join(lines) + "\n"


def test_a_failed_loop_item_after_a_rescued_failure_is_the_one_named():
    text = log(RESCUED, LOOP_FAILURE, step_line("storage", "verify", "Failed"))
    summary = failure_summary(text)
    assert failed_step(text) == "verify"
    assert summary.splitlines()[0] == "  molecule stopped in: verify"
    assert "last failed task: TASK [glusterfs : Converge every volume" in summary
    assert "(item=shared)" in summary and "add-brick shared` failed: busy" in summary
    assert "replica 4 but only" not in summary
    assert "\x1b[" not in summary and "glob failed" not in summary


def test_an_idempotence_failure_names_the_tasks_that_changed():
    text = log(
        "\x1b[31m\x1b[1mCRITICAL\x1b[0m Idempotence test failed because of the following tasks:",
        "* [base-node1] => base : Write the motd",
        step_line("base", "idempotence", "Failed"),
    )
    summary = failure_summary(text)
    assert "molecule stopped in: idempotence" in summary
    assert "CRITICAL Idempotence test failed because of the following tasks:" in summary
    assert "* [base-node1] => base : Write the motd" in summary
    assert "last failed task" not in summary


def test_a_scenario_stopped_at_its_time_limit_says_so():
    text = log(RESCUED, "(stopped after 900 s, MOLECULE_SCENARIO_TIMEOUT_S; its nodes removed)")
    assert "(stopped after 900 s, MOLECULE_SCENARIO_TIMEOUT_S; its nodes removed)" in failure_summary(text)


def test_an_unreachable_node_and_a_create_failure():
    text = log(colour("TASK [Wait for systemd] ***"),
               colour("fatal: [slurm-node2]: UNREACHABLE! => {\"msg\": \"container not running\"}"),
               step_line("slurm", "create", "Failed"))
    assert failed_step(text) == "create"
    assert "last failed task: TASK [Wait for systemd] ***" in failure_summary(text)


def test_a_log_without_a_failure_says_none_was_found():
    text = log(RESCUED[2:], step_line("storage", "verify", "Successful"))
    assert failed_step(text) is None
    assert failure_summary(text) == "  (no failed step or task in the log)"


def test_the_command_line(tmp_path):
    path = tmp_path / "scenario.log"
    path.write_text(log(LOOP_FAILURE, step_line("storage", "converge", "Failed")))
    step = subprocess.run([sys.executable, SCRIPT, "step", path], capture_output=True, text=True, check=True)
    assert step.stdout == "converge\n"
    wrong = subprocess.run([sys.executable, SCRIPT, "why", path], check=False, capture_output=True, text=True)
    assert wrong.returncode == 2 and "Usage: molecule_failure.py summary|step LOG" in wrong.stderr
    missing = subprocess.run([sys.executable, SCRIPT, "summary", tmp_path / "none.log"], check=False,
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "cannot read" in missing.stdout and "Traceback" not in missing.stderr


FAKE_MOLECULE = """#!/usr/bin/env bash
# molecule test -s SCENARIO: the first try of 'flaky' fails in create, every try of 'broken' fails in verify.
scenario=$3
count_file="$FAKE_STATE/$scenario"
tries=$(( $(cat "$count_file" 2>/dev/null || echo 0) + 1 )); echo "$tries" >"$count_file"
printf '%s\\n' "$FAKE_LOG_START"
if [[ $scenario == flaky && $tries -eq 1 ]]; then printf '%s\\n' "$FAKE_CREATE_FAILED"; exit 1; fi
if [[ $scenario == broken ]]; then printf '%s\\n' "$FAKE_VERIFY_FAILED"; exit 1; fi
exit 0
"""


def test_run_scenarios_retries_a_create_failure_only_and_ends_with_why(tmp_path):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "molecule").write_text(FAKE_MOLECULE)
    (bin_dir / "molecule").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_STATE": str(state),
           "FAKE_LOG_START": BENIGN,
           "FAKE_CREATE_FAILED": step_line("flaky", "create", "Failed"),
           "FAKE_VERIFY_FAILED": "\n".join([*RESCUED, *LOOP_FAILURE, step_line("broken", "verify", "Failed")])}
    work = tmp_path / "work"
    (work / "localcluster").mkdir(parents=True)
    for name in ("run-scenarios.sh", "molecule_failure.py"):
        (work / "localcluster" / name).write_bytes((REPO / "localcluster" / name).read_bytes())
    run = subprocess.run(["bash", "localcluster/run-scenarios.sh", "1", "flaky", "broken"], cwd=work, env=env,
                         check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert (state / "flaky").read_text() == "2\n" and (state / "broken").read_text() == "1\n"
    assert "flaky        failed in create/prepare; running it once more" in run.stdout
    assert "[molecule] flaky        passed" in run.stdout
    why = run.stdout[run.stdout.index("[molecule] broken failed; why"):]
    assert "molecule stopped in: verify" in why and "(item=shared)" in why
    assert (work / ".cache" / "molecule-logs" / "flaky.first-try.log").exists()
