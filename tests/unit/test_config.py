from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import Config, ConfigError, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_configs_are_shipped() -> None:
    assert {p.name for p in CONFIGS} >= {"demo-cpu.yaml", "gpt2-124m-8xgpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_its_batch_arithmetic_holds(path: Path) -> None:
    cfg = load_config(path)
    accumulation = cfg.train.accumulation_steps(cfg.parallel.workers)
    assert accumulation * cfg.train.micro_batch_size * cfg.parallel.workers \
        == cfg.train.global_batch_size


def test_overrides_are_parsed_as_yaml_and_typed() -> None:
    cfg = load_config(None, ["train.lr=3e-4", "memory.precision=fp16", "data.shuffle=false"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.memory.precision == "fp16"
    assert cfg.data.shuffle is False


def test_each_component_gets_only_its_slice() -> None:
    cfg = Config()
    assert set(type(cfg).model_fields) == {"run", "model", "data", "train", "memory", "parallel",
                                           "monitoring"}


@pytest.mark.parametrize("overrides, expected", [
    (["train.lrr=1"], "unknown key 'train.lrr'"),
    (["train.lr=-1"], "train.lr: Input should be greater than 0"),
    (["memory.precision=fp8"], "memory.precision"),
    (["train.micro_batch_size=0"], "train.micro_batch_size"),
    (["model.n_embd=100", "model.n_head=3"], "divisible by n_head"),
    (["trainlr"], "expected KEY=VALUE"),
])
def test_bad_values_name_the_field(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


def test_impossible_batch_arithmetic_is_refused() -> None:
    cfg = load_config(None, ["train.global_batch_size=30", "train.micro_batch_size=8"])
    with pytest.raises(ConfigError, match="global_batch_size .30. must be a multiple"):
        cfg.train.accumulation_steps(2)
    assert load_config(None, ["train.global_batch_size=32"]).train.accumulation_steps(2) == 2


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML at line"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(scalar)
