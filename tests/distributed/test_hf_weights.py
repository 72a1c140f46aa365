"""The sharded loader against ``from_pretrained``: on 2 gloo ranks each rank reads its rows of an
``hf:`` directory's safetensors (``trainer.parallel.fsdp.build_sharded``), and the sharded model's
logits are the ones ``AutoModelForCausalLM.from_pretrained`` gives, for the families whose files
differ in how they name and tie their tensors, and mixtures of experts whose files store the
experts one by one; a file that does not fit the model is refused in one
line naming the tensor, not cut to fit."""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("hf")]

# memtrain's model fields (the GPT's, which an hf: model ignores); the data's vocabulary.
_FIELDS = {"vocab_size": 96, "seq_len": 16}
_SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def _families(transformers) -> dict:
    """Each family as the files a user would have: tied and untied Llama, GPT-2 saved from its
    base model (keys without ``transformer.``, as the hub's gpt2 files are), GPT-NeoX (its
    own names, an untied ``embed_out``), Qwen2 (attention biases) and Mistral."""
    return {
        "llama-tied": (transformers.LlamaConfig(**_SMALL, tie_word_embeddings=True), False),
        "llama": (transformers.LlamaConfig(**_SMALL, tie_word_embeddings=False), False),
        "gpt2-base": (transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                              n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                              attn_pdrop=0.0), True),
        "gpt-neox": (transformers.GPTNeoXConfig(vocab_size=96, hidden_size=32,
                                                intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=4,
                                                max_position_embeddings=64,
                                                tie_word_embeddings=False), False),
        "qwen2": (transformers.Qwen2Config(**_SMALL), False),
        "mistral": (transformers.MistralConfig(**_SMALL), False),
        **_mixtures_of_experts(transformers),
    }


def _mixtures_of_experts(transformers) -> dict:
    """Mixtures of experts whose files store each expert's projections apart, which
    ``from_pretrained`` stacks into fused 3-D tensors (gate and up joined): Qwen3-MoE (8
    experts, 4 per rank), Qwen2-MoE with a shared expert (3 experts: 2 and 1 per rank) and
    Mixtral (its own names, ``block_sparse_moe.experts.N.w1``)."""
    moe = {**_SMALL, "intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "moe_intermediate_size": 16, "num_experts_per_tok": 2, "tie_word_embeddings": False}
    return {
        "qwen3-moe": (transformers.Qwen3MoeConfig(**moe, num_experts=8, head_dim=8), False),
        "qwen2-moe": (transformers.Qwen2MoeConfig(**moe, num_experts=3,
                                                  shared_expert_intermediate_size=24), False),
        "mixtral": (transformers.MixtralConfig(**{**_SMALL, "intermediate_size": 16},
                                               num_local_experts=4, num_experts_per_tok=2),
                    False),
    }


def _save(tmp_path: Path) -> dict[str, Path]:
    """Each family's random weights saved as ``save_pretrained`` saves them."""
    import transformers

    directories = {}
    for i, (name, (config, base_only)) in enumerate(_families(transformers).items()):
        torch.manual_seed(100 + i)
        model = transformers.AutoModelForCausalLM.from_config(config)
        directory = tmp_path / name
        if base_only:  # the base model's files, with the causal LM's config beside them
            model.base_model.save_pretrained(directory)
            config.save_pretrained(directory)
        else:
            model.save_pretrained(directory)
        directories[name] = directory
    return directories


def _save_hrm(tmp_path: Path) -> Path:
    """A tiny HRM text model, whose files hold a projection transformers chunks as it loads."""
    import transformers

    config = type(transformers.AutoConfig.for_model("hrm_text"))(**{
        **_SMALL, "num_key_value_heads": 4, "tie_word_embeddings": False})
    torch.manual_seed(7)
    directory = tmp_path / "hrm"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def _load_sharded(rank: int, directories: dict[str, str], tokens: torch.Tensor,
                  out: str) -> None:
    """Every family built sharded on the meta device and filled from its files, then run."""
    from trainer.models.build import MemoryTransforms
    from trainer.models.hf import weights_of
    from trainer.models.registry import create_model
    from trainer.parallel.fsdp import FsdpSettings, build_sharded

    results: dict[str, object] = {}
    for name, directory in directories.items():
        spec = f"hf:{directory}"
        try:
            model = build_sharded(partial(create_model, spec, load_weights=False, **_FIELDS),
                                  MemoryTransforms(), torch.device("cpu"), seed=3,
                                  settings=FsdpSettings(), model_name=spec,
                                  weights=weights_of(spec))
            with torch.no_grad():
                results[name] = model(tokens)
        except ValueError as err:
            results[name] = str(err)
    if rank == 0:
        torch.save(results, out)


def _from_pretrained(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_the_sharded_loader_gives_from_pretrained_s_logits_or_refuses(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from tests.gloo import on_ranks

    directories = _save(tmp_path)
    # A file whose embedding has more rows than its config's vocabulary (a resized tokenizer):
    # from_pretrained refuses it; a slice of the rows a rank owns would cut it to fit.
    wide = tmp_path / "llama-wide"
    wide.mkdir()
    (wide / "config.json").write_text((directories["llama"] / "config.json").read_text())
    tensors = load_file(directories["llama"] / "model.safetensors")
    tensors["model.embed_tokens.weight"] = torch.randn(128, 32)
    save_file(tensors, wide / "model.safetensors", metadata={"format": "pt"})
    # A file of another architecture's names: nothing of the model's is in it.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text((directories["llama"] / "config.json").read_text())
    save_file({"encoder.weight": torch.zeros(2, 2)}, foreign / "model.safetensors")
    # Two tensors under a config that ties them, the same but in rank 1's rows: from_pretrained
    # unties them (both are present and differ); a tied fill would take one of the two for both,
    # and every rank must refuse, rank 0 too, which sees its rows agree.
    conflict = tmp_path / "llama-tied-conflict"
    conflict.mkdir()
    config = json.loads((directories["llama"] / "config.json").read_text())
    (conflict / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tensors = load_file(directories["llama"] / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["lm_head.weight"][48:] += 1.0  # rank 1's rows of 96 (torch.chunk's split)
    save_file(tensors, conflict / "model.safetensors", metadata={"format": "pt"})
    # Experts stored one by one, one expert's up projection missing in a layer: refused in one
    # line, not left to the model's initialisation.
    gap = tmp_path / "qwen3-moe-gap"
    gap.mkdir()
    (gap / "config.json").write_text((directories["qwen3-moe"] / "config.json").read_text())
    experts = load_file(directories["qwen3-moe"] / "model.safetensors")
    del experts["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(experts, gap / "model.safetensors", metadata={"format": "pt"})
    # The last expert missing: the files stack to fewer experts than the model has.
    short = tmp_path / "qwen3-moe-short"
    short.mkdir()
    (short / "config.json").write_text((directories["qwen3-moe"] / "config.json").read_text())
    experts = load_file(directories["qwen3-moe"] / "model.safetensors")
    save_file({name: tensor for name, tensor in experts.items() if ".experts.7." not in name},
              short / "model.safetensors", metadata={"format": "pt"})
    # A conversion that is not experts stacked (HRM's fused projection, which transformers
    # chunks as it loads): refused, not read.
    hrm = _save_hrm(tmp_path)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "results.pt"
    on_ranks(_load_sharded, 2, {name: str(d) for name, d in
                                {**directories, "llama-wide": wide, "foreign": foreign,
                                 "conflict": conflict, "gap": gap, "short": short,
                                 "hrm": hrm}.items()}, tokens, str(out))
    results = torch.load(out, weights_only=True)
    for name, directory in directories.items():
        assert isinstance(results[name], torch.Tensor), f"{name}: {results[name]}"
        torch.testing.assert_close(results[name], _from_pretrained(directory, tokens),
                                   rtol=1e-5, atol=1e-5, msg=name)
    assert results["gap"] == (
        f"{gap}: model.layers.1.mlp.experts.gate_up_proj's experts are not all in its "
        "safetensors (mlp.experts.*.gate_proj.weight, mlp.experts.*.up_proj.weight: expected "
        "experts 0 to 7 of each)")
    assert results["short"] == (
        f"{short}: model.layers.0.mlp.experts.gate_up_proj, 7 experts stored as "
        "mlp.experts.*.gate_proj.weight and mlp.experts.*.up_proj.weight, has shape [7, 32, 32] "
        "in its safetensors, the model's model.layers.0.mlp.experts.gate_up_proj [8, 32, 32]")
    assert re.fullmatch(rf"{re.escape(str(hrm))}: \S+ is converted as transformers loads it "
                        r"\('[^']+': Chunk\), which a read of its rows cannot do",
                        results["hrm"]), results["hrm"]
    assert results["llama-wide"] == (f"{wide}: model.embed_tokens.weight has shape [128, 32] "
                                     "in its safetensors, the model's "
                                     "model.embed_tokens.weight [96, 32]")
    assert results["conflict"] == (
        f"{conflict}: model.embed_tokens.weight and lm_head.weight are one tensor in the model "
        "(its config ties them) but differ in its safetensors, where from_pretrained unties "
        "them: set tie_word_embeddings false in its config.json")
    import transformers  # what the reference makes of it: both tensors, untied

    untied = transformers.AutoModelForCausalLM.from_pretrained(conflict)
    assert torch.equal(untied.lm_head.weight, tensors["lm_head.weight"])
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    assert results["foreign"] == (f"{foreign}: none of the model's parameters is in its "
                                  "safetensors (they load into a model of the same "
                                  "architecture)")
