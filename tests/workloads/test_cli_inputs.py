"""Bad input to the `sd3cluster` CLI stops before anything is written or trained, with one line on stderr that
names the setting or file, exit status 2 and no traceback; `--debug` / SD3CLUSTER_DEBUG=1 give the traceback.

Most cases run `cli.main` in this process (fast on 2 cores); the ones whose point is what a real process prints
(torch's own logging, the whole stderr) run the command as a subprocess."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from sd3_helpers import TINY, sd3cluster
from sd3cluster import cli
from sd3cluster.checkpoint import MARKER

SYNTHETIC = ["--set", "data.synthetic_samples=4", "--set", "output.progress=false",
             "--set", "output.tensorboard=false"]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under root with its size and modification time: what a run may not change."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def fails_cleanly(capsys, args: list[str], *named: str) -> str:
    """Run the CLI in this process; it must exit 2 with one error line naming every string of `named`."""
    status = cli.main(args)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"sd3cluster {args[0]}: error: "), err
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch) -> Path:
    """Runs happen in tmp_path, so any file a run writes by default (runs/sd3, reports) would be seen there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SD3CLUSTER_DEBUG", raising=False)
    (tmp_path / "a_file").write_text("not a folder\n")
    return tmp_path


@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory) -> Path:
    """A tiny run of 1 step with a checkpoint (model.fuse_qkv on, the default)."""
    root = tmp_path_factory.mktemp("run")
    status = cli.main(["train", "--device", "cpu", "--steps", "1", *TINY, *SYNTHETIC,
                       "--checkpoint-dir", str(root / "ck"), "--output-dir", str(root / "out")])
    assert status == 0 and (root / "ck" / "step-00000001" / MARKER).is_file()
    return root


# -- what used to end in a traceback --------------------------------------------------------------------------
def test_device_cuda_without_cuda_names_the_flag_and_the_choices(capsys, workdir, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = snapshot(workdir)
    for command in ("train", "verify", "generate", "serve"):
        line = fails_cleanly(capsys, [command, "--device", "cuda", *TINY, *SYNTHETIC, "--output-dir", "out"]
                             if command == "train" else [command, "--device", "cuda"],
                             "--device cuda", "auto, cpu, cuda")
        assert f"{'train' if command == 'verify' else command}.device" in line
    fails_cleanly(capsys, ["prepare", "--synthetic", "4", "--out", "shards", "--set", "prepare.device=cuda"],
                  "prepare.device=cuda")
    assert snapshot(workdir) == before


@pytest.mark.parametrize(("variants", "named"), [
    ("fastest", ["bench.variants", "'fastest'", "reference, optimized"]),
    ("reference,optimized:attn=fast", ["bench.variants", "attn='fast'", "cudnn"]),
    ("optimized:batch=many", ["bench.variants", "batch='many'", "whole number"]),
    ("optimized:fp9=1", ["bench.variants", "unknown option 'fp9'", "fp8"]),
])
def test_bench_variant_errors_are_one_line_before_any_variant_runs(capsys, workdir, variants, named):
    before = snapshot(workdir)
    # A known variant first: it must not run before the bad one is found (no report, no results line).
    fails_cleanly(capsys, ["bench", "--variants", variants, "--report", "bench.json", *TINY], *named)
    assert snapshot(workdir) == before


def test_damaged_shard_is_named_before_the_run_writes_metrics(capsys, workdir):
    assert cli.main(["prepare", "--synthetic", "8", "--out", "shards", *TINY]) == 0
    shard = workdir / "shards" / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])  # cut short, as by a full disk or an interrupted copy
    capsys.readouterr()
    before = snapshot(workdir)
    fails_cleanly(capsys, ["train", "--device", "cpu", "--data", "shards", "--steps", "1", *TINY,
                           "--output-dir", "out", "--set", "output.tensorboard=false"],
                  str(Path("shards") / "shard-00000.safetensors"), "is damaged", "sd3cluster prepare")
    assert snapshot(workdir) == before and not (workdir / "out").exists()


@pytest.mark.parametrize(("flag", "path", "named"), [
    ("--output-dir", "a_file", ["output.dir (--output-dir) a_file is a file"]),
    ("--checkpoint-dir", "a_file", ["checkpoint.dir (--checkpoint-dir) a_file is a file"]),
    ("--checkpoint-dir", "a_file/ck", ["checkpoint.dir (--checkpoint-dir) a_file/ck", "a_file is a file"]),
])
def test_output_or_checkpoint_path_that_is_a_file_stops_before_the_first_step(capsys, workdir, flag, path, named):
    other = "--checkpoint-dir" if flag == "--output-dir" else "--output-dir"
    before = snapshot(workdir)
    fails_cleanly(capsys, ["train", "--device", "cpu", "--steps", "1", *TINY, *SYNTHETIC, flag, path, other,
                           "elsewhere"], *named)
    assert snapshot(workdir) == before and not (workdir / "elsewhere").exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write into any folder")
def test_output_folder_that_is_not_writable(capsys, workdir):
    locked = workdir / "locked"
    locked.mkdir(mode=0o500)
    fails_cleanly(capsys, ["train", "--device", "cpu", *TINY, *SYNTHETIC, "--output-dir", "locked/out"],
                  "output.dir (--output-dir) locked/out", "not writable")


def test_damaged_checkpoint_metadata_is_named_without_torch_tracebacks(tmp_path, checkpoint_run):
    """A real process: DCP logs its read failures with tracebacks on the root logger before raising."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(checkpoint_run / "ck", ck)
    (ck / "step-00000001" / ".metadata").write_bytes(b"garbage")
    result = sd3cluster("train", "--device", "cpu", "--steps", "2", *TINY, *SYNTHETIC, "--checkpoint-dir", str(ck),
                        "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "metadata is not found" not in result.stderr
    assert f"{ck / 'step-00000001' / '.metadata'} is damaged" in result.stderr
    assert not (tmp_path / "out").exists() and not (ck / "step-00000002").exists()


# -- what used to mislead -------------------------------------------------------------------------------------
def test_data_path_that_is_a_file_is_not_called_missing(capsys, workdir):
    line = fails_cleanly(capsys, ["train", "--device", "cpu", "--data", "a_file", *TINY, "--output-dir", "out"],
                         "data.path (--data) a_file is a file, not a folder")
    assert "does not exist" not in line and not (workdir / "out").exists()


def test_config_that_is_a_folder_is_not_called_missing(capsys, workdir):
    (workdir / "configs").mkdir()
    line = fails_cleanly(capsys, ["train", "--config", "configs"], "config file configs is a folder")
    assert "does not exist" not in line


def test_report_path_that_is_a_folder(capsys, workdir):
    (workdir / "reports").mkdir()
    before = snapshot(workdir)
    fails_cleanly(capsys, ["verify", "--device", "cpu", "--report", "reports"], "verify.report (--report) reports",
                  "is a folder")
    assert snapshot(workdir) == before


def test_resume_from_a_file_or_an_incomplete_folder_names_what_is_wrong(capsys, workdir, checkpoint_run):
    fails_cleanly(capsys, ["train", "--device", "cpu", *TINY, *SYNTHETIC, "--output-dir", "out",
                           "--set", "checkpoint.dir=ck", "--set", "checkpoint.resume=a_file"],
                  "checkpoint.resume a_file is a file, not a folder")
    # One of the three parts missing: the message names that one, not a list of what might be wrong.
    import shutil

    shutil.copytree(checkpoint_run / "ck", workdir / "ck")
    (workdir / "ck" / "step-00000001" / "trainer.json").unlink()
    line = fails_cleanly(capsys, ["train", "--device", "cpu", "--steps", "2", *TINY, *SYNTHETIC, "--output-dir",
                                  "out", "--set", "checkpoint.dir=ck",
                                  "--set", "checkpoint.resume=ck/step-00000001"],
                         "ck/step-00000001 is incomplete: it has no trainer.json")
    assert MARKER not in line.split("it has no", 1)[1] and ".metadata" not in line.split("it has no", 1)[1]


def test_checkpoint_of_other_model_settings_names_the_differing_keys(capsys, tmp_path, checkpoint_run):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(checkpoint_run / "ck", ck)
    before = snapshot(ck)
    line = fails_cleanly(capsys, ["train", "--device", "cpu", "--steps", "2", *TINY, *SYNTHETIC,
                                  "--set", "model.fuse_qkv=false", "--checkpoint-dir", str(ck),
                                  "--output-dir", str(tmp_path / "out")],
                         "other model settings", "model.fuse_qkv: checkpoint True, config False")
    assert "cannot be read" not in line and "move" not in line  # the checkpoint is fine: no advice to discard it
    assert snapshot(ck) == before and not (tmp_path / "out").exists()


def test_no_cuda_names_the_one_cause_of_three(capsys, workdir, monkeypatch):
    """A CPU-only build, CUDA_VISIBLE_DEVICES hiding the GPUs, or no GPU/driver: each is told apart."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["generate", "--device", "cuda", "--prompts", "p.txt", "--out", "out"]
    monkeypatch.setattr(torch.version, "cuda", None)
    fails_cleanly(capsys, args, "--device cuda (generate.device)", "CPU-only build")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    line = fails_cleanly(capsys, args, "CUDA_VISIBLE_DEVICES='' hides every GPU")
    assert "CPU-only" not in line
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    line = fails_cleanly(capsys, args, "no usable GPU or NVIDIA driver")
    assert "CPU-only" not in line and "CUDA_VISIBLE_DEVICES" not in line
    assert not (workdir / "out").exists()


def test_export_of_an_incomplete_step_names_the_missing_part(capsys, workdir, checkpoint_run):
    import shutil

    shutil.copytree(checkpoint_run / "ck", workdir / "ck")
    (workdir / "ck" / "step-00000001" / MARKER).unlink()
    line = fails_cleanly(capsys, ["export", "--checkpoint", "ck/step-00000001", "--out", "model"],
                         f"it has no {MARKER} (its save was cut off)")
    assert "trainer.json" not in line and not (workdir / "model").exists()


# -- the handler ----------------------------------------------------------------------------------------------
USER_ERRORS = [
    ["train", "--device", "cpu", "--data", "/nonexistent/shards", "--output-dir", "OUT"],
    ["bench", "--variants", "fastest"],
    ["prepare", "--images", "FILE", "--encoders", "FILE", "--out", "OUT"],
    ["export", "--checkpoint", "FILE", "--out", "OUT"],
    ["generate", "--prompts", "FILE", "--out", "FILE", "--device", "cpu"],
    ["train", "--set", "train.steps=zero"],
]


def test_no_user_error_path_prints_a_traceback(tmp_path):
    """Real processes, one user error of each command: exit 2, one line, no traceback, nothing written."""
    (tmp_path / "file").write_text("x\n")
    before = snapshot(tmp_path)
    for template in USER_ERRORS:
        args = [a.replace("FILE", str(tmp_path / "file")).replace("OUT", str(tmp_path / "out")) for a in template]
        result = sd3cluster(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout, args
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith(f"sd3cluster {args[0]}: error: "), result.stderr
    assert snapshot(tmp_path) == before


def test_debug_flag_and_variable_show_the_traceback(capsys, workdir, monkeypatch):
    from sd3cluster.errors import UserError

    with pytest.raises(UserError, match=r"bench\.variants"):
        cli.main(["bench", "--variants", "fastest", "--debug"])
    monkeypatch.setenv("SD3CLUSTER_DEBUG", "1")
    with pytest.raises(UserError, match=r"data\.path"):
        cli.main(["train", "--data", "a_file"])
    monkeypatch.setenv("SD3CLUSTER_DEBUG", "0")
    fails_cleanly(capsys, ["train", "--data", "a_file"], "data.path")


def test_os_errors_naming_a_file_become_one_line_and_others_stay_bugs():
    message = cli.user_error_message(PermissionError(13, "Permission denied", "/shared/run/metrics.jsonl"))
    assert message is not None and message.startswith("/shared/run/metrics.jsonl: Permission denied")
    assert cli.user_error_message(OSError("no file involved")) is None
    assert cli.user_error_message(ValueError("a bug")) is None


def test_a_good_run_still_writes_its_outputs(capsys, workdir):
    """The checks do not stop good input: the same kind of run that the cases above refuse, with good paths."""
    status = cli.main(["train", "--device", "cpu", "--steps", "1", *TINY, *SYNTHETIC, "--output-dir", "out"])
    assert status == 0
    record = json.loads((workdir / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1
