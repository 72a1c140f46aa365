"""The memory strategies on two gloo ranks, under DDP and FSDP: the step in backward (DDP: in its
communication hook after each bucket's all-reduce; FSDP: after its reduce-scatter) steps to the
same losses as the step after backward; 8-bit states (quantized DTensor moments through DCP)
and LoRA (adapters only in DCP) resume exactly; bf16 weights follow bf16 autocast and resume
exactly; LoRA follows DDP under FSDP; a Hugging Face
model's LoRA run exports a PEFT adapter directory and a merged model that give its logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import logged_losses, tiny_config
from tests.gloo import on_ranks
from trainer.checkpoint.files import load_tensors
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run

pytestmark = pytest.mark.distributed
WHOLE_BATCH = ("train.grad_clip=0", "train.micro_batch_size=8")  # no accumulation on 2 ranks


def _runner(corpus_dir: Path, tmp_path: Path, *common: str):  # noqa: ANN202
    def run(name: str, *overrides: str, until: int | None = None) -> Path:
        cfg, run_dir = prepare_run(tiny_config(
            corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=2",
            "train.eval_every=0", "train.log_every=1", "train.steps=8",
            "train.checkpoint_every=4", *common, *overrides, f"run.name={name}"))
        launch_local(cfg, run_dir, until_step=until)
        return run_dir
    return run


def test_the_step_in_backward_follows_the_step_after_it_under_ddp_and_fsdp(
        corpus_dir: Path, tmp_path: Path) -> None:
    """The same losses to the bit, DDP and FSDP alike (FSDP's reduce-scatter gives DDP's
    gradients here), and FSDP's in-backward run resumes exactly from its DCP checkpoint."""
    run = _runner(corpus_dir, tmp_path, *WHOLE_BATCH)
    after = logged_losses(run("after"))
    in_backward = "memory.optimizer_in_backward=true"
    assert logged_losses(run("ddp", in_backward)) == after
    run("fsdp", in_backward, "parallel.strategy=fsdp", until=4)
    assert logged_losses(run("fsdp", in_backward, "parallel.strategy=fsdp")) == after


def test_8bit_states_and_lora_resume_exactly_under_fsdp(corpus_dir: Path,
                                                        tmp_path: Path) -> None:
    """DCP checkpoints of quantized moments (DTensors of torchao's subclass) and of a LoRA
    model's adapters (its frozen base left out) resume to the bit; LoRA's losses under FSDP are
    DDP's."""
    run = _runner(corpus_dir, tmp_path, "parallel.strategy=fsdp", "train.steps=4",
                  "train.checkpoint_every=2")
    for name, strategy in (("8bit", "memory.optimizer_states=8bit"),
                           ("lora", "model.lora.rank=4")):
        straight = logged_losses(run(f"{name}-straight", strategy))
        run(name, strategy, until=2)
        assert logged_losses(run(name, strategy)) == straight, name
    lora = tmp_path / "lora" / "checkpoint-00000004"
    adapter = "blocks.0.attn.qkv.lora_A.default.weight"
    assert load_tensors(lora, {adapter: torch.empty(4, 64)})[adapter].abs().sum() > 0
    with pytest.raises(BaseException) as missing:  # DCP: a CheckpointException, per rank
        load_tensors(lora, {"blocks.0.attn.qkv.base_layer.weight":
                                    torch.empty(192, 64)})
    assert "Missing key in checkpoint state_dict: model.blocks.0.attn.qkv.base_layer" in \
        repr(getattr(missing.value, "failures", missing.value))
    ddp = logged_losses(run("lora-ddp", "model.lora.rank=4", "parallel.strategy=ddp"))
    assert logged_losses(tmp_path / "lora") == pytest.approx(ddp, rel=1e-5)


def test_bf16_weights_follow_mixed_precision_and_resume_exactly_under_fsdp(
        corpus_dir: Path, tmp_path: Path) -> None:
    """``model.dtype: bf16`` (no fp32 copy, updates stochastically rounded) follows bf16
    autocast over fp32 weights, DDP and FSDP with the step in backward alike, and FSDP's run
    resumes to the bit (the rounding's random draws come from the checkpointed RNG).

    Tolerance: bf16 keeps 8 significant bits, a relative 2^-9 (0.2%) per rounding; the weights
    start as the fp32 build's rounded, and each of the 8 steps rounds every weight once more
    (stochastically: no drift in expectation), so 1% of the loss is five such roundings all
    in one direction. Seen here: 0.04%."""
    run = _runner(corpus_dir, tmp_path, *WHOLE_BATCH, "memory.precision=bf16",
                  "memory.optimizer_states=8bit")
    mixed = logged_losses(run("mixed"))
    bf16 = ("model.dtype=bf16",)
    assert logged_losses(run("ddp", *bf16)) == pytest.approx(mixed, rel=0.01)
    fsdp = (*bf16, "parallel.strategy=fsdp", "memory.optimizer_in_backward=true")
    straight = logged_losses(run("fsdp-straight", *fsdp))
    assert straight == pytest.approx(mixed, rel=0.01)
    assert straight != mixed  # the weights are not fp32 ones
    run("fsdp", *fsdp, until=4)
    assert logged_losses(run("fsdp", *fsdp)) == straight
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "fsdp" / "checkpoint-00000008")).read_metadata()
    weights = {k: v.properties.dtype for k, v in saved.state_dict_metadata.items()
               if k.startswith("model.") and k.endswith(".weight")}
    assert weights and set(weights.values()) == {torch.bfloat16}, weights


@pytest.mark.xdist_group("hf")
def test_a_hf_lora_run_exports_adapters_and_a_merged_model_with_its_logits(
        corpus_dir: Path, tmp_path: Path) -> None:
    """A Llama with weights of its own, LoRA on 2 FSDP ranks: ``PeftModel.from_pretrained`` on
    the base with the exported adapter directory, and ``from_pretrained`` of the ``--merge``
    export, give the trained model's logits, which differ from the base's."""
    import transformers
    from peft import PeftModel

    from trainer.checkpoint.export import export_hf
    from trainer.config import load_config
    from trainer.models.build import MemoryTransforms, build_model, model_factory

    torch.manual_seed(0)
    base_dir = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )).save_pretrained(base_dir)
    run = _runner(corpus_dir, tmp_path, f"model.name=hf:{base_dir}", "train.lr=0.02",
                  "memory.loss_chunk_tokens=64", "memory.activation_checkpointing=selective",
                  "model.lora.rank=4", "parallel.strategy=fsdp")
    run_dir = run("hf-lora")
    export_hf(run_dir, tmp_path / "adapter")
    export_hf(run_dir, tmp_path / "merged", merge=True)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= \
        {p.name for p in (tmp_path / "adapter").iterdir()}
    # The trained model as memtrain builds it, with the checkpoint's adapters.
    cfg = load_config(run_dir / "config.yaml")
    trained = build_model(model_factory(cfg.model), MemoryTransforms(), seed=cfg.run.seed)
    adapters = {n: torch.empty_like(t) for n, t in trained.state_dict().items() if ".lora_" in n}
    trained.load_state_dict(load_tensors(run_dir / "checkpoint-00000008", adapters),
                            strict=False)
    tokens_BT = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    auto = transformers.AutoModelForCausalLM
    with torch.no_grad():
        expected = trained.eval()(tokens_BT)
        base = auto.from_pretrained(base_dir).eval()
        base_logits = base(tokens_BT).logits
        peft_logits = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(
            tokens_BT).logits
        merged_logits = auto.from_pretrained(tmp_path / "merged").eval()(tokens_BT).logits
    assert not torch.allclose(expected, base_logits, atol=1e-3)
    torch.testing.assert_close(peft_logits, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(merged_logits, expected, rtol=1e-4, atol=1e-4)


def _low_bit_steps(rank: int, states: str) -> None:
    """Two AdamW steps with ``states`` moments on a linear layer's weight as FSDP2's DTensor
    shards (as an FSDP run's optimizer sees them), and on another's as a plain tensor (one
    process's and DDP's)."""
    from torch.distributed.fsdp import fully_shard

    from trainer.memory.optimizers import make_adamw

    torch.manual_seed(0)
    for sharded in (True, False):
        model = torch.nn.Linear(256, 512, bias=False)  # 64 blocks of 256 a rank
        if sharded:
            fully_shard(model)
        optimizer = make_adamw([{"params": list(model.parameters())}], 1e-3,
                               (0.9, 0.95), states)
        for _ in range(2):
            model(torch.randn(4, 256)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        weight = model.weight.detach()
        assert bool(torch.isfinite(weight.full_tensor() if sharded else weight).all())


def test_both_low_bit_state_formats_step_from_one_inductor_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao's AdamW step is compiled, and every run of a user shares inductor's on-disk
    cache: each state format steps after the other, in either order, in fresh processes over
    one cache directory (the test's own), on FSDP's shards and on plain tensors."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    for states in ("8bit", "4bit", "8bit"):
        on_ranks(_low_bit_steps, 1, states)
