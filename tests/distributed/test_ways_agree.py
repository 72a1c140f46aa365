"""One config is one run whatever the way of splitting: a LoRA model's adapters start from the
same values at one process, under DDP and under FSDP at 2 and 4 ranks (memtrain's GPT and an
``hf:`` model read from its own weights), and the loss a run logs is the global batch's, so
1 and 2 workers, DDP and FSDP, log the same losses step by step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import logged_losses, tiny_config
from tests.gloo import on_ranks
from trainer.config import load_config
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("hf")]

LLAMA = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _pretrained_llama(directory: Path) -> Path:
    """A tiny Llama with weights of its own (read with ``from_pretrained`` by one process and
    DDP, by rows under FSDP): its seeded build is not these weights."""
    import transformers

    torch.manual_seed(1234)
    transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**LLAMA)).save_pretrained(directory)
    return directory


def _config(model: str, strategy: str) -> object:
    return load_config(None, [f"model.name={model}", "model.lora.rank=4", "model.seq_len=32",
                              "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
                              "model.vocab_size=300", f"parallel.strategy={strategy}",
                              "memory.precision=fp32", "run.seed=7"])


def _adapters(models: list[str], strategies: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Each (model, strategy)'s adapters as its way builds them on this process's world, whole
    (every rank's shards gathered)."""
    from trainer.memory.lora import is_adapter
    from trainer.parallel.choice import parallelism_for

    world = dist.get_world_size() if dist.is_initialized() else 1
    out = {}
    for model in models:
        for strategy in strategies:
            cfg = _config(model, strategy)
            built = parallelism_for(cfg, world, "fp32").build(cfg, torch.device("cpu"),
                                                             lambda m: None)
            out[f"{model} {strategy}"] = {
                name.replace("_checkpoint_wrapped_module.", ""):
                    t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()
                for name, t in built.named_parameters() if is_adapter(name)}
    return out


def _build_on_ranks(rank: int, models: list[str], out: str) -> None:
    strategies = ["ddp", "fsdp"] if dist.get_world_size() == 2 else ["fsdp"]
    adapters = _adapters(models, strategies)
    if rank == 0:
        torch.save(adapters, out)


def test_lora_adapters_start_the_same_at_1_2_and_4_ranks_under_ddp_and_fsdp(
        tmp_path: Path) -> None:
    models = ["gpt", f"hf:{_pretrained_llama(tmp_path / 'llama')}"]
    one = _adapters(models, ["ddp"])
    builds = {}
    for world_size in (2, 4):
        out = tmp_path / f"adapters-{world_size}.pt"
        on_ranks(_build_on_ranks, world_size, models, str(out))
        builds |= {f"{key} x{world_size}": value
                   for key, value in torch.load(out, weights_only=True).items()}
    assert len(builds) == 6
    for model in models:
        reference = one[f"{model} ddp"]
        lora_a = [name for name in reference if ".lora_A." in name]
        assert lora_a and all(reference[name].abs().max() > 0 for name in lora_a)
        for key, adapters in builds.items():
            if key.startswith(f"{model} "):
                assert adapters.keys() == reference.keys(), key
                for name, value in adapters.items():
                    assert torch.equal(value, reference[name]), (key, name)


def test_one_lora_config_logs_the_same_losses_at_1_and_2_workers_under_ddp_and_fsdp(
        tmp_path: Path) -> None:
    """The loss logged and summarised is the global batch's mean over its trained targets:
    one worker accumulating and two workers (DDP, FSDP) agree to 1e-5 of each step's, on an
    ``hf:`` model's own weights with LoRA (fp32). The dataset is one global batch, so every
    step trains the same rows at any world size (which rank reads which rows differs). Rank
    1's log holds the same loss."""
    from datapipe.corpus import build_stdlib_corpus

    corpus_dir = tmp_path / "corpus"
    manifests = build_stdlib_corpus(corpus_dir, seq_len=64, max_bytes=16 * 65)
    assert manifests["train"].num_rows == 16  # train.global_batch_size: one step an epoch
    base = _pretrained_llama(tmp_path / "llama")
    common = (f"model.name=hf:{base}", "model.lora.rank=4", "parallel.launcher=local",
              "memory.precision=fp32", "train.steps=4", "train.log_every=1",
              "train.eval_every=0", "train.checkpoint_every=0", "train.lr=0.02",
              "memory.activation_checkpointing=none", "data.shuffle=false")
    runs = {}
    for name, workers, strategy in (("one", 1, "ddp"), ("ddp", 2, "ddp"), ("fsdp", 2, "fsdp")):
        cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common,
                                               f"parallel.workers={workers}",
                                               f"parallel.strategy={strategy}",
                                               f"run.name={name}"))
        launch_local(cfg, run_dir)
        runs[name] = logged_losses(run_dir)
    assert len(runs["one"]) == 4 and runs["one"][0] != runs["one"][-1]
    assert runs["ddp"] == pytest.approx(runs["one"], rel=1e-5)
    assert runs["fsdp"] == pytest.approx(runs["one"], rel=1e-5)
    rank_1 = [r["loss"] for r in map(json.loads, (tmp_path / "ddp" / "metrics" / "rank-1.jsonl")
                                     .read_text().splitlines()) if "loss" in r]
    assert rank_1 == runs["ddp"]
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["final_loss"] == runs["ddp"][-1]
