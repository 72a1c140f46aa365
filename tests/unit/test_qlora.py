"""QLoRA: LoRA over a base whose blocks' linear weights are NF4 (``model.lora.base_dtype: nf4``).

Held against the ecosystem's own pieces: torchao's ``NF4Tensor`` (what the base holds and how
it computes) and PEFT's ``merge_and_unload`` over the same dequantized base (the merged export).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, prepared_local_run, tiny_config
from trainer.config import ConfigError

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group("hf")]


def _nf4_gpt(n_embd: int = 128, base_dtype: str = "nf4") -> torch.nn.Module:
    from trainer.config import LoraConfig, ModelConfig
    from trainer.models.build import model_factory

    cfg = ModelConfig(name="gpt", vocab_size=256, seq_len=32, n_layer=2, n_head=4,
                      n_embd=n_embd, lora=LoraConfig(rank=4, base_dtype=base_dtype))
    torch.manual_seed(0)
    return model_factory(cfg)()


def test_an_nf4_base_holds_4_bit_codes_and_computes_as_its_dequantized_weights() -> None:
    """Every linear layer of the blocks holds torchao's NF4 (about 0.52 bytes a weight, as
    the planner counts it); the logits equal those of the same model whose NF4 weights are
    replaced by their bf16 dequantization, to the bit; the adapters train in fp32."""
    from torchao.quantization import NF4Tensor

    from trainer.memory.nf4 import dequantize_base
    from trainer.plan.static import static_bytes

    model = _nf4_gpt()
    weights = {name: p for name, p in model.named_parameters() if name.endswith(
        "base_layer.weight")}
    assert len(weights) == 8 and all(isinstance(p, NF4Tensor) for p in weights.values())
    assert all(p.dtype == torch.float32 for name, p in model.named_parameters()
               if p.requires_grad)
    assert {p.dtype for name, p in model.named_parameters()
            if not p.requires_grad and name not in weights} == {torch.bfloat16}
    reference = copy.deepcopy(model)
    dequantize_base(reference)
    # Each layer's quantization error, as the run's log says it: NF4's 16 levels per block of
    # 64 Gaussian weights lose about a tenth of a weight's norm.
    errors = model.nf4_errors
    assert len(errors) == 8 and all(name.startswith("blocks.") and name.endswith(".base_layer")
                                    for name in errors)
    assert all(0.05 < error < 0.15 for error in errors.values()), errors
    assert not any(isinstance(p, NF4Tensor) for p in reference.parameters())
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)
    codes = static_bytes(model).params - static_bytes(reference).params
    quantized = sum(p.numel() for p in weights.values())
    assert codes == pytest.approx(quantized * (0.518 - 2), rel=0.01)


def test_an_nf4_layer_computes_as_torchaos_linear_nf4_in_a_third_of_its_bytes() -> None:
    """``Nf4Linear`` (what ``quantize_base`` makes of an nn.Linear) against torchao's own
    ``linear_nf4`` (an nn.Linear holding the same NF4 weight): the same output and input
    gradient to the bit under bf16 autocast, and the dequantized weight (also sliced into the
    error and the planner's count) equal to ``get_original_weight``; the allocator's record of
    a forward and backward about 4.5 bytes a weight (the bf16 weight and a slice's indices)
    against torchao's 14 (it dequantizes to the
    fp32 input's dtype and autocast casts that copy again), and the planner's count of it
    within 15%."""
    from trainer.memory.nf4 import Nf4Linear, dequantize, to_nf4
    from trainer.plan.terms.nf4 import nf4_dequantized_bytes
    from trainer.telemetry.diagnostics import cpu_peak_bytes

    torch.manual_seed(0)
    weight = to_nf4(torch.randn(2048, 1024) * 0.02)  # 8 of dequantize's slices
    assert torch.equal(dequantize(weight), weight.get_original_weight())
    torchaos = torch.nn.Linear(1024, 2048, bias=False)
    torchaos.weight = torch.nn.Parameter(weight, requires_grad=False)
    mine = copy.deepcopy(torchaos)
    mine.__class__ = Nf4Linear
    results, peaks = [], []
    for layer in (torchaos, mine):
        x = torch.randn(2, 8, 1024, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)

        def step(layer: torch.nn.Module = layer, x: torch.Tensor = x) -> torch.Tensor:
            with torch.autocast("cpu", torch.bfloat16):
                out = layer(x)
            out.float().square().sum().backward()
            return out

        results.append((step().detach(), x.grad))
        x.grad = None
        peaks.append(cpu_peak_bytes(step) / weight.numel())
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1],
                                                                      results[1][1])
    assert peaks[0] > 12 and peaks[1] < 5, peaks
    # the planner's count of it, drawn from two smaller layers
    assert nf4_dequantized_bytes(weight.numel()) == pytest.approx(peaks[1] * weight.numel(),
                                                                   rel=0.15)


@pytest.mark.slow
def test_a_layer_nf4_blocks_do_not_divide_stays_bf16_named_once_a_run(
        corpus_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A weight must fill NF4's blocks (64 values) and its scales' blocks (256 scales): at
    width 32 none does, so every one stays bf16, named in one warning line of the run's log,
    once, though the planner's probes build the model several times in the same process."""
    from torchao.quantization import NF4Tensor

    from trainer.launch.local import launch_local
    from trainer.launch.prepare import prepare_run
    from trainer.memory.nf4 import nf4_kept_in_bf16

    model = _nf4_gpt(n_embd=32)
    assert not any(isinstance(p, NF4Tensor) for p in model.parameters())
    line = nf4_kept_in_bf16(model)
    assert line is not None and line.startswith(
        "model.lora.base_dtype nf4: 8 linear layer(s) kept in bf16, their size not a multiple "
        "of 16384") and "blocks.0.attn.qkv" in line
    with caplog.at_level(logging.WARNING):
        cfg, run_dir = prepare_run(tiny_config(
            corpus_dir, tmp_path, "model.lora.rank=4", "model.lora.base_dtype=nf4",
            "model.n_embd=32", "memory.precision=bf16", "train.steps=1",
            "train.micro_batch_size=auto", "train.eval_every=0", "train.checkpoint_every=0",
            "parallel.launcher=local", "parallel.workers=1"))
        launch_local(cfg, run_dir)
    assert [r.getMessage() for r in caplog.records].count(line) == 1


def test_an_nf4_base_that_does_not_split_under_fsdp_is_refused_before_any_worker_starts(
        corpus_dir: Path, tmp_path: Path) -> None:
    """The launcher knows the shapes: width 128's qkv [384, 128] fills NF4's blocks whole but
    not in halves, so FSDP on 2 workers is refused by ``prepare_run``, naming it."""
    from trainer.launch.prepare import prepare_run

    with pytest.raises(ConfigError, match=r"^model\.lora\.base_dtype nf4 under FSDP on 2 "
                                          r"ranks: blocks\.0\.attn\.qkv\.base_layer \[384, 128\]"):
        prepare_run(tiny_config(corpus_dir, tmp_path, "model.lora.rank=4",
                                "model.lora.base_dtype=nf4", "model.n_embd=128",
                                "memory.precision=bf16", "parallel.strategy=fsdp",
                                "parallel.launcher=local", "parallel.workers=2"))


@pytest.mark.parametrize(("overrides", "message"), [
    (("memory.precision=fp32",), "model.lora.base_dtype 'nf4' with memory.precision 'fp32'"),
    (("memory.precision=bf16", "parallel.strategy=fsdp", "parallel.fsdp.param_dtype=fp32"),
     "model.lora.base_dtype 'nf4' with parallel.fsdp.param_dtype 'fp32'"),
])
def test_nf4_is_refused_in_one_line_where_it_cannot_run(corpus_dir: Path, tmp_path: Path,
                                                        overrides: tuple[str, ...],
                                                        message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(corpus_dir, tmp_path, "model.lora.rank=4", "model.lora.base_dtype=nf4",
                    *overrides)


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "strategy"), [(1, "ddp"), (2, "ddp"), (2, "fsdp")])
def test_qlora_trains_and_resumes_exactly(corpus_dir: Path, tmp_path: Path, workers: int,
                                          strategy: str) -> None:
    """Four steps straight against two, then two more from the checkpoint (which holds the
    adapters and their AdamW state alone; the NF4 base is built again from its seed): the
    same losses, to the bit, on one process, under DDP and under FSDP (width 256: each rank's
    rows of every layer fill NF4's blocks)."""
    _assert_resumes_exactly(corpus_dir, tmp_path, workers, "model.n_embd=256",
                            f"parallel.strategy={strategy}")


def _assert_resumes_exactly(corpus_dir: Path, tmp_path: Path, workers: int,
                            *overrides: str) -> None:
    """Four QLoRA steps straight, against two and then two more from the checkpoint: the same
    losses to the bit, and falling."""
    from trainer.launch.local import launch_local

    def run(name: str, until: int | None) -> list[float]:
        cfg, run_dir = prepared_local_run(tiny_config(
            corpus_dir, tmp_path, "model.lora.rank=4", "model.lora.base_dtype=nf4",
            "memory.precision=bf16", "train.steps=4", "train.log_every=1",
            "train.checkpoint_every=2", "train.eval_every=0", "parallel.launcher=local",
            f"parallel.workers={workers}", *overrides, f"run.name={name}"), workers)
        launch_local(cfg, run_dir, until_step=until)
        rows = (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, rows) if "loss" in r]

    straight = run("straight", None)
    run("resumed", 2)
    assert run("resumed", None) == straight
    assert len(straight) == 4 and straight[-1] < straight[0]


@pytest.mark.slow
def test_merged_export_is_peft_merge_over_the_same_dequantized_base(tmp_path: Path) -> None:
    """Three QLoRA steps of a tiny Llama, exported with ``--merge``: its logits equal PEFT's
    ``merge_and_unload`` of the adapter export over the pretrained base whose linear weights
    went through the same NF4 round trip, weight for weight (the export is bf16, merged as PEFT
    merges in bf16)."""
    import transformers
    from peft import PeftModel
    from torchao.quantization import to_nf4

    from datapipe.convert import write_dataset
    from tests.unit.test_export_reference import memtrain
    from trainer.config import load_config
    from trainer.launch.local import launch_local
    from trainer.launch.prepare import prepare_run

    base = tmp_path / "llama"
    torch.manual_seed(1234)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    )).save_pretrained(base)
    rows = tmp_path / "rows.jsonl"
    generator = torch.Generator().manual_seed(2)
    rows.write_text("".join(json.dumps({"tokens": torch.randint(0, 256, (65,), generator=
                                                                generator).tolist()}) + "\n"
                            for _ in range(32)))
    write_dataset([rows], tmp_path / "data", "jsonl", seq_len=64)
    cfg, run_dir = prepare_run(load_config(REPO / "configs" / "demo-cpu.yaml", [
        f"model.name=hf:{base}", "model.lora.rank=4", "model.lora.base_dtype=nf4",
        "model.seq_len=64", f"data.path={tmp_path / 'data'}",
        f"data.val_path={tmp_path / 'data'}",
        f"run.dir={tmp_path}", "run.name=qlora", "train.steps=3", "train.global_batch_size=2",
        "train.micro_batch_size=2", "train.warmup_steps=1", "train.lr=0.02",
        "train.eval_every=0", "train.checkpoint_every=3", "memory.precision=bf16",
        "memory.activation_checkpointing=none", "parallel.launcher=local",
        "parallel.workers=1"]))
    launch_local(cfg, run_dir)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert memtrain("export", str(run_dir), "--hf", str(adapter)) == 0
    assert memtrain("export", str(run_dir), "--hf", str(merged), "--merge") == 0

    auto = transformers.AutoModelForCausalLM
    dequantized = auto.from_pretrained(base, torch_dtype=torch.bfloat16)
    for layer in dequantized.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data = to_nf4(module.weight.data, 64, 256).get_original_weight()
    tokens_BT = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = dequantized.eval()(tokens_BT).logits.float()
    reference = PeftModel.from_pretrained(dequantized, adapter).merge_and_unload().eval()
    ours = auto.from_pretrained(merged).eval()
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        expected, got = reference(tokens_BT).logits.float(), ours(tokens_BT).logits.float()
    moved = (expected - before).abs().max().item()  # what three steps did to the logits
    assert moved > 0.05, moved
    # the same bf16 merge of the same dequantized base: every weight, and so the logits, equal
    mine, theirs = ours.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == []
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_planner_counts_an_nf4_base_and_shows_it_beside_the_others(
        corpus_dir: Path, tmp_path: Path) -> None:
    """``memtrain plan`` on a LoRA config lists the other base dtypes; the NF4 base's static
    bytes are its codes and scales (the blocks' linear weights at about 0.52 bytes a weight
    against bf16's 2), the rest as bf16's."""
    from trainer.plan.auto import config_static
    from trainer.plan.table import lora_base_variants, with_fields

    cfg = tiny_config(corpus_dir, tmp_path, "model.n_embd=128", "model.lora.rank=4",
                      "memory.precision=bf16")
    assert [label for label, _ in lora_base_variants(cfg, "bf16")] == \
        ["LoRA base bf16", "LoRA base nf4 (QLoRA)"]
    assert [label for label, _ in lora_base_variants(cfg, "fp32")] == []
    bf16, nf4 = (config_static(with_fields(cfg, fields))
                 for _, fields in lora_base_variants(cfg, "bf16"))
    linear = 2 * (128 * 384 + 128 * 128 + 128 * 512 + 512 * 128)  # two blocks' base weights
    assert bf16.params - nf4.params == pytest.approx(linear * (2 - 0.518), rel=0.01)
    assert nf4.grads == bf16.grads and nf4.optimizer == bf16.optimizer  # the adapters'


def test_ddp_wraps_an_nf4_base_without_quantizing_it_again(tmp_path: Path) -> None:
    """DDP's first broadcast would copy each NF4 weight through its dequantized values and
    quantize it again (another base than one process trains); the NF4 base is left out of
    it, as every rank builds it alike."""
    from tests.gloo import one_rank_group
    from trainer.parallel.ddp import DataParallel
    from trainer.parallel.mesh import Mesh

    model = _nf4_gpt()
    before = {name: p.get_original_weight().clone() for name, p in model.named_parameters()
              if hasattr(p, "get_original_weight")}
    with one_rank_group(tmp_path):
        wrapped = DataParallel(Mesh()).wrap(model, torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad]))
    after = dict(wrapped.module.named_parameters())
    assert len(before) == 8
    for name, weight in before.items():
        assert torch.equal(after[name].get_original_weight(), weight), name


def test_an_nf4_base_from_init_from_is_quantized_once_from_the_files(tmp_path: Path) -> None:
    """``train.init_from: hf:DIR`` over a config-only ``model.name``: the base is quantized
    from the directory's weights (not the seeded ones, then again), so its NF4 codes and its
    logged error equal those of ``model.name: hf:DIR``'s own weights."""
    import shutil

    import transformers

    from trainer.config import LoraConfig, ModelConfig
    from trainer.models.build import MemoryTransforms, build_whole

    base, bare = tmp_path / "llama", tmp_path / "bare"
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )).save_pretrained(base)
    bare.mkdir()
    shutil.copy(base / "config.json", bare / "config.json")

    def build(name: Path, init_from: str | None) -> torch.nn.Module:
        cfg = ModelConfig(name=f"hf:{name}", seq_len=64,
                          lora=LoraConfig(rank=4, base_dtype="nf4"))
        return build_whole(cfg, init_from, MemoryTransforms(), seed=0)

    direct, loaded = build(base, None), build(bare, f"hf:{base}")
    assert loaded.nf4_errors == pytest.approx(direct.nf4_errors, rel=1e-6)
    assert loaded.lora_settings.base_dtype == "nf4"
    codes = {n: p.get_original_weight() for n, p in direct.named_parameters()
             if hasattr(p, "get_original_weight")}
    assert len(codes) == 7
    for name, param in loaded.named_parameters():
        if name in codes:
            assert torch.equal(param.get_original_weight(), codes[name]), name


def test_a_model_whose_blocks_hold_no_linear_layer_is_refused(tmp_path: Path) -> None:
    """GPT-2's blocks hold transformers' Conv1D, not nn.Linear: an NF4 base would quantize
    nothing, so it is refused in one line rather than trained as a bf16 base."""
    import transformers

    from trainer.memory.lora import LoraSettings, apply_lora
    from trainer.models.hf import HFCausalLM

    gpt2 = HFCausalLM(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=128, n_layer=1, n_head=4)))
    with pytest.raises(ValueError, match=r"^model.lora.base_dtype nf4: HFCausalLM's blocks hold "
                                         r"no nn.Linear layer"):
        apply_lora(gpt2, LoraSettings(rank=4, targets=("c_attn",), base_dtype="nf4"))


def test_auto_weighs_sharding_an_nf4_base(corpus_dir: Path, tmp_path: Path) -> None:
    """An NF4 base shards under FSDP (each rank quantizes its rows), so auto weighs both."""
    from trainer.plan.auto import sharding_candidates

    cfg = tiny_config(corpus_dir, tmp_path, "model.n_embd=128", "model.lora.rank=4",
                      "model.lora.base_dtype=nf4", "memory.precision=bf16",
                      "parallel.strategy=auto", "parallel.workers=2")
    assert [c.parallel.strategy for c in sharding_candidates(cfg)] == ["ddp", "fsdp"]


@pytest.mark.parametrize(("budget", "said"), [
    ("32MiB", "; model.lora.base_dtype nf4 (QLoRA) would fit, at a predicted peak of "),
    ("8MiB", "; nor with model.lora.base_dtype nf4 (QLoRA); "),
])
@pytest.mark.slow
def test_when_nothing_fits_auto_says_whether_an_nf4_base_would(budget: str, said: str) -> None:
    """``auto`` never switches a base to NF4 itself (it changes the arithmetic), but where
    nothing fits a LoRA config its refusal says whether ``base_dtype: nf4`` would (planned for
    a GPU from its datasheet, so the verdict holds on any CPU)."""
    from trainer.config import load_config
    from trainer.plan.auto import decide

    cfg = load_config(None, [
        "model.vocab_size=256", "model.seq_len=256", "model.n_layer=4", "model.n_embd=512",
        "model.n_head=4", "model.lora.rank=4", "model.lora.base_dtype=bf16",
        "parallel.use_gpu=true", "parallel.workers=1", "train.global_batch_size=4",
        "train.micro_batch_size=auto", "memory.precision=bf16", "train.grad_clip=0",
        "memory.activation_checkpointing=auto", "memory.optimizer_states=fp32",
        "memory.activation_offload=none", "memory.optimizer_in_backward=false",
        f"memory.device_memory={budget}"])
    with pytest.raises(ConfigError, match="^nothing fits ") as err:
        decide(cfg)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_low_bit_base_keeps_its_tied_embedding_and_its_layout_at_every_world_size() -> None:
    """Built on meta (``build_whole``), a bf16 or NF4 base keeps memtrain's GPT's tie of its
    embedding and output layer (one tensor, as the seeded build has it); under FSDP a layer one
    process quantizes but whose rank shards would not fill NF4's blocks is refused, naming it,
    rather than kept in bf16 on some world sizes only."""
    from trainer.config import LoraConfig, ModelConfig
    from trainer.memory.nf4 import quantize_base
    from trainer.models.build import MemoryTransforms, build_whole, model_factory

    for base in ("bf16", "nf4"):
        cfg = ModelConfig(name="gpt", vocab_size=256, seq_len=32, n_layer=2, n_head=4,
                          n_embd=128, lora=LoraConfig(rank=4, base_dtype=base))
        model = build_whole(cfg, None, MemoryTransforms(), seed=0)
        assert model.wte.weight is model.lm_head.weight, base
    bf16 = ModelConfig(name="gpt", vocab_size=256, seq_len=32, n_layer=1, n_head=4, n_embd=128,
                       lora=LoraConfig(rank=4, base_dtype="bf16"))
    with torch.device("meta"):
        shapes = model_factory(bf16)()
    with pytest.raises(ValueError, match=r"^model\.lora\.base_dtype nf4 under FSDP on 2 ranks: "
                                         r"blocks\.0\.attn\.qkv\.base_layer \[384, 128\] does "
                                         r"not split into whole NF4 blocks"):
        quantize_base(shapes, parts=2)


@pytest.mark.slow
def test_an_hf_llamas_qlora_resumes_exactly_under_fsdp(corpus_dir: Path, tmp_path: Path) -> None:
    """An ``hf:`` Llama read from its safetensors, QLoRA on 2 FSDP ranks (each quantizing its
    rows as it reads them): four steps straight against two, then two more from the checkpoint,
    the same losses to the bit."""
    import transformers

    base = tmp_path / "llama"
    torch.manual_seed(5)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    )).save_pretrained(base)
    _assert_resumes_exactly(corpus_dir, tmp_path, 2, f"model.name=hf:{base}",
                            "parallel.strategy=fsdp")
