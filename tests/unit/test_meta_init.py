"""The meta-device record and its replay: the replayed weights are a seeded host build's, bit
for bit, and a factory that needs real values while it builds cannot be recorded."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
from torch import nn

from trainer.models import meta_init
from trainer.models.gpt import GPT, GPTConfig
from trainer.models.hf import initialise_on_meta
from trainer.tensors import storage_key


def _replayed(factory: Callable[[], nn.Module], seed: int, hf: bool = False
              ) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``factory``'s model as the replay makes them, by name."""
    with initialise_on_meta() if hf else torch.no_grad():
        meta, recording = meta_init.record(factory)
    names: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in meta_init.module_tensors(meta):
        names.setdefault(storage_key(tensor), []).append((name, tensor))
    got: dict[str, torch.Tensor] = {}

    def take(key: int, real: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name, tensor in names[key]:
            got[name] = real(tensor).clone()

    meta_init.replay(recording, set(names), seed, take)
    return got


def _host(factory: Callable[[], nn.Module], seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return dict(meta_init.module_tensors(factory()))


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert different == []


def test_the_replayed_gpt_is_the_seeded_host_build() -> None:
    factory = partial(GPT, GPTConfig(vocab_size=96, seq_len=16, n_layer=3, n_head=2, n_embd=32))
    _assert_same(_replayed(factory, 11), _host(factory, 11))
    assert not torch.equal(_replayed(factory, 12)["wte.weight"], _host(factory, 11)["wte.weight"])


@pytest.mark.xdist_group("hf")
@pytest.mark.parametrize("tied", [False, True])
def test_the_replayed_hf_llama_is_from_configs_build(tied: bool) -> None:
    """Its weights through Hugging Face's own initialisation, its rotary buffers computed."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied)
    factory = partial(transformers.AutoModelForCausalLM.from_config, config, dtype=torch.float32)
    got = _replayed(factory, 3, hf=True)
    _assert_same(got, _host(factory, 3))
    assert "model.rotary_emb.inv_freq" in got


def test_only_what_reaches_the_weights_is_replayed_whole() -> None:
    """A first init overwritten by a later one runs on scratch (the random stream advances as
    the host build's did); the storage is allocated by the write that fills it."""
    def factory() -> nn.Module:
        layer = nn.Linear(64, 64, bias=False)  # kaiming_uniform_, then overwritten
        nn.init.normal_(layer.weight)
        return layer
    meta, recording = meta_init.record(factory)
    needed, _ = meta_init._needed(recording.ops, {storage_key(meta.weight)})
    ops = [(op.name, keep) for op, keep in zip(recording.ops, needed, strict=True)]
    assert ops == [("empty", False), ("uniform_", False), ("normal_", True)]
    _assert_same(_replayed(factory, 4), _host(factory, 4))


def test_a_factory_that_reads_values_cannot_be_recorded() -> None:
    def factory() -> nn.Module:
        layer = nn.Linear(4, 4)
        if layer.weight.sum().item() > 0:  # a branch on data: meta tensors have none
            layer.weight.data.zero_()
        return layer
    with pytest.raises((RuntimeError, NotImplementedError)):
        meta_init.record(factory)


# A state dict as a factory reads one from a file: host tensors, made outside the meta device.
_LOADED = {"weight": torch.full((4, 4), 2.0), "bias": torch.ones(4)}


class _FromNumpy(nn.Module):
    """Weights a factory makes outside torch's operations: a numpy array's, and a state dict
    assigned over a meta-built layer."""

    def __init__(self) -> None:
        super().__init__()
        import numpy as np

        self.table = nn.Parameter(torch.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4)))
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.blocks[0].load_state_dict(_LOADED, assign=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](self.table[idx])


def test_weights_made_outside_the_record_are_built_on_the_host(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """The replay cannot make what the record never saw: those tensors are named, and the
    sharded build takes the host build's values (one warning) instead of uninitialised memory."""
    import logging

    from tests.gloo import one_rank_group
    from trainer.models.build import MemoryTransforms
    from trainer.parallel.fsdp import FsdpSettings, build_sharded

    meta, recording = meta_init.record(_FromNumpy)
    assert meta_init.unrecorded(recording, dict(meta_init.module_tensors(meta))) == [
        "table", "blocks.0.weight", "blocks.0.bias"]
    gpt, recording = meta_init.record(partial(GPT, GPTConfig(vocab_size=16, seq_len=4,
                                                             n_layer=1, n_head=1, n_embd=8)))
    assert meta_init.unrecorded(recording, dict(meta_init.module_tensors(gpt))) == []
    with one_rank_group(tmp_path):
        with caplog.at_level(logging.WARNING, logger="trainer.parallel.fsdp"):
            model = build_sharded(_FromNumpy, MemoryTransforms(), torch.device("cpu"), 0,
                                  FsdpSettings(), model_name="tests:from_numpy")
        weights = {name: p.full_tensor() for name, p in model.named_parameters()}
    assert "made without a tensor operation the meta device records" in caplog.text
    assert torch.equal(weights["table"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(weights["blocks.0.weight"], torch.full((4, 4), 2.0))
    assert torch.equal(weights["blocks.0.bias"], torch.ones(4))


class _Recast(nn.Module):
    """A module that scales its weight in place and then gives the Parameter a new storage
    (``param.data = ...``), as LoRA's cast of its frozen base does."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4))
        with torch.no_grad():
            self.weight.mul_(2)
        self.weight.data = self.weight.data.to(torch.bfloat16)


def test_an_operation_is_replayed_on_the_storage_it_ran_on() -> None:
    """The record keeps each operation's tensors as they were: the ``mul_`` on the fp32 weight
    is replayed on it, not on the bf16 storage the Parameter holds by the end (which would
    give memory nothing wrote)."""
    _assert_same(_replayed(_Recast, 4), _host(_Recast, 4))


@pytest.mark.parametrize("init", ["trunc_normal_", "orthogonal_"])
def test_an_initialisation_that_draws_nothing_on_meta_cannot_be_recorded(init: str) -> None:
    """torch.nn.init's trunc_normal_ (and dirac_, orthogonal_, sparse_) return a meta tensor
    untouched, running nothing a record sees: replayed, the weight would keep its earlier
    values, so recording refuses it (the builds then build on the host, saying so)."""
    def factory() -> nn.Module:
        layer = nn.Linear(8, 8)
        getattr(nn.init, init)(layer.weight)
        return layer

    with pytest.raises(ValueError, match=f"torch.nn.init.{init} draws nothing on the meta"):
        meta_init.record(factory)
    assert nn.init.trunc_normal_(torch.zeros(4, 4), std=0.02).abs().sum() > 0  # restored


class _Views(nn.Module):
    """A tied embedding and output layer, and two buffers that are rows of one cache (as some
    rotary modules keep ``cos`` and ``sin``): one storage each, tied only in the first case."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.wte.weight
        angles = torch.arange(6.0)[:, None] * torch.arange(1.0, 5.0)[None, :]
        cache = torch.stack([angles.cos(), angles.sin()])
        self.register_buffer("cos", cache[0], persistent=False)
        self.register_buffer("sin", cache[1], persistent=False)


def test_one_process_meta_build_ties_the_same_view_only() -> None:
    """After ``to_empty`` the one-process build ties again what the model tied (the same view
    of a storage), and keeps different views of one storage apart, each with its own values."""
    from trainer.models.build import OnMeta

    model = OnMeta.start(_Views, torch.device("cpu"), 4).finish()
    host = _host(_Views, 4)
    _assert_same(dict(meta_init.module_tensors(model)), host)
    assert model.head.weight is model.wte.weight
    assert model.sin is not model.cos


@pytest.mark.xdist_group("hf")
def test_a_lora_base_read_from_its_files_replays_no_random_draw(tmp_path) -> None:
    """The adapters draw from generators of their own, so a base whose weights all come from
    its files has nothing random to replay: the replay seeds the stream and draws nothing (a
    draw would be made on a scratch tensor of its weight's size, on every rank, only to move
    the stream on: a whole embedding's bytes for each). The adapters are still the seeded
    build's."""
    import transformers

    from trainer.config import LoraConfig, ModelConfig
    from trainer.memory.lora import initial_adapter, is_adapter
    from trainer.models.build import MemoryTransforms, build_whole

    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )).save_pretrained(tmp_path)
    model = ModelConfig(name=f"hf:{tmp_path}", seq_len=32,
                        lora=LoraConfig(rank=4, base_dtype="bf16"))
    built = build_whole(model, None, MemoryTransforms(), seed=11)  # on meta, then filled
    after = torch.get_rng_state()
    torch.manual_seed(11)
    assert torch.equal(after, torch.get_rng_state())  # seeded, and nothing drawn since
    adapters = {n: p for n, p in built.named_parameters() if is_adapter(n)}
    assert adapters and all(torch.equal(p, initial_adapter(n, p.shape, 11))
                            for n, p in adapters.items())
