"""FSDP's meta-device build on real gloo process groups: no rank holds the whole model while it
is built, each rank's shards hold the seeded host build's weights bit for bit (the weights DDP
starts from), and an ``hf:`` directory's safetensors load per rank."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from monitoring.memory import PeakResident
from tests.distributed.shards import local_parameter_bytes
from tests.gloo import on_ranks
from trainer.memory.precision import precision_policy
from trainer.models.build import Bf16Weights, MemoryTransforms, build_model
from trainer.models.gpt import GPT, GPTConfig
from trainer.parallel.fsdp import FsdpSettings, build_sharded, shard_model
from trainer.plan.peak import plan_row
from trainer.plan.probe import profile_activations
from trainer.plan.static import static_bytes
from trainer.step import create_optimizer_state, step_peak_bytes

pytestmark = pytest.mark.distributed

# 29.4M parameters, 118 MB in fp32: at 4 ranks a shard is a quarter of it, at 8 an eighth.
_BIG = GPTConfig(vocab_size=8192, seq_len=64, n_layer=8, n_head=8, n_embd=512)
_TINY = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole of every tensor, by the names the unwrapped model gives them."""
    return {name.replace("_checkpoint_wrapped_module.", ""):
            t.full_tensor() if hasattr(t, "full_tensor") else t
            for name, t in model.state_dict().items()}


def _build(rank: int, path: str, out: str) -> None:
    """Build ``_BIG`` sharded on ``path`` ("meta": today's; "host": whole, then sharded), with
    the resident memory it took on this rank; "meta" then trains a step and compares weights."""
    factory, transforms = partial(GPT, _BIG), MemoryTransforms(activation_checkpointing="full")
    # The baseline is a process that has built and sharded a model once: the code pages
    # of the first build (FSDP, DTensor, the dispatch mode) are not the model's bytes.
    build_sharded(partial(GPT, _TINY), transforms, torch.device("cpu"), 5, FsdpSettings())
    with PeakResident().watch() as build:
        if path == "meta":
            model = build_sharded(factory, transforms, torch.device("cpu"), 5,
                                  FsdpSettings(), model_name="gpt")
        else:
            model = shard_model(build_model(factory, transforms, torch.device("cpu"), 5))
    result = {"peak": build.peak, "shard": local_parameter_bytes(model)}
    if path == "meta":
        del model
        with PeakResident().watch() as build_bf16:  # model.dtype bf16: its fp32 values
            lean = build_sharded(Bf16Weights(partial(GPT, _BIG)), transforms,  # as made
                                 torch.device("cpu"), 5,
                                 FsdpSettings("bf16", weight_dtype="bf16"), model_name="gpt")
        result["peak_bf16"] = build_bf16.peak
        del lean
        model = build_sharded(factory, transforms, torch.device("cpu"), 5, FsdpSettings(),
                              model_name="gpt")
        host = _full_weights(build_model(factory, MemoryTransforms(), seed=5))
        result["same"] = all(torch.equal(t, host[name])
                             for name, t in _full_weights(model).items())
        del host  # (the gathered copies went with the comparison)
        result["steps"] = _step_peaks(model)
        # model.dtype bf16: the meta build's shards are the host build's weights, rounded
        bf16 = _full_weights(build_sharded(Bf16Weights(partial(GPT, _TINY)), transforms,
                                           torch.device("cpu"), 5,
                                           FsdpSettings("bf16", weight_dtype="bf16"),
                                           model_name="gpt"))
        rounded = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in
                   _full_weights(build_model(partial(GPT, _TINY), transforms,
                                             seed=5)).items()}
        result["same_bf16"] = bf16.keys() == rounded.keys() and all(
            t.dtype == torch.bfloat16 and torch.equal(t, rounded[k]) for k, t in bf16.items()
            if t.is_floating_point())
    torch.save(result, f"{out}.{rank}")


def _step_peaks(model: torch.nn.Module) -> list[int]:
    """The CPU allocator's record of two training steps (AdamW's state created first, as the
    planner counts it), shards and state included."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = precision_policy("fp32", torch.device("cpu"))
    scaler = policy.grad_scaler(torch.device("cpu"))
    tokens = torch.randint(0, _BIG.vocab_size, (1, _BIG.seq_len + 1))
    create_optimizer_state(optimizer)
    return [step_peak_bytes(model, optimizer, scaler, tokens, policy) for _ in range(2)]


def _planned_peak(world_size: int) -> int:
    transforms = MemoryTransforms(activation_checkpointing="full")
    profile = profile_activations(partial(GPT, _BIG), transforms, _BIG.seq_len, _BIG.vocab_size,
                                  "fp32")
    with torch.device("meta"):
        shape = GPT(_BIG)
    return plan_row(static_bytes(shape, "fsdp", world_size), profile, 1, 1).predicted_peak_bytes


def _results(tmp_path: Path, world_size: int, path: str) -> list[dict]:
    out = tmp_path / path
    on_ranks(_build, world_size, path, str(out))
    return [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(world_size)]


_FULL_BYTES = sum(p.numel() * 4 for p in GPT(_BIG).parameters())
# A rank's resident peak through the meta build, as a share of the whole model's fp32 bytes: at
# 4 ranks its shard (0.25) and the tensor being made and sharded (the 16 MiB embedding at most,
# 0.14), with the allocator's slack. Seen: 0.37-0.44 (41-49 MiB of 112) with the machine to
# itself, 0.51 beside the rest of the suite on 2 cores; the host build holds 1.08 (121 MiB).
WHOLE_BOUND = 0.6


@pytest.mark.parametrize("world_size", [4, 8])
def test_no_rank_holds_the_whole_model_while_it_is_built(tmp_path: Path, world_size: int) -> None:
    """Each rank's resident memory through build and load stays below ``WHOLE_BOUND`` of the
    model's full fp32 bytes (its shard is a quarter or an eighth of them), with fp32 weights
    and with bf16 ones (``model.dtype``: made in fp32, one tensor at a time, and rounded into
    the shards);
    the shards are the host build's weights bit for bit (bf16 ones: rounded); and two steps
    train, each rank's peak (the CPU allocator's record) within a sharded rank's means: at
    least the planner's prediction for it less 10%, and under three quarters of what a whole
    replica's weights, gradients and AdamW moments take.

    How far above the prediction a step goes depends on how many of gloo's collectives
    overlap on their own threads, which the machine's load decides (5-15% with the machine to
    itself, up to 28% beside the rest of the suite on 2 cores): the planner's accuracy is
    held in ``tests/distributed/test_fsdp.py`` on 2 ranks and measured by ``make bench-fsdp``."""
    planned = _planned_peak(world_size)
    for rank, result in enumerate(_results(tmp_path, world_size, "meta")):
        assert _FULL_BYTES >= 4 * result["shard"]
        assert result["peak"] < WHOLE_BOUND * _FULL_BYTES, (rank, result)
        assert result["same"], rank
        assert result["same_bf16"], rank
        assert result["peak_bf16"] < WHOLE_BOUND * _FULL_BYTES, (rank, result)
        for peak in result["steps"]:
            assert planned * 0.9 <= peak < 3 * _FULL_BYTES, (rank, result["steps"], planned)


def test_the_host_build_holds_the_whole_model_on_every_rank(tmp_path: Path) -> None:
    """The measure above fails on the build sharding had before the meta device."""
    for rank, result in enumerate(_results(tmp_path, 4, "host")):
        assert result["peak"] > WHOLE_BOUND * _FULL_BYTES, (rank, result)


def _full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                ) -> dict[str, torch.Tensor]:
    """Every weight and AdamW moment, whole (a collective)."""
    state = {f"w.{k}": v for k, v in _full_weights(model).items()}
    for i, p in enumerate(model.parameters()):
        for moment in ("exp_avg", "exp_avg_sq"):
            state[f"{moment}.{i}"] = optimizer.state[p][moment].full_tensor()
    return state


def _phase(rank: int, load: str, save: str, out: str) -> None:
    """Build on meta, load ``load`` (a DCP checkpoint; "": none), train a step on data of its
    own (every world size draws the same global batch), save to ``save``; rank 0 records the
    whole state it loaded and the one it saved."""
    from trainer.checkpoint.files import load_states, model_and_optimizer_states, write_states

    model = build_sharded(partial(GPT, _TINY), MemoryTransforms(), torch.device("cpu"), 1,
                          FsdpSettings(), model_name="gpt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loaded = None
    if load:
        for p in model.parameters():  # AdamW's state exists before DCP loads into it
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        load_states(Path(load), model, optimizer)
        loaded = _full_state(model, optimizer)
    batch = torch.randint(0, _TINY.vocab_size, (4, _TINY.seq_len + 1),
                          generator=torch.Generator().manual_seed(len(load)))
    rows = batch.chunk(dist.get_world_size())[rank]
    (model(rows[:, :-1], rows[:, 1:]) / batch[:, 1:].numel()).backward()
    optimizer.step()
    write_states(Path(save), None, model_and_optimizer_states(model, optimizer))
    saved = _full_state(model, optimizer)
    if rank == 0:
        torch.save({"loaded": loaded, "saved": saved}, out)


def test_a_sharded_run_resumes_on_4_then_2_then_4_ranks(tmp_path: Path) -> None:
    """The DCP checkpoint of 4 ranks loads on 2 and theirs on 4 again: every weight and moment
    as it was saved, bit for bit."""
    previous = ""
    for step, world_size in enumerate((4, 2, 4)):
        save, out = str(tmp_path / f"checkpoint-{step}"), str(tmp_path / f"state-{step}.pt")
        on_ranks(_phase, world_size, previous, save, out)
        state = torch.load(out, weights_only=True)
        if previous:
            saved = tmp_path / f"state-{step - 1}.pt"
            before = torch.load(saved, weights_only=True)
            assert state["loaded"].keys() == before["saved"].keys()
            for name, tensor in before["saved"].items():
                assert torch.equal(state["loaded"][name], tensor), (world_size, name)
        previous = save
