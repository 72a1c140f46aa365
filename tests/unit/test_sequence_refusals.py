"""What sequence parallelism refuses rather than trains wrong, in one process: tiny Hugging Face
models split with ``SequenceShapes`` (one rank's shapes, no group) run their forward through
``hf_attention``, so each refusal shows at the point a real split would meet it. Attention sinks
(``s_aux``), a module that mixes tokens outside attention, ``longrope`` factors that depend on a
rank's positions and a sliding window shorter than the row are refused in one line naming the
class, the module or the value; the models attention alone mixes, and a window that covers the
row, are taken. The global batch's refusal under sequence groups names the data ranks and the
worker counts that fit. In the "hf" xdist group with the other tests that import transformers.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from trainer.global_batch import accumulation_steps, per_rank_batch
from trainer.models.hf import HFCausalLM
from trainer.parallel.sequence import SequenceShapes, split_model

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group("hf")]

_T = 16  # the whole row; each of the 2 ranks holds 8 of its tokens
_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=_T)


def _model(kind: str, **fields: Any) -> HFCausalLM:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(**fields)
    return HFCausalLM(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def _split_forward(model: HFCausalLM, seq_len: int = _T) -> torch.Tensor:
    """Rank 0's logits of a row of ``seq_len`` tokens split over 2 ranks."""
    split_model(model, SequenceShapes(2))
    return model(torch.zeros(1, seq_len // 2, dtype=torch.long))


def test_attention_sinks_are_refused_naming_the_argument() -> None:
    model = _model("GptOss", **_COMMON, head_dim=8, num_local_experts=1, num_experts_per_tok=1,
                   layer_types=["full_attention"] * 2, sliding_window=128)
    with pytest.raises(ValueError) as refused:
        _split_forward(model)
    assert str(refused.value) == ("GptOssAttention: attention argument s_aux (Parameter) is not "
                                  "supported under sequence parallelism")


@pytest.mark.parametrize("layer_types,said", [
    (["conv", "full_attention"], "model.layers.0.conv (Lfm2ShortConv)"),
    # no convolution module, and a layer type that is not attention
    (["full_attention", "linear_attention"], "config.layer_types[1] 'linear_attention'"),
], ids=["conv", "layer-type"])
def test_a_model_mixing_tokens_outside_attention_is_refused_naming_the_module(
        layer_types: list[str], said: str) -> None:
    fields = dict(_COMMON, block_auto_adjust_ff_dim=False)
    if "conv" not in layer_types:  # Lfm2 builds a convolution for every layer not attention
        model = _model("Lfm2", **fields, layer_types=["full_attention"] * 2)
        model.hf.config.layer_types = layer_types
    else:
        model = _model("Lfm2", **fields, layer_types=layer_types)
    with pytest.raises(ValueError) as refused:
        split_model(model, SequenceShapes(2))
    assert str(refused.value) == (f"Lfm2ForCausalLM: {said} mixes tokens outside attention, "
                                  "which sequence parallelism would run on each rank's slice "
                                  "alone")


@pytest.mark.parametrize("kind,fields", [
    ("GPT2", dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=_T)),
    ("Llama", _COMMON), ("Mistral", _COMMON), ("Qwen2", _COMMON),
    ("Qwen3", dict(_COMMON, head_dim=8)), ("Phi3", dict(_COMMON, pad_token_id=0)),
    ("Gemma", dict(_COMMON, head_dim=8)),
    ("Lfm2", dict(_COMMON, block_auto_adjust_ff_dim=False, layer_types=["full_attention"] * 2)),
], ids=lambda value: value if isinstance(value, str) else "")
def test_models_only_attention_mixes_are_split(kind: str, fields: dict[str, Any]) -> None:
    assert _split_forward(_model(kind, **fields)).shape == (1, _T // 2, 64)


@pytest.mark.parametrize("checkpointing,tiles", [("full", 1), ("none", 4), ("full", 2)])
def test_layers_wrapped_by_the_memory_transforms_are_split(checkpointing: str,
                                                           tiles: int) -> None:
    """The split comes after the memory transforms (``Parallelism.build``'s order): layers
    wrapped by activation checkpointing or the tiled MLP are still found and checked."""
    from trainer.models.build import MemoryTransforms, apply_transforms

    model = _model("Llama", **_COMMON)
    apply_transforms(model, MemoryTransforms(activation_checkpointing=checkpointing,
                                             tiled_mlp=tiles))
    assert _split_forward(model).shape == (1, _T // 2, 64)


def test_longrope_is_refused_where_a_row_reaches_past_its_original_length() -> None:
    rope = {"rope_type": "longrope", "rope_theta": 100.0, "short_factor": [1.0] * 4,
            "long_factor": [4.0] * 4, "original_max_position_embeddings": _T // 2}
    model = _model("Llama", **_COMMON, rope_parameters=rope)
    # a row of 8: every rank's positions and the whole row's pick the short factors
    assert _split_forward(model, _T // 2).shape == (1, _T // 4, 64)
    with pytest.raises(ValueError) as refused:
        model(torch.zeros(1, _T // 2, dtype=torch.long))
    assert str(refused.value) == ("LlamaAttention: rope_type 'longrope' under sequence "
                                  "parallelism needs seq_len 16 at most "
                                  "original_max_position_embeddings 8 (each rank picks its "
                                  "factors from its own positions)")


def _unsplit_logits(sliding_window: int | None) -> torch.Tensor:
    model = _model("Mistral", **_COMMON, sliding_window=sliding_window)
    model.hf.set_attn_implementation("sdpa")
    return model(torch.arange(_T).unsqueeze(0) % 64)


@pytest.mark.parametrize("sliding_window", [4096, _T, _T - 1])
def test_a_sliding_window_is_taken_where_it_covers_the_row(sliding_window: int) -> None:
    # transformers' own windows: one of the row's length masks nothing, one shorter does
    covers = torch.equal(_unsplit_logits(sliding_window), _unsplit_logits(None))
    assert covers == (sliding_window >= _T)
    model = _model("Mistral", **_COMMON, sliding_window=sliding_window)
    if covers:
        assert _split_forward(model).shape == (1, _T // 2, 64)
        return
    with pytest.raises(ValueError) as refused:
        _split_forward(model)
    assert str(refused.value) == (f"MistralAttention: sliding_window {_T - 1} is shorter than "
                                  f"seq_len {_T}, which sequence parallelism attends whole (a "
                                  "window of at least seq_len is taken)")


def test_the_global_batch_refusal_names_data_ranks_and_worker_counts_that_fit() -> None:
    data_ranks = "data ranks (workers / parallel.sequence 2)"
    with pytest.raises(ValueError) as refused:
        accumulation_steps(5, 1, 2, sequence=2)  # 4 workers in groups of 2
    assert str(refused.value) == (f"train.global_batch_size (5) must be a multiple of "
                                  f"train.micro_batch_size x {data_ranks} (1 x 2); workers "
                                  "that keep this global batch: 2, 10")
    with pytest.raises(ValueError) as refused:
        accumulation_steps(5, 2, 1, sequence=2)
    assert str(refused.value).endswith(f"x {data_ranks} (2 x 1); no number of workers keeps "
                                       "it: train.micro_batch_size (2) does not divide it")
    with pytest.raises(ValueError, match=re.escape(f"multiple of the {data_ranks} (2)")):
        per_rank_batch(5, 2, sequence=2)
    assert accumulation_steps(8, 2, 2, sequence=2) == 2
