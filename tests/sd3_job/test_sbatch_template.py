"""The training job's sbatch template asks for every GPU of its nodes (from gres) and starts one process per GPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jinja2
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "roles" / "sd3_job" / "templates" / "train-sd3.sbatch.j2"
DEFAULTS = yaml.safe_load((ROOT / "roles" / "sd3_job" / "defaults" / "main.yml").read_text())


def render(nodes: dict[str, tuple[int, str]], **overrides) -> str:
    """nodes: name -> (GPUs the slurm role counted, its gres mode), as the role's probe leaves them."""
    # Ansible renders templates with trim_blocks on; StrictUndefined stops on a variable the template lacks.
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    variables = {key: value for key, value in DEFAULTS.items() if "{{" not in str(value)}
    variables.update(ansible_managed="managed", cluster_name="c", sd3_job_shared_path="/shared",
                     sd3_job_compute_group="gpu_nodes", groups={"gpu_nodes": list(nodes)},
                     hostvars={n: {"__slurm_gpus": g, "__slurm_gres": f" {mode} "} for n, (g, mode) in nodes.items()})
    variables.update(overrides)
    return env.from_string(TEMPLATE.read_text()).render(**variables)


def procs_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("procs_per_node="))


def test_eight_gpu_nodes_ask_for_all_eight_and_start_eight_processes():
    text = render({"gpu01": (8, "nvml"), "gpu02": (8, "nvml")})
    assert "#SBATCH --gpus-per-node=8\n" in text
    assert procs_line(text) == "procs_per_node=${SD3_PROCS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
    assert text.startswith("#!/bin/bash\n# managed\n")


def test_mixed_nodes_ask_for_what_every_node_has():
    text = render({"gpu01": (8, "static"), "gpu02": (4, "static")})
    assert "#SBATCH --gpus-per-node=4\n" in text
    assert procs_line(text).endswith("${SLURM_GPUS_ON_NODE:-4}}")


def test_without_gres_no_gpu_request_but_one_process_per_gpu_from_the_facts():
    text = render({"gpu01": (4, "none"), "gpu02": (4, "nvml")})
    assert "--gpus-per-node" not in text
    assert procs_line(text).endswith("${SLURM_GPUS_ON_NODE:-4}}")


def test_nodes_without_gpus_run_one_process_and_ask_for_none():
    text = render({"n1": (0, "none"), "n2": (0, "none")})
    assert "--gpus-per-node" not in text
    assert procs_line(text).endswith("${SLURM_GPUS_ON_NODE:-1}}")


def test_explicit_numbers_win():
    text = render({"gpu01": (8, "nvml")}, sd3_job_gpus_per_node=2, sd3_job_procs_per_node=2)
    assert "#SBATCH --gpus-per-node=2\n" in text
    assert procs_line(text) == "procs_per_node=${SD3_PROCS_PER_NODE:-2}"
    assert "--gpus-per-node" not in render({"gpu01": (8, "nvml")}, sd3_job_gpus_per_node=0)


@pytest.mark.parametrize("nodes", [{"gpu01": (8, "nvml")}, {"n1": (0, "none")}])
def test_the_rendered_job_is_valid_bash(nodes, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render(nodes))
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_the_default_job_config_is_a_real_one():
    config = DEFAULTS["sd3_job_config"]
    assert config["model"] == {"preset": "sd3-medium", "compile": True}
    assert config["train"]["precision"] == "bf16" and config["data"]["resolution"] == 1024
    local = yaml.safe_load((ROOT / "inventories" / "local" / "group_vars" / "all" / "sd3_job.yml").read_text())
    assert local["sd3_job_config"]["model"]["preset"] == "tiny"


def test_job_configs_are_valid_sd3cluster_configs(tmp_path):
    """The training and generation configs the role installs, default and local, as `sd3cluster` reads them."""
    from sd3cluster.config import load_config

    local = yaml.safe_load((ROOT / "inventories" / "local" / "group_vars" / "all" / "sd3_job.yml").read_text())
    for name, tree in [("default-train", DEFAULTS["sd3_job_config"]),
                       ("default-generate", DEFAULTS["sd3_job_generate_config"]),
                       ("local-train", local["sd3_job_config"]),
                       ("local-generate", local["sd3_job_generate_config"]),
                       ("default-prepare", DEFAULTS["sd3_job_prepare_config"]),
                       ("local-prepare", local["sd3_job_prepare_config"])]:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(tree))
        load_config(path)  # raises ConfigError naming the key when the role's default is wrong
    generate = load_config(tmp_path / "default-generate.yaml").generate
    assert (generate.width, generate.steps, generate.guidance, generate.compile) == (1024, 28, 7.0, True)
    prepare = load_config(tmp_path / "default-prepare.yaml")
    assert (prepare.data.resolution, prepare.prepare.buckets, prepare.prepare.shard_size) == (1024, True, 256)


def test_generate_command_writes_into_the_run_folder_and_requeues():
    text = render({"gpu01": (8, "nvml")})
    assert 'generate) default_config=/opt/sd3cluster/jobs/generate-sd3.yaml; extra=(--out "$outputs") ;;' in text
    assert 'if [ "$command" != verify ] && [ "$attempt" -lt 3 ]; then' in text


def _job_prelude(text: str) -> str:
    """The rendered script up to (without) its first Slurm command: the part that picks config and arguments."""
    return text[:text.index("# The rendezvous runs")]


@pytest.mark.parametrize("command, config, extra", [
    ("", "/opt/sd3cluster/jobs/train-sd3.yaml", ""),
    ("verify", "/opt/sd3cluster/jobs/train-sd3.yaml", "--report /s/runs/sd3-x-7/verify.json"),
    ("generate", "/opt/sd3cluster/jobs/generate-sd3.yaml", "--out /s/runs/sd3-x-7"),
    ("prepare", "/opt/sd3cluster/jobs/prepare-sd3.yaml", "--out /s/runs/sd3-x-7"),
])
def test_each_command_gets_its_config_and_output_folder(command, config, extra, tmp_path):
    """Runs the rendered script's first part with bash, as sbatch would, and reads what it chose."""
    script = tmp_path / "job.sh"
    script.write_text(_job_prelude(render({"gpu01": (8, "nvml")}, sd3_job_shared_path=str(tmp_path / "s")))
                      + 'echo "$config|${extra[*]}|$*"\n')
    env = {"PATH": "/usr/bin:/bin", "SD3_COMMAND": command, "SLURM_JOB_NAME": "sd3-x", "SLURM_JOB_ID": "7"}
    done = subprocess.run(["bash", str(script), "", "--images", "/data"], capture_output=True, text=True, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{config}|{extra.replace('/s/', f'{tmp_path}/s/')}|--images /data"
    assert (tmp_path / "s" / "runs" / "sd3-x-7").is_dir()


def test_an_unknown_command_stops_the_job_with_the_list():
    text = _job_prelude(render({"gpu01": (8, "nvml")}, sd3_job_shared_path="/nonexistent/s"))
    env = {"PATH": "/usr/bin:/bin", "SD3_COMMAND": "prep", "SLURM_JOB_NAME": "j", "SLURM_JOB_ID": "1"}
    done = subprocess.run(["bash", "-c", text, "job"], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 2 and "use train, verify, generate or prepare" in done.stderr


@pytest.mark.parametrize("config_line, wait", [("SlurmdTimeout           = 30 sec", 60), ("", 330)])
def test_a_silent_node_is_waited_for_as_long_as_slurmctld_takes_to_mark_it_down(config_line, wait, tmp_path):
    """The wait comes from slurmctld's own SlurmdTimeout (the scheduler's setting), 300 s where it says none."""
    lines = render({"gpu01": (8, "nvml")}).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("slurmd_timeout="))
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho 'SlurmctldTimeout        = 120 sec'\necho '{config_line}'\n")
    scontrol.chmod(0o755)
    script = "\n".join(line.strip() for line in lines[start:start + 2]) + '\necho "$wait_down"\n'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(wait)
