"""Hugging Face causal LMs as memtrain models (``trainer/models/hf.py``): tiny models built from
their config classes (nothing downloaded), given by directory (``hf:<dir>``) or by an entry
point."""

from __future__ import annotations

import json
import logging
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from datapipe.convert import write_dataset
from datapipe.tokenize import train_tokenizer
from tests.conftest import REPO, SEQ_LEN, tiny_config, tiny_train_command
from tests.unit.test_tokenize import make_texts
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run
from trainer.memory.loss import auto_loss_chunk_tokens
from trainer.models.build import MemoryTransforms, build_model, checkpointed_blocks
from trainer.models.hf import HFCausalLM
from trainer.models.registry import create_model
from trainer.plan.probe import profile_activations


# One test process imports transformers (several seconds of CPU), not both.
def _transformers():
    """Imported when a test runs, not when the tests are collected: both test processes
    collect every module, and importing transformers costs seconds of CPU."""
    import transformers

    return transformers


pytestmark = [pytest.mark.unit, pytest.mark.xdist_group("hf")]

# memtrain's model fields as the demo config sets them (the GPT's): ignored by a HF model.
FIELDS = {"vocab_size": 256, "seq_len": 64, "n_layer": 4, "n_head": 4, "n_embd": 128,
          "dropout": 0.0}
CONFIGS = {  # each family's decoder layers live elsewhere: model.layers, transformer.h
    "llama": lambda: _transformers().LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "qwen2": lambda: _transformers().Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "mistral": lambda: _transformers().MistralConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "gpt2": lambda: _transformers().GPT2Config(  # its dropouts off: the comparisons are exact
        vocab_size=300, n_embd=32, n_layer=3, n_head=4, n_positions=128, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}


def tiny_llama(**fields: object) -> torch.nn.Module:
    """An entry point that returns a transformers model itself, as a user's might."""
    return _transformers().AutoModelForCausalLM.from_config(CONFIGS["llama"]())


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    CONFIGS[request.param]().save_pretrained(directory)  # config.json only: no weights
    return directory


def build(spec: str, mode: str = "none", chunk: int | str = 16) -> HFCausalLM:
    model = build_model(partial(create_model, spec, **FIELDS), MemoryTransforms(mode, 2, chunk))
    assert isinstance(model, HFCausalLM)
    return model


def loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    # Named as in the state dict: a checkpointed layer's parameters sit inside its wrapper.
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                           for n, p in model.named_parameters()}


def test_a_directorys_model_takes_every_memory_strategy(model_dir: Path) -> None:
    """Selective checkpointing wraps its decoder layers; the chunked loss equals cross-entropy
    over the model's own logits and the model's own ``labels=`` loss; checkpointing changes
    neither loss nor gradients."""
    with pytest.warns(UserWarning, match="its own config is the truth; ignored: model.n_layer 4"):
        plain = build(f"hf:{model_dir}")
    assert len(plain.blocks) == 3 and plain.vocab_size == 300
    checkpointed = build(f"hf:{model_dir / 'config.json'}", "selective")
    assert checkpointed_blocks(checkpointed) == [0, 2]
    tokens = torch.randint(0, 256, (2, 33))
    logits = plain(tokens[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
    loss, grads = loss_and_grads(plain, tokens)  # 64 tokens in chunks of 16
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)
    with torch.no_grad():  # the model's own labels= loss: the mean over the shifted targets
        own = plain.hf(input_ids=tokens, labels=tokens).loss
    torch.testing.assert_close(loss / tokens[:, 1:].numel(), own, rtol=1e-5, atol=1e-6)
    loss_ckpt, grads_ckpt = loss_and_grads(checkpointed, tokens)
    torch.testing.assert_close(loss_ckpt, loss)
    assert grads.keys() == grads_ckpt.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_tied_embeddings_get_the_output_layers_gradient(tmp_path: Path) -> None:
    config = CONFIGS["llama"]()
    config.tie_word_embeddings = True
    config.save_pretrained(tmp_path)
    model = build(f"hf:{tmp_path}")
    assert model.hf.get_output_embeddings().weight is model.hf.get_input_embeddings().weight
    tokens = torch.randint(0, 256, (2, 17))
    _, grads = loss_and_grads(model, tokens)
    reference = build(f"hf:{tmp_path}", chunk=0)  # the plain loss: full logits
    _, expected = loss_and_grads(reference, tokens)
    torch.testing.assert_close(grads["hf.model.embed_tokens.weight"],
                               expected["hf.model.embed_tokens.weight"], rtol=1e-5, atol=1e-6)


def test_weights_in_the_directory_are_loaded(tmp_path: Path) -> None:
    torch.manual_seed(7)
    saved = tiny_llama()
    saved.save_pretrained(tmp_path)  # config.json and model.safetensors
    model = build(f"hf:{tmp_path}")  # build_model seeds 0: other weights unless loaded
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(model.hf.state_dict()[name], tensor, msg=name)


def test_rows_read_per_rank_say_which_parameters_the_files_lack(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The sharded build's read of the safetensors (here whole: no process group, nothing
    sharded), with one tensor taken out of the file: the others are the saved ones, and the
    missing one is named, as ``from_pretrained`` names it."""
    from safetensors.torch import load_file, save_file

    from trainer.models.hf import SafetensorsRows
    from trainer.models.weights import fill_from_file, owners

    torch.manual_seed(7)
    tiny_llama().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = build_model(partial(create_model, f"hf:{tmp_path}", load_weights=False, **FIELDS),
                        MemoryTransforms())
    with caplog.at_level(logging.WARNING, logger="trainer.models.weights"):
        fill_from_file(owners(model), SafetensorsRows(tmp_path))
    state = model.state_dict()
    assert all(torch.equal(state["hf." + name], tensor) for name, tensor in tensors.items())
    assert "1 parameter(s) not in the model's safetensors" in caplog.text
    assert "model.norm.weight" in caplog.text


def test_an_entry_point_returning_a_transformers_model_needs_no_wrapper() -> None:
    model = build("tests.unit.test_hf:tiny_llama", "full", "auto")
    assert checkpointed_blocks(model) == [0, 1, 2]
    # auto, sized by the model's own vocabulary (300), not memtrain's model.vocab_size (256)
    assert model.loss_chunk_tokens == auto_loss_chunk_tokens(300) != auto_loss_chunk_tokens(256)


def test_bad_hf_models_are_one_line_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="no config.json in"):
        create_model(f"hf:{tmp_path}", **FIELDS)
    CONFIGS["llama"]().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model.seq_len 1024 is longer than"):
        create_model(f"hf:{tmp_path}", **{**FIELDS, "seq_len": 1024})
    monkeypatch.setitem(sys.modules, "transformers", None)  # as where it is not installed
    with pytest.raises(ValueError, match=r"needs the transformers package: pip install "
                                         r"'memtrain\[hf\]'"):
        create_model(f"hf:{tmp_path}", **FIELDS)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_planner_probes_a_hf_model(precision: str, tmp_path: Path) -> None:
    """On fake tensors where the model allows it (else for real, with a log line): either way
    the profile holds the chunked loss's shape and saved activations."""
    CONFIGS["llama"]().save_pretrained(tmp_path)
    factory = partial(create_model, f"hf:{tmp_path}", **FIELDS)
    profile = profile_activations(factory, MemoryTransforms("selective", 2, "auto"), 64, 256,
                                  precision, target="cuda")
    assert profile.per_sample_bytes > 0 and profile.loss_shape is not None
    assert profile.loss_shape.vocab_size == 300


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_a_fake_probe_of_a_grouped_query_llama_saves_what_a_real_forward_does(
        packed: bool, tmp_path: Path) -> None:
    """transformers takes fake tensors for tracing and would assume packed documents, building a
    mask that turns SDPA's grouped-query path off (``repeat_kv`` copies every key and value
    head): the probe reads unpacked positions as a real forward does, to the byte. Packed, both
    build the mask."""
    CONFIGS["llama"]().save_pretrained(tmp_path)  # 4 heads, 2 key-value heads
    factory = partial(create_model, f"hf:{tmp_path}", **FIELDS)

    def probe(fake: bool) -> int:
        return profile_activations(factory, MemoryTransforms("none", 2, 16), 64, 256, "fp32",
                                   fake=fake, packed=packed).saved_bytes(2)

    assert probe(True) == probe(False)


def test_a_decoder_layer_is_measured_with_its_own_arguments(tmp_path: Path) -> None:
    """The emulated-bf16 workspace calls the first block alone; a decoder layer needs the
    rotary embeddings and position ids its model passed it, which the probe records (by shape:
    it may run on fake tensors). On every CPU kind the call runs; on one without native bf16
    the planner takes it before any bf16 run."""
    from trainer.plan.emulation import BlockCall, emulated_bf16_workspace

    CONFIGS["llama"]().save_pretrained(tmp_path)
    model = build(f"hf:{tmp_path}")
    calls: list[BlockCall] = []
    model.blocks[0].register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append(BlockCall.record(args, kwargs)), with_kwargs=True)
    model(torch.randint(0, 256, (1, 16)))
    [call] = calls
    assert call.sample_shape == (16, 32) and "position_embeddings" in call.kwargs
    assert emulated_bf16_workspace(model.blocks[0], call.sample_shape, call) >= 0
    factory = partial(create_model, f"hf:{tmp_path}", **FIELDS)
    profile = profile_activations(factory, MemoryTransforms("selective", 2, "auto"), 64, 256,
                                  "bf16")  # for this CPU, whichever kind
    assert profile.emulation_workspace_per_sample_bytes >= 0


@pytest.mark.slow
def test_a_hf_model_trains_and_exports_back_to_its_own_format(corpus_dir: Path,
                                                               tmp_path: Path) -> None:
    """``memtrain train`` of ``hf:<dir>`` (local launcher) with selective checkpointing and the
    chunked loss, under DDP (``state.pt``) and FSDP (DCP shards); ``memtrain export --hf`` of
    each gives ``from_pretrained`` the trained model (the logits of the weights in
    ``state.pt``), and ``AutoTokenizer`` the dataset's tokenizer where it has one."""
    import subprocess

    from trainer.checkpoint.export import export_hf
    from trainer.checkpoint.files import (
        complete_checkpoints,
        load_checkpoint,
        load_tensors,
    )

    CONFIGS["llama"]().save_pretrained(tmp_path / "llama")
    overrides = (f"model.name=hf:{tmp_path / 'llama'}", "train.steps=2",
                 "memory.activation_checkpointing=selective", "memory.loss_chunk_tokens=64")
    # The DDP run reads text tokenized by a trained BPE tokenizer, which export passes on.
    texts = make_texts(tmp_path / "texts", count=3)
    train_tokenizer(sorted(texts.iterdir()), "text", tmp_path / "tokenizer.json", 280)
    write_dataset([texts], tmp_path / "tokens", tokenizer=tmp_path / "tokenizer.json",
                  seq_len=SEQ_LEN)
    dataset = (f"data.path={tmp_path / 'tokens'}", f"data.val_path={tmp_path / 'tokens'}")
    out = subprocess.run(tiny_train_command(corpus_dir, tmp_path, *overrides, *dataset,
                                            "run.name=ddp"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "activation checkpointing selective (blocks [0, 2])" in out.stderr
    assert "in chunks of 64 tokens" in out.stderr
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["final_step"] == 2 and summary["final_loss"] is not None
    launch_local(*prepare_run(tiny_config(corpus_dir, tmp_path, *overrides, *dataset,
                                          "parallel.launcher=local", "parallel.workers=1",
                                          "parallel.strategy=fsdp", "run.name=fsdp")))
    exported = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "export", str(tmp_path / "ddp"), "--hf",
         str(tmp_path / "out-ddp")], capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "(checkpoint of step 2, with the dataset's tokenizer.json)" in exported.stdout
    tokenizer = _transformers().AutoTokenizer.from_pretrained(tmp_path / "out-ddp")
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.vocab_size == 280
    assert export_hf(tmp_path / "fsdp", tmp_path / "out-fsdp").tokenizer
    assert (tmp_path / "out-fsdp" / "model.safetensors").is_file()
    assert load_checkpoint(complete_checkpoints(tmp_path / "fsdp")[-1][1])["dcp"]

    tokens = torch.randint(0, 256, (2, 32))
    [(_, checkpoint)] = complete_checkpoints(tmp_path / "ddp")[-1:]
    trained = build(f"hf:{tmp_path / 'llama'}")
    trained.load_state_dict(load_tensors(checkpoint, {
        name: torch.empty_like(t) for name, t in trained.state_dict().items()}))
    with torch.no_grad():
        expected = trained(tokens)
        initial = build(f"hf:{tmp_path / 'llama'}")(tokens)
        for out_dir in ("out-ddp", "out-fsdp"):
            model = _transformers().AutoModelForCausalLM.from_pretrained(tmp_path / out_dir)
            logits = model(input_ids=tokens).logits
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=out_dir)
    assert not torch.allclose(initial, expected)  # two steps of training moved the weights


def test_export_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    from trainer.checkpoint.export import export_hf
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="no config.yaml"):
        export_hf(tmp_path, tmp_path / "out")
    (tmp_path / "config.yaml").write_text("model:\n  name: gpt\n")
    with pytest.raises(ConfigError, match="needs a run of a Hugging Face model"):
        export_hf(tmp_path, tmp_path / "out")


def test_under_ray_a_hf_directory_is_not_shipped_as_code(tmp_path: Path) -> None:
    """Ray's workers get a ``module:function`` model's code; a model directory is read where it
    is, as a dataset is."""
    from trainer.launch.ray import shipped_model_code

    assert shipped_model_code(f"hf:{tmp_path}") == []
    assert shipped_model_code("tests.unit.test_hf:tiny_llama") != []  # the tests' own package


def test_a_dataset_with_more_tokens_than_the_model_embeds_is_refused(corpus_dir: Path,
                                                                      tmp_path: Path) -> None:
    """Before any worker starts: the dataset's vocabulary (256 byte tokens) against the one in
    the model's config.json."""
    from trainer.config import ConfigError

    config = CONFIGS["llama"]()
    config.vocab_size = 200
    config.save_pretrained(tmp_path / "small")
    with pytest.raises(ConfigError, match=r"data.path: its vocabulary \(256, byte tokens\) is "
                                          r"larger than that of model.name 'hf:.*small' \(200\)"):
        prepare_run(tiny_config(corpus_dir, tmp_path, f"model.name=hf:{tmp_path / 'small'}",
                                "parallel.launcher=local", "parallel.workers=1"))


@pytest.mark.slow
def test_model_vocab_size_is_not_an_hf_models_vocabulary(corpus_dir: Path, tmp_path: Path) -> None:
    """``model.vocab_size`` sizes memtrain's GPT: an ``hf:`` model with a smaller vocabulary
    than it trains on data its own vocabulary holds (256 byte tokens into 300), and a setting
    the model refuses is one line, not the planner's fallback and then the error."""
    import subprocess

    CONFIGS["llama"]().save_pretrained(tmp_path / "llama")
    summary = launch_local(*prepare_run(tiny_config(
        corpus_dir, tmp_path, f"model.name=hf:{tmp_path / 'llama'}", "model.vocab_size=400",
        "train.steps=1", "parallel.launcher=local", "parallel.workers=1", "run.name=wide")))
    assert summary["final_step"] == 1
    # memtrain plan --measure trains real steps on tokens the model embeds
    plan = tiny_train_command(corpus_dir, tmp_path, f"model.name=hf:{tmp_path / 'llama'}",
                              "model.vocab_size=400")
    plan[plan.index("train")] = "plan"
    plan[plan.index("--launcher"):plan.index("--launcher") + 2] = []
    measured = subprocess.run([*plan, "--measure", "--top", "1", "--steps", "1"],
                              capture_output=True, text=True, timeout=300)
    assert measured.returncode == 0, measured.stderr[-2000:]
    config = CONFIGS["llama"]()
    config.max_position_embeddings = 32
    config.save_pretrained(tmp_path / "short")
    out = subprocess.run(tiny_train_command(corpus_dir, tmp_path,
                                            f"model.name=hf:{tmp_path / 'short'}",
                                            "run.name=short"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "max_position_embeddings" in line]
    assert errors == [f"memtrain: error: model.seq_len {SEQ_LEN} is longer than "
                      f"hf:{tmp_path / 'short'} takes (max_position_embeddings 32)"]


_PREPARE_PEAK = """
import resource, sys
from pathlib import Path
from tests.conftest import tiny_config
from trainer.launch.prepare import prepare_run
corpus, run_dir, model = sys.argv[1:]
prepare_run(tiny_config(Path(corpus), Path(run_dir), f"model.name=hf:{model}",
                        "memory.precision=auto", "parallel.launcher=local",
                        "parallel.workers=1", f"run.name={Path(model).name}"))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.slow
def test_the_launcher_plans_an_hf_model_without_reading_its_weights(corpus_dir: Path,
                                                                     tmp_path: Path) -> None:
    """``prepare_run`` (the launcher; on a cluster the driver, on the head node) resolves
    ``auto`` from the model's shapes: its peak resident memory with a 75 MB safetensors file is
    the one without (the probe loaded the whole model: +297 MB on this file)."""
    import shutil
    import subprocess

    transformers = _transformers()
    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
        tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "weights")
    (tmp_path / "shapes").mkdir()
    shutil.copy(tmp_path / "weights" / "config.json", tmp_path / "shapes" / "config.json")
    weight_bytes = (tmp_path / "weights" / "model.safetensors").stat().st_size
    peaks = {}
    for name in ("shapes", "weights"):
        out = subprocess.run([sys.executable, "-c", _PREPARE_PEAK, str(corpus_dir),
                              str(tmp_path / "runs"), str(tmp_path / name)],
                             capture_output=True, text=True, timeout=300, cwd=REPO)
        assert out.returncode == 0, out.stderr[-2000:]
        peaks[name] = int(out.stdout.split()[-1])
    assert peaks["weights"] - peaks["shapes"] < weight_bytes // 4, (peaks, weight_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_default_lora_targets_are_pefts_all_linear(family: str, tmp_path: Path) -> None:
    """Every family's default targets are the layers PEFT's ``all-linear`` adapts (GPT-2's
    Conv1D among them), and the adapted model computes what PEFT's does with the same adapter
    values, and merges to what its ``merge_and_unload`` gives."""
    import peft

    from trainer.memory.lora import LoraSettings, apply_lora, merge_adapters, peft_config

    CONFIGS[family]().save_pretrained(tmp_path)
    ours = apply_lora(build(f"hf:{tmp_path}", chunk=0), LoraSettings(rank=4))
    reference = peft.get_peft_model(
        _transformers().AutoModelForCausalLM.from_config(CONFIGS[family]()),
        peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))
    assert set(ours.lora_settings.targets) == {  # PEFT may name them in full
        name.rsplit(".", 1)[-1] for name in reference.peft_config["default"].target_modules}
    exported = peft_config(ours.lora_settings, ours, str(tmp_path))  # GPT-2's Conv1D: in x out
    assert exported.fan_in_fan_out == (family == "gpt2")
    for name, param in ours.named_parameters():
        if ".lora_B." in name:  # non-zero, so the adapters change the logits
            param.data.normal_(generator=torch.Generator().manual_seed(len(name)))
    reference.base_model.model.load_state_dict(ours.hf.state_dict())  # base and adapters
    tokens_BT = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    ours.eval(), reference.eval()
    with torch.no_grad():
        expected = reference(tokens_BT).logits
        torch.testing.assert_close(ours(tokens_BT), expected, rtol=1e-5, atol=1e-5)
        merged = reference.merge_and_unload()
        torch.testing.assert_close(merge_adapters(ours)(tokens_BT), merged(tokens_BT).logits,
                                   rtol=1e-5, atol=1e-5)
