"""``memtrain export`` of a LoRA fine-tune held against the ecosystem's own implementations.

A tiny Llama's weights come from ``train.init_from: hf:DIR`` (``model.name`` names a config
alone), and its chat template writes ``{{ bos_token }}``. ``export --hf --merge`` must equal
PEFT's ``merge_and_unload`` over the adapter export on the real base, and the exported
tokenizer's ``apply_chat_template`` must render the text the training rows were made from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, arithmetic_chats, write_chat_tokenizer

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group("hf")]

BOS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "unk_token": "<unk>"}
VOCAB = 416


def pretrained_llama(directory: Path) -> Path:
    """A tiny Llama with random weights beside a tokenizer whose template writes the BOS and
    whose config names all four special tokens (``<s>`` and ``<unk>`` added to the BPE)."""
    import transformers
    from tokenizers import Tokenizer

    texts = [m["content"] for row in arithmetic_chats(100) for m in row["messages"]]
    write_chat_tokenizer(directory, texts, vocab_size=400, template=BOS_TEMPLATE)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(["<s>", "<unk>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | SPECIALS))
    torch.manual_seed(1234)  # not run.seed's: a seeded build of the architecture is not these
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three LoRA steps on one local worker: the base's weights from ``train.init_from``."""
    from datapipe.convert import write_dataset
    from trainer.config import load_config
    from trainer.launch.local import launch_local
    from trainer.launch.prepare import prepare_run

    tmp_path = tmp_path_factory.mktemp("lora")
    base = pretrained_llama(tmp_path / "llama")
    bare = tmp_path / "bare"  # the architecture alone: the weights must come from init_from
    bare.mkdir()
    shutil.copy(base / "config.json", bare / "config.json")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_chats(40, seed=1)))
    write_dataset([chats], tmp_path / "data", "chat", tokenizer=base, seq_len=127)
    overrides = [
        f"model.name=hf:{bare}", f"train.init_from=hf:{base}", "model.lora.rank=4",
        "model.seq_len=127", f"data.path={tmp_path / 'data'}", "data.shuffle=false",
        f"data.val_path={tmp_path / 'data'}", f"run.dir={tmp_path}", "run.name=lora",
        "train.steps=3", "train.global_batch_size=2", "train.micro_batch_size=2",
        "train.warmup_steps=1", "train.lr=0.02", "train.eval_every=0",
        "train.checkpoint_every=3", "memory.precision=fp32",
        "memory.activation_checkpointing=none", "parallel.launcher=local",
        "parallel.workers=1"]
    cfg, run_dir = prepare_run(load_config(REPO / "configs" / "demo-cpu.yaml", overrides))
    launch_local(cfg, run_dir)
    return {"base": base, "data": tmp_path / "data", "run": run_dir, "tmp": tmp_path,
            "overrides": overrides}  # type: ignore[dict-item]


def memtrain(*args: str) -> int:
    """The CLI as a user runs it, in this process; its exit code."""
    from trainer.cli import main

    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return int(exited.value.code or 0)


def test_merged_export_is_peft_merge_and_unload_over_the_adapter_export(
        lora_run: dict[str, Path]) -> None:
    import transformers
    from peft import PeftModel

    adapter, merged = lora_run["tmp"] / "adapter", lora_run["tmp"] / "merged"
    assert memtrain("export", str(lora_run["run"]), "--hf", str(adapter)) == 0
    assert memtrain("export", str(lora_run["run"]), "--hf", str(merged), "--merge") == 0
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(lora_run["base"].resolve())

    auto = transformers.AutoModelForCausalLM
    original = auto.from_pretrained(lora_run["base"]).eval()
    base_state = {name: t.clone() for name, t in original.state_dict().items()}
    reference = PeftModel.from_pretrained(auto.from_pretrained(lora_run["base"]), adapter)
    reference = reference.merge_and_unload().eval()
    ours = auto.from_pretrained(merged).eval()
    tokens_BT = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = reference(tokens_BT).logits, ours(tokens_BT).logits
        before = original(tokens_BT).logits
    assert (expected - before).abs().max() > 1e-4  # three steps moved the adapters
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    targets = set(adapter_config["target_modules"])
    merged_state = ours.state_dict()
    frozen = [name for name in base_state if name.split(".")[-2] not in targets]
    assert "model.embed_tokens.weight" in frozen and "lm_head.weight" in frozen
    for name in frozen:  # untouched by LoRA: the real base's weights, to the bit
        torch.testing.assert_close(merged_state[name], base_state[name], rtol=0, atol=0,
                                   msg=name)


def test_exported_tokenizer_renders_the_training_rows_text(lora_run: dict[str, Path]) -> None:
    import transformers
    from tokenizers import Tokenizer

    from datapipe.loader import BatchLoader
    from datapipe.tokenize import TOKENIZER_FILE

    out = lora_run["tmp"] / "tokenizer-export"
    assert memtrain("export", str(lora_run["run"]), "--hf", str(out), "--merge") == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert {name: getattr(tokenizer, name) for name in SPECIALS} == SPECIALS
    messages = arithmetic_chats(40, seed=1)[0]["messages"]  # the dataset's first row
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<s><|im_start|>system\n")
    # What training read: the first packed row's first document, decoded.
    row = next(iter(BatchLoader(lora_run["data"], "tokens", rank=0, world_size=1,
                                batch_size=1, seed=0, shuffle=False)))
    ids = next(iter(BatchLoader(lora_run["data"], "document_ids", rank=0, world_size=1,
                                batch_size=1, seed=0, shuffle=False)))
    first = row[0][ids[0] == ids[0][0]].tolist()
    trained = Tokenizer.from_file(str(lora_run["data"] / TOKENIZER_FILE))
    assert trained.decode(first, skip_special_tokens=False).startswith(text)


def test_export_refuses_a_lora_base_missing_or_changed(lora_run: dict[str, Path],
                                                       capsys: pytest.CaptureFixture) -> None:
    from safetensors.torch import load_file, save_file

    base, run = lora_run["base"], str(lora_run["run"])
    out = str(lora_run["tmp"] / "refused")
    moved = base.with_name("llama-moved")
    base.rename(moved)
    try:
        assert memtrain("export", run, "--hf", out, "--merge") == 2
    finally:
        moved.rename(base)
    err = capsys.readouterr().err
    assert f"train.init_from hf:{base}: the LoRA run's base weights are missing" in err
    weights = base / "model.safetensors"
    original = weights.read_bytes()
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3  # same size, new bytes
    save_file(tensors, str(weights), metadata={"format": "pt"})
    try:
        assert memtrain("export", run, "--hf", out) == 2
    finally:
        weights.write_bytes(original)
    err = capsys.readouterr().err
    assert f"train.init_from hf:{base}: model.safetensors is not the file the LoRA run " \
           "trained on" in err
    assert not Path(out).exists()


def _resume(lora_run: dict, *changes: str, allow_changes: bool = False) -> None:
    """The driver's part of resuming the fixture's run to step 4 with ``changes``."""
    from trainer.config import load_config
    from trainer.launch.prepare import prepare_run

    prepare_run(load_config(REPO / "configs" / "demo-cpu.yaml", [
        *lora_run["overrides"], "train.steps=4", *changes]), allow_changes=allow_changes)


def test_a_lora_resume_refuses_a_base_changed_since_its_checkpoint(
        lora_run: dict, caplog: pytest.LogCaptureFixture) -> None:
    """The checkpoint holds the adapters alone: a base whose file changed since (same size, new
    bytes), or another ``train.init_from``, is refused before any worker starts, naming the
    field and both values, unless ``--allow-changes``, which says what changed."""
    from safetensors.torch import load_file, save_file

    from trainer.checkpoint.integrity import sha256_of
    from trainer.config import ConfigError

    base = lora_run["base"]
    _resume(lora_run)  # unchanged: resumes
    weights = base / "model.safetensors"
    original, before = weights.read_bytes(), sha256_of(weights)
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3  # same size, new bytes
    save_file(tensors, str(weights), metadata={"format": "pt"})
    try:
        with pytest.raises(ConfigError) as refused:
            _resume(lora_run)
        line = str(refused.value)
        assert line.startswith(f"train.init_from: model.safetensors sha256 {before[:12]} -> "
                               f"{sha256_of(weights)[:12]} since checkpoint-") and "\n" not in line
        assert "--allow-changes" in line
        with caplog.at_level("WARNING", logger="memtrain"):
            _resume(lora_run, allow_changes=True)
        assert "resuming with train.init_from: model.safetensors sha256" in caplog.text
    finally:
        weights.write_bytes(original)
    other = lora_run["tmp"] / "other-llama"
    shutil.copytree(base, other, dirs_exist_ok=True)
    with pytest.raises(ConfigError, match=rf"^train.init_from: 'hf:{base}' -> 'hf:{other}' on "
                                          "resuming run 'lora'.*--allow-changes"):
        _resume(lora_run, f"train.init_from=hf:{other}")
