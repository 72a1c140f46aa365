"""The typed configuration tree: YAML files in ``configs/`` plus ``--set a.b=c`` overrides.

One pydantic model per component; a part built from one component takes its slice alone
(``build_loader(cfg.data, ...)``, ``MemoryTransforms.of(cfg.memory)``), while the loop, the
launchers and the planner read the whole tree. Unknown keys are errors, and so are values
outside their valid range. Derived values live in exactly one method
(``TrainConfig.accumulation_steps``). Every failure is a ``ConfigError`` whose one-line message
names the file and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from trainer.global_batch import accumulation_steps, per_rank_batch


class ConfigError(ValueError):
    """A configuration problem; the message is one line naming the file, field and value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunConfig(_Strict):
    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    dir: str = "runs"  # run directories live at <dir>/<name>/; or s3://bucket/prefix
    # With dir on object storage: the workers' local working copy, <work_dir>/<name>/
    # (trainer/checkpoint/store.py); default <cache>/runs/<scheme>/<bucket>/<prefix>, the cache
    # $MEMTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/memtrain, else ~/.cache/memtrain
    work_dir: str | None = None
    seed: int = 0
    # Checkpoints kept in the run directory (and its store): the newest ones.
    keep_checkpoints: int = Field(3, ge=1)
    # What is checked before a checkpoint is read (trainer/checkpoint/integrity.py): every file's
    # size and SHA-256 against meta.json ("hashes", about 1.1 s per GiB), or the sizes alone
    # ("sizes").
    checkpoint_verify: Literal["hashes", "sizes"] = "hashes"


class LoraConfig(_Strict):
    """LoRA adapters (``model.lora``; trainer/memory/lora.py, through PEFT)."""

    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)  # the adapters' output is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # Module names to adapt (the last part of a name, as PEFT matches); empty: every linear
    # layer of the model's blocks (the output layer is never one).
    targets: list[str] = []
    # The frozen base weights' dtype: bf16 halves them; nf4 (QLoRA) stores the blocks' linear
    # weights in 4-bit NormalFloat (torchao's NF4: blocks of 64 values, double-quantized
    # scales; about 0.52 bytes a weight) and the rest of the base in bf16. Both compute in bf16
    # (need memory.precision bf16, or auto resolving to it).
    base_dtype: Literal["fp32", "bf16", "nf4"] = "fp32"


class ModelConfig(_Strict):
    # A registered name ("gpt"), a "module:function" entry point returning an nn.Module, or
    # "hf:<directory or config.json>": a Hugging Face causal LM (trainer/models/hf.py), whose own
    # config decides its shape (n_layer, n_head, n_embd are then ignored).
    name: str = "gpt"
    vocab_size: int = Field(256, ge=2)
    seq_len: int = Field(256, ge=1)
    n_layer: int = Field(4, ge=1)
    n_head: int = Field(4, ge=1)
    n_embd: int = Field(128, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # The weights' own dtype. bf16: every weight (and so its gradient) is bf16, with no fp32
    # copy anywhere: 2 bytes a parameter instead of 4, a sharded rank's shard halved (Lightning's
    # "bf16-true", torchtune's "dtype: bf16"). AdamW computes each update in fp32 and rounds it
    # into the bf16 weight stochastically (torchao), so an update below bf16's resolution is
    # kept in expectation rather than lost. The model is built in fp32 with its seeded
    # initialisation, then cast: its weights are the fp32 build's, rounded to nearest. Needs
    # memory.precision bf16 (or auto resolving to it) and optimizer_states bf16, 8bit or 4bit.
    dtype: Literal["fp32", "bf16"] = "fp32"
    # Train LoRA adapters on a frozen base (pip install 'memtrain[strategies]'); unset: the
    # whole model trains.
    lora: LoraConfig | None = None

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self

    def weights_dtype(self) -> tuple[str, str]:
        """The field that sets the dtype the model's weights are stored in, and its value: a
        LoRA base's ``base_dtype`` (the adapters stay fp32), else ``dtype``. Anything but fp32
        computes in bf16."""
        if self.lora is not None:
            return "model.lora.base_dtype", self.lora.base_dtype
        return "model.dtype", self.dtype

    def frozen_base(self) -> bool:
        """Whether the run trains adapters over a frozen base, which every start reads again
        (from ``name`` or ``train.init_from``): its checkpoints hold the adapters alone."""
        return self.lora is not None

    def lean_base(self) -> bool:
        """Whether the run trains adapters over a base stored below fp32 (bf16 or NF4): built
        on meta and filled weight by weight, so the fp32 base is never held whole, and the
        host's heap kept lean."""
        return self.frozen_base() and self.weights_dtype()[1] != "fp32"

    def packages(self) -> list[tuple[str, str]]:
        """The optional packages the model's settings need, as (setting, package)."""
        if self.lora is None:
            return []
        return [("model.lora", "peft")] + (
            [("model.lora.base_dtype nf4", "torchao")] if self.lora.base_dtype == "nf4" else [])


class DataConfig(_Strict):
    path: str = "data/stdlib/train"  # a dataset directory, or s3://bucket/prefix (pyarrow fs)
    val_path: str | None = "data/stdlib/val"
    column: str = "tokens"
    shuffle: bool = True  # shard order per epoch + a window shuffle (datapipe/split.py)
    shuffle_window: int = Field(8192, ge=1)  # rows per shuffle window (rounded to batches)
    prefetch: int = Field(2, ge=1)  # CUDA: batches copied to the GPU ahead (pinned, side stream)
    read_ahead: int = Field(2, ge=1)  # windows read ahead (remote: on threads; wants more)
    # A shard that is missing, truncated, unreadable or disagrees with the manifest: "error"
    # stops with a message naming it; "skip" leaves it out (logged, and counted in
    # memtrain_data_skipped_shards_total). Every rank decides the same way before training.
    on_bad_shard: Literal["error", "skip"] = "error"
    # An audit of the data order: each rank appends, per step, a fingerprint of every row it
    # trained on (datapipe.audit.row_fingerprint) to metrics/rows-rank-<rank>.jsonl, so a
    # run that restarted or resized can be checked against its dataset for rows repeated or
    # skipped (a step GradScaler skipped counts: its rows were consumed). Off by default: it
    # copies every batch to the host.
    record_rows: bool = False


class TrainConfig(_Strict):
    steps: int = Field(100, ge=1)
    global_batch_size: int = Field(32, ge=1)  # sequences per optimizer step, all ranks together
    # Sequences per forward/backward on one rank, or "auto": that of the fastest plan the planner
    # predicts to fit (see memory.device_memory), keeping the global batch.
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = 8
    lr: float = Field(1e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    # Clip the global gradient norm to this (0: no clipping; the norm is still logged).
    grad_clip: float = Field(1.0, ge=0)
    # Start a new run from another run's weights (weights only: the optimizer, schedule and
    # data start afresh): a run directory (its latest whole checkpoint) or one checkpoint
    # directory, any strategy and world size; or hf:DIR, a Hugging Face directory's safetensors
    # loaded into a compatible hf: model (a LoRA model's base too; under FSDP each rank reads
    # its rows). A resume ignores it, the run's own checkpoint deciding, except as a LoRA
    # model's base, which the checkpoint does not hold: that is read again, and refused where it
    # differs from the one the checkpoint trained on (trainer.launch.prepare).
    init_from: str | None = None
    # Resume a run that has no checkpoint of its own from another checkpoint, every part of
    # its state (weights, optimizer, schedule, data position, RNG): a run directory (its latest
    # whole checkpoint) or one checkpoint directory (memtrain train --resume-from PATH).
    resume_from: str | None = None
    # Checkpoints saved without holding the step: the local launcher writes, publishes and
    # uploads each on a thread of its own once staged in host memory
    # (trainer/checkpoint/async_save.py); under Ray the files are written in the step and Ray
    # Train uploads them in the background.
    checkpoint_async: bool = False
    # AdamW's fused kernel ("auto": on CUDA; measured 3.7% faster a step than foreach on an
    # H200, GPT-2 124M) or torch's default implementation (false). Checkpoints load
    # across the switch.
    fused_optimizer: bool | Literal["auto"] = "auto"
    # torch.compile each repeated block (the whole model when it has no ``blocks``), after
    # activation checkpointing and before DDP/FSDP wrap it; "auto": on CUDA (where the planner
    # runs, its time model's choice, said in the log: trainer.plan.auto.resolve_auto). The
    # first step pays the compile (reported in the summary); later recompilations are counted
    # and warned.
    compile: bool | Literal["auto"] = "auto"
    # Stop after this many consecutive optimizer steps with a non-finite grad norm (fp16's
    # GradScaler skips a few while it calibrates; a run that keeps skipping is broken).
    max_nonfinite_steps: int = Field(10, ge=1)
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(50, ge=0)  # 0: no evaluation
    eval_batches: int = Field(4, ge=1)
    checkpoint_every: int = Field(50, ge=0)  # 0: only the final checkpoint

    def fused(self) -> bool | None:
        """``fused_optimizer`` as ``trainer.optim.build_optimizer`` takes it: None for "auto"
        (fused on CUDA parameters)."""
        return None if self.fused_optimizer == "auto" else self.fused_optimizer

    def micro_batch(self) -> int:
        """The micro-batch size; "auto" must have been resolved first
        (trainer.plan.auto.resolve_auto)."""
        if self.micro_batch_size == "auto":
            raise ConfigError("train.micro_batch_size is 'auto' and has not been resolved")
        return self.micro_batch_size

    def accumulation_steps(self, world_size: int, sequence: int = 1) -> int:
        """Micro-batches per optimizer step on each rank; the global batch is kept exactly
        (``trainer.batches``). ``world_size``: the data ranks, the workers over ``sequence``
        (``parallel.sequence``), which the refusal names."""
        try:
            return accumulation_steps(self.global_batch_size, self.micro_batch(), world_size,
                                      sequence)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def per_rank_batch(self, world_size: int, sequence: int = 1) -> int:
        """Samples each rank trains per optimizer step, whatever the micro-batch (``auto``
        too); a ConfigError naming both sizes where the data ranks (``world_size``, the workers
        over ``sequence``) do not divide the global batch."""
        try:
            return per_rank_batch(self.global_batch_size, world_size, sequence)
        except ValueError as err:
            raise ConfigError(str(err)) from None


class MemoryConfig(_Strict):
    # "auto": bf16 on GPUs with native bf16, else fp16 (GradScaler); on CPU bf16 only where
    # it is native (AVX512_BF16/AMX), else fp32 (trainer.memory.precision.resolve_precision).
    # With micro-batch or checkpointing "auto" too, the planner's time model chooses between
    # that and fp32 (bf16, on a CPU without it) by predicted tokens/s.
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # fp16: the GradScaler's starting scale (it halves on overflow, grows after stable steps).
    grad_scaler_init_scale: float = Field(2.0**16, gt=0)
    # "auto": the mode of the fastest plan that fits (trainer.plan.auto.resolve_auto).
    activation_checkpointing: Literal["none", "full", "selective", "auto"] = "full"
    # k for "selective": blocks 0, k, 2k, ... of model.blocks are checkpointed (2: every
    # other block). Not about saving checkpoints, which is train.checkpoint_every.
    activation_checkpointing_every: int = Field(2, ge=1)
    # Memory of one device for the "auto" choices, e.g. "80GiB". Unset: the CUDA device's total
    # when the driver has one, or this host's RAM divided by the workers on CPU.
    device_memory: str | None = None
    # Under bf16 autocast, LayerNorms read (and save for backward) a bf16 copy of their input
    # instead of the fp32 residual stream: the largest fp32 share of bf16's saved activations,
    # for about 5% of an eager step's time (H200, GPT-2 124M). "auto": on when the plan with them
    # is predicted faster than the best without (trainer.plan.candidates.choose_norm_inputs), or
    # only it fits; off without bf16.
    bf16_norm_inputs: bool | Literal["auto"] = "auto"
    # Output projection + cross-entropy in chunks of this many tokens (0: full logits). "auto":
    # for a model that computes its own loss (the GPT, a Hugging Face causal LM), as many
    # tokens as keep one chunk's fp32 logits within 256 MiB (a power of two: 1,024 at GPT-2's
    # vocabulary, 512 at 128k; trainer.memory.loss.auto_loss_chunk_tokens); the plain loss for
    # any other model. Where micro-batch or checkpointing is "auto" too, the planner's time
    # model picks the chunk (from a quarter of that to 16 times it) with the rest of the plan.
    loss_chunk_tokens: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    # On OOM: snapshot, halve the micro-batch, double accumulation (global batch kept), retry.
    # It costs one flag all-reduce per step and DDP's overlap of the gradient all-reduce with
    # backward. "auto": on for CUDA devices, off on CPU (a host out of memory is the kernel's
    # OOM killer, which no process survives; measured cost on 2 gloo workers: bench/trainer.py).
    oom_recovery: bool | Literal["auto"] = "auto"
    max_oom_retries: int = Field(3, ge=0)
    # CUDA: record allocator history from the start so an OOM snapshot shows where memory went.
    record_memory_history: bool = True
    # 0: Python's automatic gc; N: automatic gc off, a young-generation collection every N steps.
    gc_every: int = Field(0, ge=0)
    # Leak guard: sample live tensors, RSS and CUDA allocated bytes every N steps (0: off).
    leak_check_every: int = Field(50, ge=0)
    # torch.profiler with memory for optimizer steps "A:B" (1-based, inclusive); a trace per rank.
    profile_steps: str | None = Field(None, pattern=r"^[1-9][0-9]*:[1-9][0-9]*$")
    # CUDA: write torch.cuda.memory_summary() after these steps.
    memory_summary_steps: list[int] = []
    # AdamW's two moments per parameter: fp32 (8 bytes), bf16 (4), or block-quantized by
    # torchao: 8bit (2.03), 4bit (1.06); tensors under 4,096 elements stay fp32
    # (trainer/memory/optimizers.py; pip install 'memtrain[strategies]' for all but fp32).
    optimizer_states: Literal["fp32", "bf16", "8bit", "4bit"] = "fp32"
    # Each parameter steps as soon as its gradient is complete, and drops it: the gradients
    # never all live at once. Needs train.grad_clip 0, no gradient accumulation, no fp16, no
    # OOM retries (trainer/memory/optimizers.py BackwardSteps).
    optimizer_in_backward: StrictBool = False
    # What autograd saves for backward goes to host memory and comes back for backward
    # (trainer/memory/offload.py): "checkpointed": only what the checkpointed blocks keep (their
    # inputs; needs activation_checkpointing); "all": everything the forward saves. On CUDA
    # through pinned buffers on a side stream; on CPU, where host and device are one memory, the
    # same hooks copy within it.
    activation_offload: Literal["none", "checkpointed", "all"] = "none"
    # The MLP of each block runs over this many tiles of the sequence, each tile's forward
    # recomputed in backward, so the MLP's intermediate (4 x n_embd a token in the GPT, a
    # Llama's intermediate_size) is held for one tile at a time, for one more MLP forward a
    # step (trainer/memory/tiled_mlp.py); 1: off. Where K does not divide the sequence the
    # first tiles hold one token more (exact all the same). A model whose blocks hold no MLP
    # it knows is refused when built.
    tiled_mlp: int = Field(1, ge=1)


class FsdpConfig(_Strict):
    """How FSDP2 shards (``parallel.strategy: fsdp``; trainer/parallel/fsdp.py)."""

    # The dtype blocks compute in and all-gather (MixedPrecisionPolicy.param_dtype): bf16 keeps
    # fp32 shards and casts them once per all-gather, in place of autocast. auto: bf16 when
    # memory.precision is bf16 (or auto and resolves to it) or model.dtype is, else fp32.
    param_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    # The dtype gradients are reduce-scattered in (MixedPrecisionPolicy.reduce_dtype). auto:
    # the weights' dtype (model.dtype): fp32, or bf16 for bf16 weights, whose gradients are
    # bf16 anyway (an fp32 reduction of bf16 weights' gradients held about 2 bytes a sharded
    # parameter more through backward, measured on CPU with torch 2.13).
    reduce_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    # After a block's forward: true frees its all-gathered parameters (gathered again for
    # backward), false keeps them to backward, N >= 2 keeps a copy sharded over N ranks (N
    # must divide the world size); auto: true or false, by the planner (trainer/plan/auto.py).
    reshard_after_forward: StrictBool | Annotated[int, Field(ge=2)] | Literal["auto"] = True
    # cpu: shards, gradients and optimizer state live in host memory (CPUOffloadPolicy); the
    # optimizer steps on the host, and each block's shards are copied to the device to gather.
    # auto: cpu only where nothing fits on the GPU otherwise (never on a CPU run, where host and
    # device are the same memory).
    offload: Literal["none", "cpu", "auto"] = "none"

    @field_validator("reshard_after_forward", mode="before")
    @classmethod
    def _group(cls, value: Any) -> Any:
        if not isinstance(value, bool) and not (isinstance(value, int) and value >= 2) \
                and value != "auto":
            raise ValueError("expected true, false, auto or a group size of at least 2")
        return value


class ParallelConfig(_Strict):
    launcher: Literal["ray", "local"] = "ray"
    # N, or [min, max] for elastic training under Ray (Train V2's ScalingConfig(num_workers=
    # (min, max))): the worker group starts with as many as the cluster holds, up to max, and is
    # resized between min and max after failures and as nodes come and go; every size in the
    # range must keep the global batch. Stored as workers = max, min_workers = min.
    workers: int = Field(2, ge=1)
    min_workers: int | None = Field(None, ge=1)
    use_gpu: bool = False
    # ddp: every rank holds the whole model; fsdp: parameters, gradients and optimizer state
    # sharded across ranks (FSDP2), checkpoints sharded (torch.distributed.checkpoint).
    # auto: ddp where the whole model fits a device, else fsdp, by the planner's predicted
    # tokens/s (with parallel.fsdp's auto fields; trainer/plan/auto.py decide_sharding).
    strategy: Literal["ddp", "fsdp", "auto"] = "ddp"
    fsdp: FsdpConfig = FsdpConfig()
    # Ray: how many times a failed worker group is restarted from the latest checkpoint
    # (-1: without limit). A preempted or killed worker costs the steps since that checkpoint.
    max_failures: int = Field(1, ge=-1)
    # Ray, elastic workers: how often a healthy group checks whether the cluster now holds more
    # workers, and restarts at that size from the latest checkpoint if so (Train V2's
    # elastic_resize_monitor_interval_s).
    resize_check_seconds: float = Field(60.0, gt=0)
    # Ulysses sequence parallelism: each row's tokens split over this many ranks (a sequence
    # group; attention's all-to-alls between them), for rows longer than one rank's
    # activations hold. The workers form workers / sequence data ranks, which divide the global
    # batch (docs/memory.md "Long sequences: sequence parallelism").
    sequence: int = Field(1, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _elastic_range(cls, data: Any) -> Any:
        workers = data.get("workers") if isinstance(data, dict) else None
        if isinstance(workers, list | tuple):
            if len(workers) != 2 or not all(isinstance(w, int) for w in workers):
                raise ValueError(f"parallel.workers: expected N or [min, max], got {workers}")
            data = {**data, "min_workers": workers[0], "workers": workers[1]}
        return data

    @model_validator(mode="after")
    def _min_at_most_max(self) -> ParallelConfig:
        if self.min_workers is not None and self.min_workers > self.workers:
            raise ValueError(f"parallel.workers: min {self.min_workers} is above max "
                             f"{self.workers}")
        return self

    @property
    def worker_range(self) -> tuple[int, int]:
        """(min, max) workers; equal unless elastic."""
        return (self.min_workers or self.workers, self.workers)

    def data_workers(self, workers: int) -> int:
        """The data ranks among ``workers`` ranks: the global batch divides over these."""
        return workers // self.sequence


class MonitoringConfig(_Strict):
    # Local launcher: serve each rank's metrics on 127.0.0.1:(port + rank); None: no exporter.
    # Under Ray the node's metrics endpoint is used instead.
    port: int | None = Field(None, ge=0, le=65535)
    # Every value is republished this often, log steps or not, so no series lapses between slow
    # log steps. Under Ray, at most Ray's export interval (10 s by default): its agent drops a
    # gauge that two exports did not refresh.
    publish_seconds: float = Field(5.0, gt=0, le=60)
    # The published allocator peak is the highest in this many seconds, sliding: at least
    # Ray's export interval plus the scrape interval, so no scrape misses a spike.
    peak_window_seconds: float = Field(60.0, gt=0)
    # Experiment trackers rank 0 writes to (monitoring/trackers.py; pip install
    # 'memtrain[tracking]'): the config as parameters, every log step's metrics, and at the end
    # summary.json, config.yaml and report.png as artifacts; a tracker that fails costs a warning.
    trackers: list[Literal["tensorboard", "mlflow"]] = []
    # MLflow's tracking URI: an MLflow server (http://...) or a store. None: the driver's
    # MLFLOW_TRACKING_URI, else an sqlite store in the run directory (<run dir>/mlflow.db).
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "memtrain"


class Config(_Strict):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    memory: MemoryConfig = MemoryConfig()
    parallel: ParallelConfig = ParallelConfig()
    monitoring: MonitoringConfig = MonitoringConfig()

    @model_validator(mode="after")
    def _supported_combinations(self) -> Config:
        if self.parallel.strategy == "fsdp" and self.memory.precision == "fp16":
            raise ValueError("parallel.strategy 'fsdp' with memory.precision 'fp16' is not "
                             "supported (GradScaler over sharded gradients); use bf16")
        fsdp = self.parallel.fsdp
        if fsdp.param_dtype == "bf16" and self.memory.precision == "fp32":
            raise ValueError("parallel.fsdp.param_dtype 'bf16' with memory.precision 'fp32': "
                             "bf16 parameters are mixed precision; set memory.precision bf16 "
                             "(or auto), or param_dtype fp32")
        if fsdp.reduce_dtype == "bf16" and self.memory.precision == "fp32":
            raise ValueError("parallel.fsdp.reduce_dtype 'bf16' with memory.precision 'fp32': "
                             "bf16 gradient reduction is mixed precision; set "
                             "memory.precision bf16 (or auto), or reduce_dtype fp32")
        # bf16 weights first: with LoRA their refusal is the one whose fix applies
        weight_dtype_combinations(self)
        frozen_base_combinations(self)
        strategy_combinations(self)
        sequence_combinations(self)
        workers = self.parallel.workers
        group = fsdp.reshard_after_forward
        if isinstance(group, int) and not isinstance(group, bool) and \
                (group > workers or workers % group):
            raise ValueError(f"parallel.fsdp.reshard_after_forward {group} must divide "
                             f"parallel.workers {workers}")
        return self

    def fsdp_reduce_dtype(self) -> str:
        """FSDP's gradient reduction dtype, ``auto`` resolved by the weights' dtype."""
        wanted = self.parallel.fsdp.reduce_dtype
        return self.model.dtype if wanted == "auto" else wanted

    def fsdp_param_dtype(self, precision: str) -> str:
        """FSDP's parameter dtype, given the run's resolved ``precision``."""
        wanted = self.parallel.fsdp.param_dtype
        if wanted != "auto":
            return wanted
        return "bf16" if precision == "bf16" or self.model.dtype == "bf16" else "fp32"

    def compiles_model(self, device_type: str) -> bool:
        """Whether the model is compiled on ``device_type``: ``train.compile`` true, or ``auto``
        on a GPU without activation offload (its hooks run in eager mode only). The loop, the
        launcher's preload and the planner's time model all ask here."""
        return self.train.compile is True or (
            self.train.compile == "auto" and device_type == "cuda"
            and self.memory.activation_offload == "none")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def sequence_combinations(cfg: Config) -> None:
    """Refuse what ``parallel.sequence`` cannot split, one line each (a model's heads are
    refused where the model is split, ``trainer.parallel.sequence``)."""
    parallel, size = cfg.parallel, cfg.parallel.sequence
    if size == 1:
        return
    if parallel.min_workers is not None and parallel.min_workers != parallel.workers:
        raise ValueError(f"parallel.workers [{parallel.min_workers}, {parallel.workers}] with "
                         f"parallel.sequence {size}: elastic workers would take sizes that do "
                         f"not form sequence groups; set parallel.workers to a multiple of {size}")
    if parallel.workers % size:
        raise ValueError(f"parallel.workers {parallel.workers} is not divisible by "
                         f"parallel.sequence {size}: the workers form groups of {size} ranks")
    if cfg.model.seq_len % size:
        raise ValueError(f"model.seq_len {cfg.model.seq_len} is not divisible by "
                         f"parallel.sequence {size}: each rank of a group holds seq_len / {size} "
                         "tokens of every row")


def weight_dtype_combinations(cfg: Config) -> None:
    """Refuse what bf16 weights (``model.dtype``) cannot be combined with, one line each."""
    memory = cfg.memory
    if cfg.model.dtype != "bf16":
        return
    lora = cfg.model.lora
    if lora is not None:  # first: the fixes below do not apply to a LoRA run
        if lora.base_dtype == "fp32":
            raise ValueError("model.dtype 'bf16' with model.lora: LoRA's adapters train in "
                             "fp32 over a frozen base; for a bf16 base set "
                             "model.lora.base_dtype bf16 and leave model.dtype fp32")
        raise ValueError(f"model.dtype 'bf16' with model.lora.base_dtype {lora.base_dtype!r}: "
                         f"base_dtype sets the frozen base's dtype itself ({lora.base_dtype}) "
                         "and the adapters train in fp32; leave model.dtype fp32")
    if memory.precision in ("fp32", "fp16"):
        raise ValueError(f"model.dtype 'bf16' with memory.precision {memory.precision!r}: "
                         "bf16 weights compute in bf16; set memory.precision bf16 (or auto)")
    if memory.optimizer_states == "fp32":
        raise ValueError("model.dtype 'bf16' with memory.optimizer_states 'fp32': AdamW's "
                         "moments are kept in the weights' dtype or below (a checkpoint's "
                         "load casts them to it); set optimizer_states bf16, 8bit or 4bit")
    if cfg.parallel.fsdp.param_dtype == "fp32" and cfg.parallel.strategy != "ddp":
        raise ValueError("model.dtype 'bf16' with parallel.fsdp.param_dtype 'fp32': FSDP "
                         "would gather bf16 weights as fp32 copies; set param_dtype bf16 "
                         "(or auto)")


def frozen_base_combinations(cfg: Config) -> None:
    """A LoRA model's frozen base is read from ``train.init_from: hf:DIR`` or ``model.name``:
    a run's checkpoint as ``init_from`` is refused in one line."""
    init_from = cfg.train.init_from
    if cfg.model.lora is not None and init_from is not None and not init_from.startswith("hf:"):
        raise ValueError("train.init_from with model.lora: a run's checkpoint is not a LoRA "
                         "model's base; give the base as train.init_from hf:DIR (or model.name "
                         "hf:DIR)")


def strategy_combinations(cfg: Config) -> None:
    """Refuse the memory strategies' combinations they cannot honour (one line each)."""
    memory, train = cfg.memory, cfg.train
    if memory.optimizer_in_backward:
        if train.grad_clip:
            raise ValueError(f"memory.optimizer_in_backward with train.grad_clip "
                             f"{train.grad_clip}: each parameter steps before the global "
                             "gradient norm exists; set train.grad_clip 0")
        if memory.precision == "fp16":
            raise ValueError("memory.optimizer_in_backward with memory.precision 'fp16': "
                             "GradScaler must see every gradient before any step; use bf16")
        if memory.oom_recovery is True:
            raise ValueError("memory.optimizer_in_backward with memory.oom_recovery true: a "
                             "retried step would step its parameters twice")
        if train.micro_batch_size == "auto":
            raise ValueError("memory.optimizer_in_backward with train.micro_batch_size "
                             "'auto': without accumulation the micro-batch is the global "
                             "batch over the workers; set it")
        for workers in sorted(set(cfg.parallel.worker_range)):
            ranks = cfg.parallel.data_workers(workers)
            if train.accumulation_steps(ranks, cfg.parallel.sequence) > 1:
                named = f"{workers} workers" if ranks == workers else \
                    f"{ranks} data ranks ({workers} workers / parallel.sequence " \
                    f"{cfg.parallel.sequence})"
                raise ValueError(
                    f"memory.optimizer_in_backward needs one micro-batch per step: "
                    f"train.global_batch_size {train.global_batch_size} over "
                    f"train.micro_batch_size {train.micro_batch_size} x {named} "
                    f"accumulates; set micro_batch_size to global_batch_size / {ranks}")
    if memory.activation_offload == "checkpointed" and \
            memory.activation_checkpointing == "none":
        raise ValueError("memory.activation_offload 'checkpointed' with "
                         "memory.activation_checkpointing 'none': nothing is checkpointed; "
                         "use 'all', or turn checkpointing on")
    if memory.activation_offload != "none" and train.compile is True:
        raise ValueError("memory.activation_offload with train.compile true: the offload "
                         "hooks run in eager mode only; set train.compile false (or auto)")
    lora = cfg.model.lora
    if lora is not None and lora.base_dtype != "fp32" and memory.precision in ("fp32", "fp16"):
        raise ValueError(f"model.lora.base_dtype {lora.base_dtype!r} with memory.precision "
                         f"{memory.precision!r}: {lora.base_dtype} base weights compute under "
                         "bf16 autocast; set memory.precision bf16 (or auto)")
    if lora is not None and lora.base_dtype == "nf4" and cfg.parallel.fsdp.param_dtype == "fp32" \
            and cfg.parallel.strategy != "ddp":
        raise ValueError("model.lora.base_dtype 'nf4' with parallel.fsdp.param_dtype 'fp32': "
                         "FSDP gathers an NF4 weight as NF4 and it computes in bf16; set "
                         "parallel.fsdp.param_dtype bf16 (or auto)")
    if memory.tiled_mlp > cfg.model.seq_len:
        raise ValueError(f"memory.tiled_mlp {memory.tiled_mlp} is more than model.seq_len "
                         f"{cfg.model.seq_len}: a tile holds at least one token")
    if memory.optimizer_states != "fp32" and train.fused_optimizer is True:
        raise ValueError(f"train.fused_optimizer true with memory.optimizer_states "
                         f"{memory.optimizer_states!r}: torch's fused AdamW keeps fp32 states")


# Keys that go by another name: a file or --set with the old one is refused in one line that
# names the key to write instead, not as a bare unknown key.
_RENAMED_KEYS = {"memory.checkpoint_every_k": "memory.activation_checkpointing_every"}


def _format_validation_error(err: ValidationError, source: str) -> str:
    for error in err.errors():
        key = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden" and key in _RENAMED_KEYS:
            return f"{source}: {key} is now {_RENAMED_KEYS[key]}"
    first = err.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(top level)"
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown key {field!r}"
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    return f"{source}: {field}: {first['msg']}{shown}"


def set_value(tree: dict[str, Any], key: str, value: Any, source: str | None = None) -> None:
    """Set the dotted ``key`` (``a.b.c``) of a nested dict to ``value``."""
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source or key}: {part!r} is not a section")
        node = child
    node[leaf] = value


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply one ``a.b.c=value`` to a nested dict; the value is parsed as YAML (so 3 is an int)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. train.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {assignment!r}: value is not valid YAML ({err})") from err
    set_value(tree, key, value, f"--set {assignment!r}")


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                values: dict[str, Any] | None = None) -> Config:
    """Load a config file (or the defaults when ``path`` is None) and apply overrides: the
    ``--set KEY=VALUE`` strings (values parsed as YAML), then ``values``, typed values by dotted
    key that a CLI option already parsed (``{"parallel.workers": 4}``)."""
    source = str(path) if path is not None else "defaults"
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file {path}: not valid YAML{where}") from err
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping")
        tree = loaded or {}
    for assignment in overrides:
        apply_override(tree, assignment)
    for key, value in (values or {}).items():
        set_value(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from err


def check_way_settings(cfg: Config) -> None:
    """A ``parallel.fsdp`` field the user set, unlike its default, under ``parallel.strategy:
    ddp`` would be ignored: one line naming it (``train`` and ``plan``; a run's saved config,
    which writes every field out, still loads, for an export)."""
    parallel = cfg.parallel
    if parallel.strategy != "ddp":
        return
    for field in sorted(parallel.fsdp.model_fields_set):
        value = getattr(parallel.fsdp, field)
        if value != type(parallel.fsdp).model_fields[field].default:
            shown = str(value).lower() if isinstance(value, bool) else repr(value)
            raise ConfigError(f"parallel.fsdp.{field} {shown} with parallel.strategy 'ddp': "
                              "parallel.fsdp applies under FSDP only; remove it, or set "
                              "parallel.strategy fsdp (or auto)")
