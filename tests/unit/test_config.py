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
    (["parallel.workers=[4, 2]"], r"parallel.workers: min 4 is above max 2"),
    (["parallel.workers=[1, 2, 3]"], r"parallel.workers: expected N or \[min, max\]"),
    (["model.lora={}", "train.init_from=runs/base"], "train.init_from with model.lora: a run's "
     "checkpoint is not a LoRA model's base"),
])
def test_bad_values_name_the_field(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


@pytest.mark.parametrize("setting, shown", [
    ("parallel.fsdp.reshard_after_forward=false", "parallel.fsdp.reshard_after_forward false"),
    ("parallel.fsdp.param_dtype=bf16", "parallel.fsdp.param_dtype 'bf16'"),
    ("parallel.fsdp.offload=cpu", "parallel.fsdp.offload 'cpu'"),
])
def test_an_fsdp_setting_under_ddp_is_refused_in_one_line(setting: str, shown: str) -> None:
    from trainer.config import check_way_settings

    cfg = load_config(None, ["parallel.strategy=ddp", "memory.precision=bf16", setting])
    with pytest.raises(ConfigError, match=f"{shown} with parallel.strategy 'ddp': ") as refused:
        check_way_settings(cfg)
    assert "\n" not in str(refused.value)
    # auto may resolve to FSDP; fsdp takes it
    for strategy in ("auto", "fsdp"):
        check_way_settings(load_config(None, [f"parallel.strategy={strategy}",
                                               "memory.precision=bf16", setting]))
    # a run's saved config (every field written out) still loads, for an export
    assert Config.model_validate(cfg.model_dump(mode="json")) == cfg


def test_fsdp_defaults_under_ddp_are_taken_as_a_saved_config_writes_them() -> None:
    from trainer.config import check_way_settings

    cfg = load_config(None, ["parallel.strategy=ddp", "parallel.fsdp.offload=none"])
    saved = Config.model_validate(cfg.model_dump(mode="json"))
    assert saved == cfg
    check_way_settings(saved)


def test_impossible_batch_arithmetic_is_refused() -> None:
    cfg = load_config(None, ["train.global_batch_size=30", "train.micro_batch_size=8"])
    with pytest.raises(ConfigError, match="global_batch_size .30. must be a multiple"):
        cfg.train.accumulation_steps(2)
    assert load_config(None, ["train.global_batch_size=32"]).train.accumulation_steps(2) == 2
    cfg = load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match="workers that keep this global batch: 1, 2, 4$"):
        cfg.train.accumulation_steps(3)


def test_a_run_directory_uri_pyarrow_cannot_open_is_one_line_not_a_local_directory(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A URI is a store (``trainer.checkpoint.store``; s3:// on moto: tests/e2e/test_s3.py), never a
    local path: one that pyarrow cannot open is refused before launch, and no directory named
    after its scheme appears (``Path("s3://b")`` would make one)."""
    from tests.conftest import tiny_config
    from trainer.launch.prepare import prepare_run

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^run.dir 'nosuch://bucket/runs': .*") as err:
        prepare_run(tiny_config(corpus_dir, tmp_path, "run.dir=nosuch://bucket/runs"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "nosuch:").exists()


def test_an_elastic_range_is_min_and_max_and_every_size_must_keep_the_batch(
        corpus_dir: Path, tmp_path: Path) -> None:
    from tests.conftest import tiny_config
    from trainer.launch.prepare import prepare_run

    parallel = load_config(None, ["parallel.workers=[1, 4]"]).parallel
    assert (parallel.min_workers, parallel.workers, parallel.worker_range) == (1, 4, (1, 4))
    assert load_config(None, ["parallel.workers=3"]).parallel.worker_range == (3, 3)
    # tiny_config: global batch 16, micro-batch 4; 2 CPUs here, so ranges up to 2 pass the
    # CPU check and the batch arithmetic decides.
    prepare_run(tiny_config(corpus_dir, tmp_path, "parallel.workers=[1, 2]"))
    with pytest.raises(ConfigError, match="an elastic range needs the Ray launcher"):
        prepare_run(tiny_config(corpus_dir, tmp_path, "parallel.workers=[1, 2]",
                                "parallel.launcher=local"))
    with pytest.raises(ConfigError, match=r"\(4 x 2\); workers that keep this global batch: 1, 3"):
        prepare_run(tiny_config(corpus_dir, tmp_path, "parallel.workers=[1, 2]",
                                "train.global_batch_size=12", "train.micro_batch_size=4"))


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
