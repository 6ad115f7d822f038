from pathlib import Path

import pytest
from sd3_helpers import sd3cluster
from sd3cluster.config import Config, ConfigError, load_config


def test_defaults_validate_and_print():
    cfg = load_config()
    assert cfg.model.preset == "tiny"
    assert "preset: tiny" in cfg.pretty()


def test_yaml_then_overrides(tmp_path: Path):
    f = tmp_path / "run.yaml"
    f.write_text("model: {preset: sd3-medium}\ntrain: {steps: 7, parallel: fsdp}\noptim: {betas: [0.9, 0.95]}\n")
    cfg = load_config(f, ["train.steps=9", "checkpoint.dir=/tmp/ck"])
    assert (cfg.model.preset, cfg.train.steps, cfg.train.parallel) == ("sd3-medium", 9, "fsdp")
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.checkpoint.dir == Path("/tmp/ck")
    assert Config.model_validate_json(cfg.model_dump_json()) == cfg


@pytest.mark.parametrize(("override", "key"), [
    ("train.steps=0", "train.steps"),
    ("model.preset=sd4", "model.preset"),
    ("data.resolution=100", "data"),
    ("optim.lr=fast", "optim.lr"),
    ("train.stepz=3", "train.stepz"),
])
def test_wrong_value_names_the_key(override: str, key: str):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in str(err.value)


def test_bad_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(None, ["train.steps"])


def test_cli_bad_config_is_one_clear_message():
    result = sd3cluster("train", "--steps", "-3", "--set", "checkpoint.keep=0")
    assert result.returncode == 2
    assert "train.steps" in result.stderr and "checkpoint.keep" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_print_config_shows_overrides():
    result = sd3cluster("bench", "--preset", "sd3-medium", "--variants", "reference,optimized", "--print-config")
    assert result.returncode == 0, result.stderr
    assert "preset: sd3-medium" in result.stdout and "- optimized" in result.stdout
