"""``parallel.fsdp``'s settings on real gloo ranks: resharding and CPU offload change where
bytes live, not the arithmetic (the same step to the bit); bf16 parameters through
MixedPrecisionPolicy follow fp32 within bf16's rounding; pretrained safetensors load per rank;
a model that cannot be built on meta is built on the host, with one line saying so."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.gloo import on_ranks
from trainer.config import load_config
from trainer.models.build import MemoryTransforms, build_model, model_factory
from trainer.models.gpt import GPT, GPTConfig
from trainer.models.hf import weights_of
from trainer.models.registry import create_model
from trainer.parallel.fsdp import FsdpSettings, build_sharded

pytestmark = pytest.mark.distributed

_GPT = GPTConfig(vocab_size=128, seq_len=32, n_layer=4, n_head=2, n_embd=64)
SETTINGS = {
    "default": FsdpSettings(),
    "keep_after_forward": FsdpSettings(reshard_after_forward=False),
    "reshard_to_2": FsdpSettings(reshard_after_forward=2),
    "offload": FsdpSettings(offload="cpu"),
    "bf16": FsdpSettings(param_dtype="bf16"),
    "bf16_reduce": FsdpSettings(param_dtype="bf16", reduce_dtype="bf16"),
}


def _three_steps(rank: int, out: str) -> None:
    """Three AdamW steps of the same data under every setting; each rank's losses and its
    first shard after them."""
    results = {}
    for name, settings in SETTINGS.items():
        model = build_sharded(partial(GPT, _GPT), MemoryTransforms(), torch.device("cpu"), 3,
                              settings, model_name="gpt")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(3):
            tokens = torch.randint(0, _GPT.vocab_size, (2, _GPT.seq_len + 1),
                                   generator=generator)
            loss = model(tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        first = next(model.parameters())
        results[name] = {"losses": losses, "shard": first.to_local().detach().float().clone(),
                         "dtype": str(first.dtype), "device": str(first.device)}
    torch.save(results, f"{out}.{rank}")


def test_each_fsdp_setting_trains_the_same_step(tmp_path: Path) -> None:
    """Resharding to the whole group, to none or to pairs, and CPU offload, give the default's
    losses and weights to the bit. bf16 parameters (and bf16 reduction) follow it within a
    tolerance from bf16's rounding: 8 significant bits, a relative 2^-9 per rounding, and the
    loss of a 4-block model goes through a few dozen roundings whose errors mostly cancel; a 2%
    bound on each loss is 30x what was seen (under 0.07%)."""
    out = tmp_path / "steps"
    on_ranks(_three_steps, 4, str(out))
    for rank in range(4):
        results = torch.load(f"{out}.{rank}", weights_only=True)
        default = results["default"]
        for name in ("keep_after_forward", "reshard_to_2", "offload"):
            assert results[name]["losses"] == default["losses"], (rank, name)
            assert torch.equal(results[name]["shard"], default["shard"]), (rank, name)
        for name in ("bf16", "bf16_reduce"):
            assert results[name]["dtype"] == "torch.float32"  # the shards stay fp32
            assert results[name]["losses"] == pytest.approx(default["losses"], rel=0.02), name
            assert results[name]["losses"] != default["losses"]  # it did compute in bf16


def _pretrained_logits(rank: int, directory: str, out: str) -> None:
    cfg = load_config(None, [f"model.name=hf:{directory}", "model.seq_len=16",
                             "model.vocab_size=128"])
    model = build_sharded(model_factory(cfg.model, load_weights=False), MemoryTransforms(),
                          torch.device("cpu"), 0, FsdpSettings(), model_name=cfg.model.name,
                          weights=weights_of(cfg.model.name))
    tokens = torch.arange(32).reshape(2, 16) % 128
    with torch.no_grad():
        logits = model(tokens)
    torch.save(logits, f"{out}.{rank}")


@pytest.mark.xdist_group("hf")
def test_pretrained_safetensors_load_shard_by_shard(tmp_path: Path) -> None:
    """A Llama saved with random weights: each rank reads its rows of the safetensors, and the
    sharded model's logits are ``from_pretrained``'s (the seed differs from the saved
    weights', so an unread weight would show)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(123)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    out = tmp_path / "logits"
    on_ranks(_pretrained_logits, 2, str(tmp_path / "llama"), str(out))
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    with torch.no_grad():
        want = pretrained(input_ids=torch.arange(32).reshape(2, 16) % 128).logits
    for rank in range(2):
        assert torch.allclose(torch.load(f"{out}.{rank}", weights_only=True), want,
                              rtol=0, atol=1e-5)


class ReadsValues(nn.Module):
    """A model whose constructor branches on its weights' values: not buildable on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        if self.blocks[0].weight.abs().sum().item() > 0:
            nn.init.normal_(self.blocks[1].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def reads_values(**_fields: object) -> ReadsValues:
    """The entry point ``model.name: tests.distributed.test_fsdp_settings:reads_values``."""
    return ReadsValues()


ENTRY_POINT = "tests.distributed.test_fsdp_settings:reads_values"


def _falls_back(rank: int, out: str) -> None:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainer.models.build").addHandler(handler)
    factory = partial(create_model, ENTRY_POINT)
    model = build_sharded(factory, MemoryTransforms(), torch.device("cpu"), 9,
                          FsdpSettings(), model_name=ENTRY_POINT)
    want = build_model(factory, MemoryTransforms(), seed=9).state_dict()
    same = all(torch.equal(t.full_tensor(), want[name])
               for name, t in model.state_dict().items())
    torch.save({"records": records, "same": same}, f"{out}.{rank}")


def test_a_model_that_cannot_be_built_on_meta_is_built_on_the_host(tmp_path: Path) -> None:
    out = tmp_path / "fallback"
    on_ranks(_falls_back, 2, str(out))
    result = torch.load(f"{out}.0", weights_only=True)
    assert result["same"]
    [line] = result["records"]
    assert f"{ENTRY_POINT!r} cannot be built on the meta device" in line
    assert "building it whole on the host" in line
