"""What ``memtrain plan`` prints: the planner's inputs (probe time, the device's speed and the
calibration's age, the data loader's cost, static bytes, the loss), every precision and
checkpointing mode at the configured micro-batch, the memory strategies each added to the
configured plan (device, host, AdamW state, tokens/s), the fastest fitting plan of each with
``auto``'s decision marked (``trainer.plan.auto.decide``, as ``train`` takes it), and with
``--measure`` the fastest predicted plans run on this CPU beside their predictions.
"""

from __future__ import annotations

import time
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from monitoring.units import format_bytes
from trainer.config import ConfigError
from trainer.global_batch import micro_batch_candidates, per_rank_batch
from trainer.memory.loss import ChunkedLossShape
from trainer.models.build import MemoryTransforms, model_factory
from trainer.models.hf import model_vocab_size
from trainer.plan.auto import (
    bf16_weights,
    config_probe,
    config_static,
    data_ranks,
    decide,
    planned_precision,
    probe_config,
    request_from,
    speed_model,
)
from trainer.plan.calibrate import cpu_speed
from trainer.plan.candidates import HEADROOM, choose, feasible_plans
from trainer.plan.devices import GPU_COMPILED_SHARE
from trainer.plan.measure import measure_plan
from trainer.plan.peak import plan_row
from trainer.plan.probe import AC_MODES
from trainer.plan.speed import SpeedModel


def print_plan(console: Console, cfg: Any, budget: int, device_memory: str,
               gpu: str | None = None, calibrate: bool = False, measure_top: int = 0,
               measure_steps: int = 3) -> None:
    """``memtrain plan``'s output for ``cfg`` on devices of ``budget`` bytes (as the user
    wrote it: ``device_memory``), planned for ``gpu`` where the config trains on GPUs;
    ``calibrate``: this CPU measured again first; ``measure_top``: that many plans run."""
    from trainer.plan.auto import decide_sharding, describe, sharding_candidates

    if len(sharding_candidates(cfg)) > 1:  # the strategy first, as train resolves it
        cfg = decide_sharding(cfg.model_copy(update={"memory": cfg.memory.model_copy(
            update={"device_memory": str(budget)})}))
        console.print(f"auto: {describe(cfg)} (the log says why)")
    world = data_ranks(cfg)  # what the global batch divides over
    precisions = ["bf16"] if bf16_weights(cfg) else \
        ["fp32", "bf16"] + (["fp16"] if cfg.memory.precision == "fp16" else [])
    console.print(f"probing activations of {cfg.model.name} at seq_len {cfg.model.seq_len} "
                  f"({len(precisions) * len(AC_MODES)} probes, fake tensors on CPU)...")
    start = time.perf_counter()
    static, profiles = probe_config(cfg, precisions, AC_MODES, work=True)
    if calibrate:
        cpu_speed(refresh=True)  # cached: speed_model and --measure read it
    speed = speed_model(cfg, gpu, measure_data=True)
    print_inputs(console, cfg, speed, static, profiles, time.perf_counter() - start)
    if cfg.train.micro_batch_size != "auto":  # (auto: the fastest plans below search it)
        console.print(current_table(cfg, static, profiles, speed, budget))
    console.print("saved: activations kept for backward; temp.: the largest temporaries\n"
                  "beside them; peak: with parameters and AdamW state, at the moment named;\n"
                  "tokens/s: predicted, all workers together")
    if cfg.train.micro_batch_size != "auto":
        console.print(strategies_table(cfg, profiles, speed, budget))
    # The optimizer step in backward takes one micro-batch a step: the micro-batch is the
    # per-rank batch, not searched, and ``auto`` (which would search it) is refused there.
    in_backward = cfg.memory.optimizer_in_backward
    rows = feasible_plans(static, profiles, cfg.train.global_batch_size, world, budget,
                          speed=speed, choose_loss_chunk=cfg.memory.loss_chunk_tokens == "auto",
                          micro_batch_size=per_rank_batch(cfg.train.global_batch_size, world)
                          if in_backward else None)
    auto = None if in_backward else auto_plan(cfg, budget, speed, static, profiles)
    console.print(best_table(rows, auto, device_memory, cfg.train.global_batch_size)
                  if rows else f"[red]nothing fits {device_memory}[/]: use FSDP, a shorter "
                               "sequence or a smaller model")
    if sequence_degrees(cfg) != [1]:
        console.print(sequence_table(cfg, budget, speed, device_memory))
    if measure_top and rows:
        measure_plans(console, cfg, static, profiles, budget, measure_top, measure_steps)


def print_inputs(console: Console, cfg: Any, speed: Any, static: Any, profiles: list[Any],
                 seconds: float) -> None:
    """``memtrain plan``'s first lines: what the planner measured and from where."""
    compiled = f"; compiled, element-wise work x {GPU_COMPILED_SHARE}" if speed.compiled else ""
    console.print(f"probed in {seconds:.1f} s; speed: {speed.device.name} "
                  f"({speed.device.describe()}{compiled})")
    console.print(f"data loader: {speed.loader.source}, on {cfg.data.path}" if speed.loader
                  else f"data loader: not in the time model ({cfg.data.path} cannot be read "
                       "here)")
    console.print(f"per rank, {cfg.parallel.strategy} x {cfg.parallel.workers} workers: params "
                  f"{format_bytes(static.params)}, grads {format_bytes(static.grads)}, AdamW "
                  f"state {format_bytes(static.optimizer)}"
                  + (" (in host memory: CPU offload)" if static.offloaded else ""))
    if static.fsdp is not None:
        console.print(f"FSDP: {static.fsdp.describe()}")
    console.print(loss_line(profiles[0].loss_shape, cfg.memory.loss_chunk_tokens))


def current_table(cfg: Any, static: Any, profiles: list[Any], speed: Any, budget: int
                  ) -> Table:
    """Every precision and checkpointing mode at the configured micro-batch."""
    gib = 2**30
    micro, world = cfg.train.micro_batch(), data_ranks(cfg)
    accumulation = cfg.train.accumulation_steps(world)
    # Headers in two lines and no vertical rules: both tables fit an 80-column terminal.
    host = ("host\nGiB",) if static.sharded else ()  # FSDP: what CPU offload keeps there
    current = plan_table(f"configured micro-batch {micro} x accumulation {accumulation} x "
                          f"{world} workers",
                          "precision", "act.\nckpt", "saved\nGiB", "temp.\nGiB", "peak\nGiB",
                          *host, "peak at", "fits", "tokens/s")
    for profile in profiles:
        row = plan_row(static, profile, micro, accumulation, speed)
        host_cell = (f"{row.host_bytes / gib:.2f}",) if static.sharded else ()
        current.add_row(row.precision, row.activation_checkpointing,
                        f"{row.activation_bytes / gib:.2f}", f"{row.transient_bytes / gib:.2f}",
                        f"{row.predicted_peak_bytes / gib:.2f}", *host_cell, row.peak_moment,
                        "yes" if row.predicted_peak_bytes <= HEADROOM * budget else "no",
                        f"{row.tokens_per_s:,.0f}")
    return current


STRATEGY_VARIANTS = (  # (label, memory fields), each on top of the configured plan
    ("8-bit AdamW states", {"optimizer_states": "8bit"}),
    ("4-bit AdamW states", {"optimizer_states": "4bit"}),
    ("bf16 AdamW states", {"optimizer_states": "bf16"}),
    ("optimizer step in backward", {"optimizer_in_backward": True}),
    ("offload what checkpoints keep", {"activation_offload": "checkpointed"}),
    ("offload every saved tensor", {"activation_offload": "all"}),
)


def lora_base_variants(cfg: Any, precision: str) -> list[tuple[str, dict[str, Any]]]:
    """A LoRA config's other base dtypes (bf16 and nf4 under bf16 precision only): their
    static bytes (NF4's codes and scales), on the configured row's activations."""
    lora = cfg.model.lora
    if lora is None:
        return []
    return [(f"LoRA base {dtype}" + (" (QLoRA)" if dtype == "nf4" else ""),
             {"model.lora.base_dtype": dtype})
            for dtype in ("fp32", "bf16", "nf4")
            if dtype != lora.base_dtype and (dtype == "fp32" or precision == "bf16")]


def with_fields(cfg: Any, fields: dict[str, Any]) -> Any:
    """``cfg`` with memory fields (by name) and ``model.lora.base_dtype`` changed."""
    memory = {k: v for k, v in fields.items() if "." not in k}
    variant = cfg.model_copy(update={"memory": cfg.memory.model_copy(update=memory)})
    if "model.lora.base_dtype" in fields:
        lora = variant.model.lora.model_copy(
            update={"base_dtype": fields["model.lora.base_dtype"]})
        variant = variant.model_copy(update={"model": variant.model.model_copy(
            update={"lora": lora})})
    return variant


def strategies_table(cfg: Any, profiles: list[Any], speed: Any, budget: int) -> Table:
    """The configured plan (its precision and checkpointing, at its micro-batch) and each
    memory strategy added to it alone: device peak, host bytes, AdamW's state, tokens/s. LoRA
    is in the configured row where ``model.lora`` is set (``auto`` never picks it: it changes
    what is trained), with its other base dtypes beside it (``lora_base_variants``)."""
    gib = 2**30
    precision = planned_precision(cfg)
    ac = cfg.memory.activation_checkpointing
    ac = "full" if ac == "auto" else ac
    micro, world = cfg.train.micro_batch(), data_ranks(cfg)
    accumulation = cfg.train.accumulation_steps(world)
    [base] = [p for p in profiles if p.precision == precision
              and p.activation_checkpointing == ac]
    lora = " (LoRA)" if cfg.model.lora is not None else ""
    table = plan_table(f"memory strategies on {precision}, {ac} checkpointing, micro-batch "
                       f"{micro} x {accumulation}", "strategy", "peak\nGiB", "host\nGiB",
                       "AdamW\nGiB", "fits", "tokens/s")
    variants: list[tuple[str, dict[str, Any]]] = [(f"as configured{lora}", {})] + [
        (label, fields) for label, fields in STRATEGY_VARIANTS
        if any(getattr(cfg.memory, k) != v for k, v in fields.items())
        and not (fields.get("activation_offload") == "checkpointed" and ac == "none")]
    for label, fields in variants + lora_base_variants(cfg, precision):
        variant = with_fields(cfg, fields)
        profile = base
        if "activation_offload" in fields:
            _, [profile] = probe_config(variant.model_copy(update={"memory": variant.memory.
                                        model_copy(update={"activation_checkpointing": ac})}),
                                        [precision], [ac], work=True)
        static = config_static(variant)
        row = plan_row(static, profile, micro, accumulation, speed)
        needs = " (accumulation 1)" if "optimizer_in_backward" in fields and accumulation > 1 \
            else ""
        table.add_row(label + needs, f"{row.predicted_peak_bytes / gib:.2f}",
                      f"{row.host_bytes / gib:.2f}",
                      f"{static.optimizer / gib:.2f}",
                      "yes" if row.predicted_peak_bytes <= HEADROOM * budget else "no",
                      f"{row.tokens_per_s:,.0f}")
    return table


def auto_plan(cfg: Any, budget: int, speed: Any, static: Any, profiles: list[Any]) -> Any:
    """The plan ``train`` would take for ``cfg`` with micro-batch and checkpointing ``auto``
    on a device of ``budget`` bytes: ``trainer.plan.auto.decide`` itself (its lines go to the
    log), on the profiles already probed where their bf16 norm inputs match. None: none fits."""
    searched = cfg.model_copy(update={
        "train": cfg.train.model_copy(update={"micro_batch_size": "auto"}),
        "memory": cfg.memory.model_copy(update={"activation_checkpointing": "auto",
                                                "device_memory": str(budget)})})
    probed_norm = cfg.memory.bf16_norm_inputs in (True, "auto")  # "auto" builds them on

    def probe(precision: str, norm: bool) -> tuple[Any, list[Any]]:
        if norm == probed_norm or precision != "bf16":  # the copies exist under bf16 only
            return static, [p for p in profiles if p.precision == precision]
        return config_probe(searched, AC_MODES)(precision, norm)

    try:
        _, decision = decide(searched, speed, probe)
    except ConfigError:  # nothing fits: the table says so
        return None
    return decision.plan if decision is not None else None


def sequence_degrees(cfg: Any) -> list[int]:
    """The ``parallel.sequence`` degrees ``cfg``'s workers, ``seq_len`` and global batch allow
    (1 among them)."""
    workers, seq_len = cfg.parallel.workers, cfg.model.seq_len
    return [size for size in range(1, workers + 1)
            if workers % size == 0 and seq_len % size == 0
            and cfg.train.global_batch_size % (workers // size) == 0]


def sequence_table(cfg: Any, budget: int, speed: Any, device_memory: str) -> Table:
    """Each ``parallel.sequence`` degree the workers allow (``sequence_degrees``), with its
    fastest fitting plan as ``auto`` chooses it (micro-batch and checkpointing searched, the
    rest as configured): each row's tokens per rank, peak, what a rank sends in a step's
    all-to-alls, tokens/s. A degree the model's heads do not divide into is said so, under
    the table."""
    gib, mib = 2**30, 2**20
    table = plan_table(f"each row split over N of {cfg.parallel.workers} workers "
                       f"(parallel.sequence), fastest plan in {HEADROOM:.0%} of {device_memory}",
                       "N", "data\nranks", "tokens\na rank", "precision", "act.\nckpt",
                       "micro x\naccum.", "peak\nGiB", "all-to-all\nMiB", "tokens/s")
    refused = []
    for size in sequence_degrees(cfg):
        variant = cfg.model_copy(update={
            "parallel": cfg.parallel.model_copy(update={"sequence": size}),
            "train": cfg.train.model_copy(update={"micro_batch_size": "auto"}),
            "memory": cfg.memory.model_copy(update={"activation_checkpointing": "auto"})})
        cells = [str(size), str(data_ranks(variant)), f"{cfg.model.seq_len // size:,}"]
        request = request_from(variant, budget)
        try:
            plan = choose(request, config_probe(variant, request.ac_modes), speed).plan
        except ValueError as err:  # the model's heads do not divide among the ranks
            refused.append(f"N = {size}: {err}")
            continue
        if plan is None:
            table.add_row(*cells, "[red]nothing fits[/]")
            continue
        table.add_row(*cells, plan.precision, plan.activation_checkpointing,
                      f"{plan.micro_batch_size} x {plan.accumulation_steps}",
                      f"{plan.predicted_peak_bytes / gib:.2f}",
                      f"{plan.all_to_all_bytes / mib:,.1f}", f"{plan.tokens_per_s:,.0f}")
    table.caption = "; ".join(refused) or None
    return table


def best_table(rows: list[Any], auto: Any, device_memory: str, global_batch: int) -> Table:
    """Each precision and checkpointing mode's fastest fitting plan, ``auto``'s marked."""
    def key(row: Any) -> tuple[Any, ...]:
        return (row.precision, row.activation_checkpointing, row.micro_batch_size,
                row.loss_chunk_tokens)

    best = plan_table(f"fastest micro-batch in {HEADROOM:.0%} of {device_memory}, global "
                       f"batch {global_batch} kept",
                       "precision", "act.\nckpt", "micro-\nbatch", "accumu-\nlation",
                       "loss\nchunk", "peak\nGiB", "tokens/s", "")
    for row in rows:
        best.add_row(row.precision, row.activation_checkpointing, str(row.micro_batch_size),
                     str(row.accumulation_steps),
                     f"{row.loss_chunk_tokens:,}" if row.loss_chunk_tokens else "-",
                     f"{row.predicted_peak_bytes / 2**30:.2f}", f"{row.tokens_per_s:,.0f}",
                     "<- auto" if auto is not None and key(row) == key(auto) else "")
    return best


def measure_plans(console: Console, cfg: Any, static: Any, profiles: list[Any], budget: int,
                  top: int, steps: int) -> None:
    """``plan --measure``: the ``top`` fastest predicted plans (every fitting micro-batch; the
    per-rank batch alone with the optimizer step in backward, which takes one micro-batch a
    step), each trained ``steps`` steps as one rank on this CPU with the configured optimizer,
    predicted against measured."""
    one_rank = SpeedModel(cpu_speed())
    per_rank = per_rank_batch(cfg.train.global_batch_size, data_ranks(cfg))
    in_backward = cfg.memory.optimizer_in_backward
    micro_batches = [per_rank] if in_backward else micro_batch_candidates(per_rank)
    fitting = [row for profile in profiles
               for row in (plan_row(static, profile, micro, per_rank // micro, one_rank)
                           for micro in micro_batches)
               if row.predicted_peak_bytes <= HEADROOM * budget]
    chosen = sorted(fitting, key=lambda row: -row.tokens_per_s)[:top]
    table = plan_table(f"measured: {len(chosen)} fastest predicted plans, one rank on this "
                        f"CPU, {steps} steps each", "precision", "act.\nckpt", "micro-\nbatch",
                        "predicted\ntokens/s", "measured\ntokens/s", "predicted\npeak GiB",
                        "measured\npeak GiB")
    factory = model_factory(cfg.model, load_weights=False)  # time and bytes need no weights
    transforms = MemoryTransforms.of(cfg.memory)
    gib = 2**30
    for row in chosen:
        console.print(f"measuring {row.precision}, {row.activation_checkpointing}, micro-batch "
                      f"{row.micro_batch_size} x {row.accumulation_steps}...")
        got = measure_plan(factory, transforms.replace(
            activation_checkpointing=row.activation_checkpointing), cfg.model.seq_len,
            model_vocab_size(cfg.model.name, cfg.model.vocab_size), row.precision,
            row.micro_batch_size, row.accumulation_steps,
            steps=steps, states=cfg.memory.optimizer_states, in_backward=in_backward,
            fused=cfg.train.fused())
        table.add_row(row.precision, row.activation_checkpointing, str(row.micro_batch_size),
                      f"{row.tokens_per_s:,.0f}", f"{got.tokens_per_s:,.0f}",
                      f"{row.predicted_peak_bytes / gib:.2f}", f"{got.peak_bytes / gib:.2f}")
    console.print(table)


def loss_line(shape: Any, setting: int | str) -> str:
    """What the planned loss is: chunked (how many tokens a chunk, its fp32 logits) or plain."""
    if isinstance(shape, ChunkedLossShape):
        logits = shape.chunk_tokens * shape.vocab_size * 4
        return (f"loss: chunks of {shape.chunk_tokens} tokens (memory.loss_chunk_tokens "
                f"{setting}), each {logits / 2**30:.2f} GiB\n      of fp32 logits at vocabulary "
                f"{shape.vocab_size:,}")
    return f"loss: full logits, then cross-entropy (memory.loss_chunk_tokens {setting})"


def plan_table(title: str, *headers: str) -> Table:
    """A table that fits an 80-column terminal: headers of two lines, no vertical rules,
    numbers right-aligned."""

    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False)
    for header in headers:
        table.add_column(header, no_wrap=True,
                         justify="right" if "GiB" in header or "-" in header
                         or header.endswith("tokens/s") else "left")
    return table
