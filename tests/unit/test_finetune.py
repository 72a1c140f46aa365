"""Fine-tuning end to end, as a user does it: a pretrained Hugging Face Llama (safetensors) with a
tokenizer that has a chat template; a chat JSONL of a few hundred rows; ``memtrain data write
--format chat``; ``memtrain train`` with packing and assistant-only loss masks (two ranks); a
resume with a changed learning rate; ``memtrain export --hf``; ``from_pretrained`` of the export
gives the trained model's logits and prompts as the data was rendered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, arithmetic_chats, set_args, write_chat_tokenizer

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group("hf")]


def memtrain(*args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "trainer.cli", *args], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out


def pretrained_llama(directory: Path) -> Path:
    """A tiny Llama with random weights saved as safetensors beside its chat tokenizer: the
    starting point a user brings (from the hub, here made offline)."""
    import transformers

    texts = [m["content"] for row in arithmetic_chats(200) for m in row["messages"]]
    write_chat_tokenizer(directory, texts, vocab_size=400)
    config = transformers.LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    assert (directory / "model.safetensors").is_file()
    return directory


def train(tmp_path: Path, model: Path, data: Path, *changes: str) -> subprocess.CompletedProcess:
    overrides = [f"model.name=hf:{model}", "model.seq_len=127", f"data.path={data}",
                 f"data.val_path={data}", f"run.dir={tmp_path}", "run.name=chat",
                 "train.global_batch_size=8", "train.micro_batch_size=2", "train.warmup_steps=1",
                 "train.log_every=1", "train.eval_every=4", "train.eval_batches=1",
                 "train.checkpoint_every=4", "memory.precision=fp32",
                 "memory.activation_checkpointing=none", *changes]
    return memtrain("train", "--config", str(REPO / "configs" / "demo-cpu.yaml"), "--launcher",
                    "local", "--workers", "2", *set_args(overrides))


@pytest.mark.slow
def test_a_chat_dataset_fine_tunes_a_pretrained_model_and_exports(tmp_path: Path) -> None:
    import transformers

    model = pretrained_llama(tmp_path / "llama")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_chats(300, seed=1)))
    written = memtrain("data", "write", str(chats), "--format", "chat", "--tokenizer",
                       str(model), "--seq-len", "127", "--out", str(tmp_path / "data"))
    assert "packed 300 of 300 documents" in written.stdout
    inspected = " ".join(memtrain("data", "inspect", str(tmp_path / "data")).stdout.split())
    assert "packed: 300 documents" in inspected and "the chat template of" in inspected

    first = train(tmp_path, model, tmp_path / "data", "train.steps=4", "train.lr=3e-3")
    assert "packed documents (document_ids): no target across a boundary; attention within " \
           "each document" in first.stderr
    assert "trained tok/s" in first.stderr
    summary = json.loads((tmp_path / "chat" / "summary.json").read_text())
    assert summary["tokens_counted"] == "trained"
    assert summary["final_loss"] < summary["first_loss"]

    resumed = train(tmp_path, model, tmp_path / "data", "train.steps=8", "train.lr=1e-3")
    assert "resuming with train.lr changed: 0.003 -> 0.001" in resumed.stderr
    lines = (tmp_path / "chat" / "metrics" / "rank-0.jsonl").read_text().splitlines()
    rates = {r["step"]: r["lr"] for r in map(json.loads, lines) if "lr" in r}
    assert rates[5] < rates[4] and rates[5] < 1e-3  # no jump back up to a peak

    exported = memtrain("export", str(tmp_path / "chat"), "--hf", str(tmp_path / "out"))
    assert "checkpoint of step 8" in exported.stdout
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    start = transformers.AutoModelForCausalLM.from_pretrained(model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    messages = arithmetic_chats(1, seed=7)[0]["messages"]
    prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")  # the template the data was written with
    ids = torch.tensor([tokenizer(prompt + messages[2]["content"])["input_ids"]])
    with torch.no_grad():
        moved = (tuned(input_ids=ids).logits - start(input_ids=ids).logits).abs().max()
    assert moved > 1e-3  # eight steps moved the pretrained weights

    from trainer.checkpoint.files import complete_checkpoints, load_tensors
    from trainer.models.hf import HFCausalLM

    wrapped = HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(model))
    [(step, checkpoint)] = complete_checkpoints(tmp_path / "chat")[-1:]
    assert step == 8
    state = load_tensors(checkpoint, {name: torch.empty_like(t)
                                              for name, t in wrapped.state_dict().items()})
    wrapped.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(tuned(input_ids=ids).logits, wrapped(ids), rtol=1e-5,
                                   atol=1e-5)


def test_masked_tokens_of_a_written_row_carry_no_gradient(tmp_path: Path) -> None:
    """A packed row of the written dataset, all documents but the first masked out: whatever
    the others' tokens are, the loss and every gradient of a Llama stay the same."""
    import transformers

    from datapipe.loader import BatchLoader
    from trainer.batches import TokenBatch
    from trainer.memory.loss import summed_loss
    from trainer.memory.precision import PrecisionPolicy
    from trainer.models.hf import HFCausalLM

    model_dir = pretrained_llama(tmp_path / "llama")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_chats(20)))
    memtrain("data", "write", str(chats), "--format", "chat", "--tokenizer", str(model_dir),
             "--seq-len", "255", "--out", str(tmp_path / "data"))
    row = {name: next(iter(BatchLoader(tmp_path / "data", name, rank=0, world_size=1,
                                       batch_size=1, seed=0, shuffle=False)))
           for name in ("tokens", "loss_mask", "document_ids")}
    others = row["document_ids"] != 0
    assert others.any() and row["loss_mask"][~others].any()
    mask = row["loss_mask"].masked_fill(others, 0)
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(model_dir))
    fp32 = PrecisionPolicy("fp32", None, False)

    def loss_and_grads(tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = summed_loss(model, TokenBatch(tokens, mask, row["document_ids"]), fp32)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    tokens = row["tokens"].long()  # uint16 on disk: torch indexes no uint16 tensor
    loss, grads = loss_and_grads(tokens)
    changed = tokens.clone()
    changed[others] = torch.randint(0, 400, (int(others.sum()),), dtype=changed.dtype)
    loss_changed, grads_changed = loss_and_grads(changed)
    assert loss > 0
    torch.testing.assert_close(loss_changed, loss, rtol=1e-6, atol=1e-6)
    for grad, grad_changed in zip(grads, grads_changed, strict=True):
        torch.testing.assert_close(grad_changed, grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_init_from_a_hf_directory_loads_its_weights_under_ddp_and_fsdp(tmp_path: Path) -> None:
    """``train.init_from: hf:DIR`` into a model built from a config alone: after a step at a
    vanishing learning rate the checkpoint holds DIR's safetensors, under DDP (read whole) and
    FSDP (each rank its rows), with activation checkpointing's wrappers around the blocks (the
    weights are read before the wrappers rename their modules); a directory without weights, or
    a model they do not fit, is one line before or as the run starts."""
    import shutil

    from safetensors.torch import load_file

    from trainer.checkpoint.files import complete_checkpoints, load_tensors

    model = pretrained_llama(tmp_path / "llama")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(model / "config.json", bare / "config.json")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_chats(60)))
    memtrain("data", "write", str(chats), "--format", "chat", "--tokenizer", str(model),
             "--seq-len", "127", "--out", str(tmp_path / "data"))
    expected = load_file(model / "model.safetensors")
    for strategy in ("ddp", "fsdp"):
        train(tmp_path, model, tmp_path / "data", f"model.name=hf:{bare}",
              f"train.init_from=hf:{model}", "train.steps=1", "train.lr=1e-12",
              f"parallel.strategy={strategy}", f"run.name={strategy}",
              "memory.activation_checkpointing=full")
        [(_, checkpoint)] = complete_checkpoints(tmp_path / strategy)
        got = load_tensors(checkpoint, {f"hf.{name}": torch.empty_like(t)
                                                for name, t in expected.items()})
        for name, tensor in expected.items():
            torch.testing.assert_close(got[f"hf.{name}"], tensor, rtol=0, atol=1e-6,
                                       msg=f"{strategy}: {name}")
    from trainer.config import ConfigError, load_config
    from trainer.launch.local import launch_local
    from trainer.launch.prepare import prepare_run

    def config(*changes: str):
        return load_config(REPO / "configs" / "demo-cpu.yaml", [
            f"data.path={tmp_path / 'data'}", f"data.val_path={tmp_path / 'data'}",
            f"run.dir={tmp_path}", "model.seq_len=127", "model.vocab_size=400",
            "train.steps=1", "parallel.launcher=local", "parallel.workers=1", *changes])

    with pytest.raises(ConfigError, match="no model.safetensors"):
        prepare_run(config(f"train.init_from=hf:{bare}", "run.name=x"))
    cfg, run_dir = prepare_run(config(f"train.init_from=hf:{model}", "run.name=y"))
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \[400, 32\] in its "
                                         r"safetensors, the model's lm_head.weight \[400, 128\]"):
        launch_local(cfg, run_dir)


def test_init_from_a_hf_directory_is_a_lora_models_base(tmp_path: Path) -> None:
    """A LoRA model over a config alone, its base from ``init_from: hf:DIR``: every base weight
    is DIR's (the adapters keep their own initialisation)."""
    import shutil

    from safetensors.torch import load_file

    from trainer.config import LoraConfig, ModelConfig
    from trainer.memory.lora import base_name
    from trainer.models.build import MemoryTransforms, build_model, model_factory
    from trainer.models.hf import weights_of
    from trainer.models.weights import load_hf_weights

    model_dir = pretrained_llama(tmp_path / "llama")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(model_dir / "config.json", bare / "config.json")
    config = ModelConfig(name=f"hf:{bare}", vocab_size=400, seq_len=64,
                         lora=LoraConfig(rank=4, targets=["q_proj", "v_proj"]))
    model = build_model(model_factory(config, load_weights=False), MemoryTransforms())
    load_hf_weights(model, weights_of(f"hf:{model_dir}"))
    expected = load_file(model_dir / "model.safetensors")
    bases = {base_name(name.removeprefix("hf.")): p for name, p in model.named_parameters()
             if "lora_" not in name}
    assert set(bases) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(bases[name].float(), tensor, rtol=0, atol=0, msg=name)
