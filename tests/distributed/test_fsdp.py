"""FSDP2 with real gloo process groups: same losses as DDP, half the parameter bytes per rank,
and sharded checkpoints that resume."""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import logged_losses, tiny_config
from tests.distributed.shards import local_parameter_bytes
from tests.gloo import on_ranks
from trainer.config import ConfigError, load_config
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, to_bf16
from trainer.models.gpt import GPT, GPTConfig
from trainer.optim import build_optimizer
from trainer.parallel.fsdp import FsdpSettings, shard_model
from trainer.plan.peak import plan_row
from trainer.plan.probe import profile_activations
from trainer.plan.static import static_bytes
from trainer.step import create_optimizer_state, step_peak_bytes, train_step
from trainer.telemetry.worker_errors import WorkerError

pytestmark = pytest.mark.distributed


def test_fsdp_and_ddp_losses_agree_and_sharded_checkpoints_reshard_across_world_sizes(
        corpus_dir: Path, tmp_path: Path) -> None:
    """The same path under DDP and FSDP: 2 workers to the step-4 checkpoint, resumed on 1 worker
    to step 6, resumed on 2 to step 8 (the global batch kept by the accumulation steps). FSDP's
    DCP files are resharded 2 -> 1 (one unwrapped worker reads every shard) and 1 -> 2; the
    losses of every step follow DDP's, which a wrongly loaded weight or moment would not."""
    common = ("parallel.launcher=local", "memory.precision=fp32", "train.steps=8",
              "train.log_every=1", "train.eval_every=4", "train.checkpoint_every=2")
    runs = {}
    for strategy in ("ddp", "fsdp"):
        def run(workers: int, until: int | None, strategy: str = strategy) -> tuple[dict, Path]:
            cfg, run_dir = prepare_run(tiny_config(
                corpus_dir, tmp_path, *common, f"parallel.strategy={strategy}",
                f"parallel.workers={workers}", f"run.name={strategy}"))
            return launch_local(cfg, run_dir, until_step=until), run_dir

        first, run_dir = run(2, 4)
        assert first["final_step"] == 4
        one, _ = run(1, 6)
        two, _ = run(2, None)
        assert (one["resumed_from_step"], one["accumulation_steps"]) == (4, 4)
        assert (two["resumed_from_step"], two["final_step"], two["accumulation_steps"]) == (6, 8, 2)
        runs[strategy] = run_dir
    fsdp_dir = runs["fsdp"]
    by_step = {int(p.name.removeprefix("checkpoint-")): sorted(q.name for q in p.iterdir())
               for p in fsdp_dir.glob("checkpoint-*")}
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(by_step[8])  # one file per rank
    assert "__0_0.distcp" in by_step[6] and "__1_0.distcp" not in by_step[6]  # one worker's
    assert logged_losses(fsdp_dir) == pytest.approx(logged_losses(runs["ddp"]), rel=1e-4)


def _count_bytes(rank: int, out: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=32, n_layer=4, n_head=2, n_embd=64))
    full = local_parameter_bytes(model)
    shard_model(model)
    if rank == 0:
        torch.save({"full": full, "sharded": local_parameter_bytes(model)}, out)


def test_parameter_bytes_per_rank_halve_at_world_size_2(tmp_path: Path) -> None:
    out = tmp_path / "bytes.pt"
    on_ranks(_count_bytes, 2, str(out))
    result = torch.load(out, weights_only=True)
    assert result["sharded"] == pytest.approx(result["full"] / 2, rel=0.01)


def test_fsdp_with_fp16_is_refused() -> None:
    with pytest.raises(ConfigError, match="fsdp' with memory.precision 'fp16'"):
        load_config(None, ["parallel.strategy=fsdp", "memory.precision=fp16"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.fsdp.param_dtype=bf16", "memory.precision=fp32"],
     "parallel.fsdp.param_dtype 'bf16' with memory.precision 'fp32'"),
    (["parallel.fsdp.reduce_dtype=bf16", "memory.precision=fp32"],
     "parallel.fsdp.reduce_dtype 'bf16' with memory.precision 'fp32'"),
    (["parallel.fsdp.reshard_after_forward=3", "parallel.workers=4"],
     "parallel.fsdp.reshard_after_forward 3 must divide parallel.workers 4"),
    (["parallel.fsdp.reshard_after_forward=1"], "parallel.fsdp.reshard_after_forward"),
    (["parallel.fsdp.offload=gpu"], "parallel.fsdp.offload"),
])
def test_fsdp_settings_that_cannot_work_are_refused_in_one_line(overrides: list[str],
                                                                message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        load_config(None, ["parallel.strategy=fsdp", *overrides])
    assert "\n" not in str(refused.value)


def test_a_reshard_group_must_divide_the_world_the_run_got() -> None:
    """An elastic run's world size is known only at start: checked there too."""
    cfg = load_config(None, ["parallel.strategy=fsdp", "parallel.workers=[2,4]",
                             "parallel.fsdp.reshard_after_forward=4"])
    assert FsdpSettings.of(cfg, "fp32", 4).reshard_after_forward == 4
    with pytest.raises(ValueError, match=r"reshard_after_forward 4 must divide the world size "
                                         r"\(2 workers\)"):
        FsdpSettings.of(cfg, "fp32", 2)
    assert FsdpSettings.of(cfg, "bf16", 4).param_dtype == "bf16"  # auto follows the precision


def test_cpu_offload_trains_and_resumes_to_the_bit(corpus_dir: Path, tmp_path: Path) -> None:
    """Shards, gradients and AdamW's moments in host memory (CPUOffloadPolicy; on a CPU run
    unpinned, host and device being the same memory): 4 steps straight, and 2 then 2 more
    from the DCP checkpoint, log the same losses; both follow the run without offload."""
    common = ("parallel.launcher=local", "parallel.workers=2", "parallel.strategy=fsdp",
              "memory.precision=fp32", "train.steps=4", "train.log_every=1",
              "train.eval_every=0", "train.checkpoint_every=2")

    def run(name: str, until: int | None, *overrides: str) -> Path:
        cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common, *overrides,
                                               f"run.name={name}"))
        launch_local(cfg, run_dir, until_step=until)
        return run_dir

    straight = run("straight", None, "parallel.fsdp.offload=cpu")
    run("resumed", 2, "parallel.fsdp.offload=cpu")
    resumed = run("resumed", None, "parallel.fsdp.offload=cpu")
    assert len(logged_losses(straight)) == 4
    assert logged_losses(resumed) == logged_losses(straight)
    assert logged_losses(run("on_device", None)) == logged_losses(straight)


def test_ddp_and_fsdp_checkpoints_resume_under_each_other(corpus_dir: Path,
                                                          tmp_path: Path) -> None:
    """One format: DDP to step 2, FSDP from there to step 4, DDP again to step 6, 2 workers
    each (another world size re-splits the epoch's rest: other batches); every loss follows a
    straight DDP run's (to FSDP's arithmetic: 1e-4). A checkpoint of the single-file
    format (the model in ``state.pt``) is refused in one line under either."""
    common = ("parallel.launcher=local", "memory.precision=fp32", "train.steps=6",
              "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=2")

    def run(name: str, strategy: str, workers: int, until: int | None) -> dict:
        cfg, run_dir = prepare_run(tiny_config(
            corpus_dir, tmp_path, *common, f"parallel.strategy={strategy}",
            f"parallel.workers={workers}", f"run.name={name}"))
        return launch_local(cfg, run_dir, until_step=until)

    run("straight", "ddp", 2, None)
    assert run("switch", "ddp", 2, 2)["final_step"] == 2
    assert run("switch", "fsdp", 2, 4)["resumed_from_step"] == 2
    assert run("switch", "ddp", 2, None)["resumed_from_step"] == 4
    switched = logged_losses(tmp_path / "switch")
    assert switched == pytest.approx(logged_losses(tmp_path / "straight"), rel=1e-4)

    # The single-file format: state.pt with the model and optimizer, no DCP files.
    from torch.distributed.checkpoint import FileSystemReader

    from tests.conftest import save_checkpoint
    from trainer.checkpoint.files import load_checkpoint, load_tensors

    checkpoint = tmp_path / "switch" / "checkpoint-00000006"
    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    weights = load_tensors(checkpoint, {
        key.removeprefix("model."): torch.empty(meta.size)  # type: ignore[union-attr]
        for key, meta in saved.items() if key.startswith("model.")})
    legacy = tmp_path / "legacy" / "checkpoint-00000006"
    save_checkpoint(legacy, {**load_checkpoint(checkpoint), "sharded": False, "model": weights,
                             "optimizer": {"state": {}, "param_groups": []}})
    (legacy.parent / "config.yaml").write_bytes((checkpoint.parent / "config.yaml").read_bytes())
    for strategy in ("fsdp", "ddp"):
        with pytest.raises(WorkerError, match=r"holds the model in its state.pt \(the "
                                              r"single-file format\)") as failed:
            run("legacy", strategy, 2, None)
        assert failed.value.exit_code == 2


@pytest.mark.parametrize("param_dtype", ["bf16", "fp32"])
def test_fsdp_in_bf16_follows_ddp_with_autocast(corpus_dir: Path, tmp_path: Path,
                                                param_dtype: str) -> None:
    """20 steps of bf16 under FSDP against DDP with bf16 autocast, the bf16-saving LayerNorm (a
    custom autograd Function that reads the norm weights it saved, all-gathered again for
    backward) on.

    ``param_dtype: fp32`` is autocast over fp32 shards, DDP's arithmetic: 1e-3 (seen 3e-4).
    ``param_dtype: bf16`` (MixedPrecisionPolicy, autocast off) also runs the embeddings, the
    norms and the residual stream in bf16, where autocast keeps them fp32: each of those
    roundings is a relative 2^-9 (0.2%); over 20 steps of AdamW at lr 3e-3 the trajectories
    drift apart slowly. The bound, 2% on every step's loss, is about 10x the largest gap seen
    (0.16%); a loss that diverged (wrong casts, a missing gradient) moves by far more.
    """
    common = ("parallel.launcher=local", "memory.precision=bf16", "train.steps=20",
              "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
              "memory.bf16_norm_inputs=true")  # "auto" leaves them off where memory is ample
    ddp_cfg, ddp_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "run.name=d16"))
    launch_local(ddp_cfg, ddp_dir)
    fsdp_cfg, fsdp_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, *common, "parallel.strategy=fsdp", "run.name=f16",
        f"parallel.fsdp.param_dtype={param_dtype}"))
    launch_local(fsdp_cfg, fsdp_dir)
    fsdp, ddp = logged_losses(fsdp_dir), logged_losses(ddp_dir)
    assert len(fsdp) == len(ddp) == 20
    assert fsdp == pytest.approx(ddp, rel=1e-3 if param_dtype == "fp32" else 0.02)


# Wide blocks and few activations, so FSDP's whole parameters and gradients matter.
_WIDE = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_embd=512)


def _tracked_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
                  tokens: torch.Tensor, policy: Any) -> int:
    """torch's own FSDP2 estimate (``FSDPMemTracker``: every tensor by its role, on the
    device the run uses) of one more step's peak."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_external(model, optimizer)
    with tracker:
        train_step(model, optimizer, scaler, [tokens], 1, policy, 1.0)
    return int(sum(by_type["Total"] for by_type in tracker.get_tracker_snapshot("peak").values()))


_PLANNED = {
    "fp32": ("fp32", FsdpSettings()),
    "bf16 autocast": ("bf16", FsdpSettings()),
    "bf16 parameters": ("bf16", FsdpSettings(param_dtype="bf16")),
    "kept after forward": ("fp32", FsdpSettings(reshard_after_forward=False)),
    "cpu offload": ("fp32", FsdpSettings(offload="cpu")),
    # model.dtype bf16: bf16 shards and gradients, torchao's bf16 moments (stochastic rounding)
    "bf16 weights": ("bf16", FsdpSettings("bf16", "bf16", weight_dtype="bf16")),
}


def _wide(settings: FsdpSettings) -> torch.nn.Module:
    return to_bf16(GPT(_WIDE)) if settings.weight_dtype == "bf16" else GPT(_WIDE)


def _step_peak(rank: int, case: str, out: str) -> None:
    torch.manual_seed(0)
    precision, settings = _PLANNED[case]
    model = shard_model(_wide(settings), settings)
    optimizer = build_optimizer(model, 1e-4, weight_decay=0.01, betas=(0.9, 0.999),
                                states="bf16") if settings.weight_dtype == "bf16" \
        else torch.optim.AdamW(model.parameters(), lr=1e-4)
    policy = settings.step_policy(precision_policy(precision, torch.device("cpu"),
                                                   warn=False))  # as the loop runs it
    scaler = policy.grad_scaler(torch.device("cpu"))
    tokens = torch.randint(0, _WIDE.vocab_size, (2, _WIDE.seq_len + 1))
    create_optimizer_state(optimizer)  # the first measured step also runs FSDP's lazy init
    peak = min(step_peak_bytes(model, optimizer, scaler, tokens, policy) for _ in range(3))
    # torch's tracker is a dispatch mode, under which torchao's compiled step cannot run
    tracked = None if settings.weight_dtype == "bf16" else \
        _tracked_peak(model, optimizer, scaler, tokens, policy)
    if rank == 0:
        torch.save({"peak": peak, "tracked": tracked}, out)


@pytest.mark.parametrize("case", list(_PLANNED))
def test_planner_predicts_an_fsdp_rank_peak(tmp_path: Path, case: str) -> None:
    """Rank 0's step peak under FSDP at world size 2 against the planner's prediction, for each
    kind of ``parallel.fsdp`` setting.

    Counting only the shards predicted 15-30% too little here (the root's whole parameters and
    the blocks in flight were missing). On CPU, gloo's collectives run on their own threads, so
    how many buffers overlap varies from step to step (fp32 142-154 MiB, bf16 153-175 MiB in
    six runs): the least of three steps is compared. torch's ``FSDPMemTracker`` on the same
    step is the second reference. Seen (MiB: allocator, tracker, planner): fp32 142, 140, 146;
    bf16 autocast 153, 147, 156; bf16 parameters 126, 126, 128; kept after forward 158, 158,
    164; CPU offload 142, 140, and 78 on the device with 122 on the host. Under CPU offload host
    and device are the same memory here: the allocator's peak is the device's and the host's
    together, at most their sum (they peak at different moments) and at least the larger.
    """
    out = tmp_path / "peak.pt"
    on_ranks(_step_peak, 2, case, str(out))
    result = torch.load(out, weights_only=True)
    measured = result["peak"]
    precision, settings = _PLANNED[case]
    profile = profile_activations(partial(_wide, settings),
                                  MemoryTransforms(bf16_norm_inputs=False), _WIDE.seq_len,
                                  _WIDE.vocab_size, precision)
    states = "bf16" if settings.weight_dtype == "bf16" else "fp32"
    static = static_bytes(_wide(settings), "fsdp", 2, settings, states=states)
    row = plan_row(static, profile, 2, 1)
    if settings.offload == "cpu":
        assert row.host_bytes > row.predicted_peak_bytes  # the shards moved to the host
        for peak in (measured, result["tracked"]):
            assert max(row.predicted_peak_bytes, row.host_bytes) <= peak * 1.12, row
            assert peak <= (row.predicted_peak_bytes + row.host_bytes) * 1.12, row
    else:
        assert row.predicted_peak_bytes == pytest.approx(measured, rel=0.12), row
        # docs/memory.md explains the gap to torch's tracker (under 5% but for bf16 autocast).
        # The tracker sees tensors between operators, not an emulated bf16 matrix product's
        # conversion buffers inside one (the planner's emulation workspace, 0 where bf16 is
        # native): the prediction without them is the one it can be held to.
        if result["tracked"] is None:
            return
        seen = plan_row(static, dataclasses.replace(
            profile, emulation_workspace_per_sample_bytes=0), 2, 1)
        assert seen.predicted_peak_bytes == pytest.approx(result["tracked"], rel=0.07), seen
