"""Predict a plan's step time before a run: the step's work (``trainer.plan.work``) over the
device's speed (``trainer.plan.devices``, ``trainer.plan.calibrate``) and the data loader's
measured cost.

A step of ``a`` micro-batches of ``m`` samples takes ``a * t(m) + t(optimizer) + the exposed
all-reduce + a * loader(m)``, each ``t`` the operators' fixed costs plus their FLOPs or bytes
over the rates; on a GPU, which launches while it computes, the larger of the two. DDP's
all-reduce hides behind the last micro-batch's backward, except under OOM recovery, which
reduces after it. ``loader(m)`` is the data loader's cost of one batch of ``m`` samples,
measured on the dataset itself (``measure_loader``): the loader gathers each batch on the
training thread (``datapipe.loader``), so on CPU it adds to the step; on a GPU the host
gathers while the device computes, and the step takes the larger of the two.

Left out, and why the figures rank plans better than they promise a number: a kernel's speed
at shapes far from the calibrated ones; page faults on CPU (the trainer and the calibration keep
freed memory in glibc's heap, ``keep_freed_host_memory``, so large tensors reuse pages; under
another allocator a larger micro-batch pays faults the model does not see); torch.compile's
fusion on CPU, and on a GPU beyond one factor (``compiled_speed``), and the time it compiles;
the kernels a GPU picks per shape; and several workers sharing one host's cores (a plan is
timed at the planning process's thread count).
``memtrain plan --measure`` and ``make bench-plan`` measure the error (``trainer.plan.measure``).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

from trainer.parallel.fsdp import FsdpSettings
from trainer.plan.devices import DeviceSpeed, compiled_speed
from trainer.plan.work import StepWork

log = logging.getLogger("memtrain.planner")

@dataclass(frozen=True)
class LoaderCost:
    """The data loader's cost of one batch of ``m`` samples: ``per_batch + m * per_sample``
    seconds on the training thread, and how it was measured."""

    per_batch: float
    per_sample: float
    source: str = ""

    def seconds(self, batch: int) -> float:
        return self.per_batch + batch * self.per_sample


def measure_loader(path: str, column: str, world_size: int, batch_size: int, seed: int = 0,
                   shuffle: bool = True, shuffle_window: int = 8192,
                   budget_seconds: float = 1.0) -> LoaderCost:
    """Time rank 0's loader of the dataset at ``path`` as a run reads it: batches of 1 and of
    ``batch_size`` samples, each loader's first batch (which opens the first window) left out,
    then as many as ``budget_seconds`` allow (at least 4 of each). Raises what the loader
    raises for a dataset it cannot read (``datapipe.manifest.DatasetError``, ``OSError``)."""
    from trainer.batches import TokenLoader  # with a loss mask and document ids where present

    def per_batch(size: int) -> float:
        with TokenLoader(path, column, rank=0, world_size=world_size, batch_size=size,
                         seed=seed, shuffle=shuffle, shuffle_window=shuffle_window) as loader:
            next(loader)
            count, start, limit = 0, time.perf_counter(), len(loader) - 1  # within the epoch
            while count < limit and (count < 4
                                     or time.perf_counter() - start < budget_seconds / 2):
                next(loader)
                count += 1
            return (time.perf_counter() - start) / max(1, count)

    one = per_batch(1)
    if batch_size <= 1:
        return LoaderCost(one, 0.0, f"{one * 1e6:,.0f} us a batch of 1")
    many = per_batch(batch_size)
    sample = max(0.0, (many - one) / (batch_size - 1))
    return LoaderCost(max(0.0, one - sample), sample,
                      f"{one * 1e6:,.0f} us a batch of 1, {many * 1e6:,.0f} us of {batch_size}")


@dataclass(frozen=True)
class StepTime:
    """A plan's predicted step, its parts in seconds, and tokens/s over all ranks."""

    seconds: float
    forward_backward: float
    optimizer: float
    allreduce: float  # DDP's all-reduce, or FSDP's collectives and offload copies, not hidden
    data: float
    tokens_per_s: float


def fsdp_seconds(param_bytes: int, speed: DeviceSpeed, fsdp: FsdpSettings, world_size: int,
                 accumulation: int) -> float:
    """FSDP's communication in one optimizer step, before any overlap: each micro-batch
    all-gathers every block in the parameter dtype for forward, and again for backward unless
    ``reshard_after_forward`` keeps them (a group of N gathers backward's within the group);
    gradients are reduce-scattered once, in the reduction dtype; under CPU offload each gather's
    shard is copied to the device first and each gradient shard back (over the host link:
    nothing on a CPU run)."""
    share = (world_size - 1) / world_size
    param, reduce = fsdp.param_share, fsdp.reduce_share
    reshard = fsdp.reshard_after_forward
    backward = 1.0 if reshard is True else 0.0 if reshard is False else \
        (reshard - 1) / reshard / share if share else 0.0
    rate = speed.gather_bytes_per_s or speed.allreduce_bytes_per_s
    moved = accumulation * (1 + backward) * share * param_bytes * param \
        + share * param_bytes * reduce
    seconds = moved / rate
    if fsdp.offload == "cpu" and speed.host_link_bytes_per_s:
        shard = param_bytes / world_size
        seconds += (accumulation * (1 + backward) + 1) * shard / speed.host_link_bytes_per_s
    return seconds


def all_to_all_seconds(forward_bytes: int, size: int, speed: DeviceSpeed,
                       recomputed: float = 0.0) -> float:
    """Ulysses' all-to-alls in one micro-batch of ``parallel.sequence: size``: each rank takes
    ``forward_bytes`` into one forward's all-to-alls (queries, keys, values and attention's
    output, every layer) and sends ``(size - 1) / size`` of them to the other ranks; backward
    moves their gradients, the same bytes, and a checkpointed block's recomputation moves its
    forward's again (``recomputed``: the share of the blocks recomputed). Nothing overlaps
    them: attention waits for its inputs. At the device's all-reduce bus rate: NVLink between
    the GPUs of a node; gloo over loopback on CPU, where ``bench.gloo_link``'s all-to-all ran
    at about its all-reduce's rate, 2 to 3.6 times its all-gather's (1 MiB a rank, 2 and 4
    ranks, on a busy 2-core Xeon: 0.83 and 0.60 GB/s against 0.77 and 0.49)."""
    return all_to_all_sent_bytes(forward_bytes, size, recomputed) / speed.allreduce_bytes_per_s


def all_to_all_sent_bytes(forward_bytes: int, size: int, recomputed: float = 0.0) -> int:
    """The bytes one rank sends in ``all_to_all_seconds``' all-to-alls."""
    if size <= 1:
        return 0
    return int((2 + recomputed) * forward_bytes * (size - 1) / size)


def strategy_seconds(speed: DeviceSpeed, offloaded_bytes: int, trained_numel: int,
                     states: str) -> float:
    """What the memory strategies add to a step, beyond the work the probe recorded (which
    already holds a LoRA model's own forward and backward):

    - activation offload: each offloaded byte to the host and back, over the host link on a GPU
      (not overlapped with compute here: an upper bound; torchtune overlaps most of it), as
      memory copies on a CPU (read and written, both ways);
    - low-bit or bf16 AdamW states: the step dequantizes both moments to fp32 and quantizes them
      back, as memory traffic (8 bytes read and 8 written per moment value beyond fp32's step).
    The optimizer step in backward does the same arithmetic parameter by parameter: nothing.
    """
    seconds = 0.0
    if offloaded_bytes:
        if speed.host_link_bytes_per_s:
            seconds += 2 * offloaded_bytes / speed.host_link_bytes_per_s
        else:
            seconds += 2 * 2 * offloaded_bytes / speed.rate("memory:fp32")
    if states != "fp32":
        seconds += 2 * 16 * trained_numel / speed.rate("memory:fp32")
    return seconds


def step_time(work: StepWork, speed: DeviceSpeed, micro_batch: int, accumulation: int,
              world_size: int = 1, overlap_allreduce: bool = True,
              loader: LoaderCost | None = None, loss_chunk_tokens: int | None = None,
              fsdp: FsdpSettings | None = None) -> StepTime:
    """The predicted time of one optimizer step of ``accumulation`` micro-batches (``loader``:
    the data loader's measured cost, none where not given; ``loss_chunk_tokens``: the chunked
    loss's chunk, else the recorded one; ``fsdp``: FSDP's collectives in place of DDP's
    all-reduce)."""
    fb = speed.seconds(work.forward_backward(micro_batch, loss_chunk_tokens), work.autocast) \
        + work.checkpointed_blocks * speed.op_seconds.get("checkpoint", 0.0)
    optimizer = speed.seconds(work.optimizer)
    allreduce = 0.0
    if fsdp is not None:
        allreduce = fsdp_seconds(work.grad_bytes, speed, fsdp, world_size, accumulation)
        # All-gathers are prefetched behind the blocks' compute: about 2/3 of it hides them.
        allreduce = max(0.0, allreduce - accumulation * fb * 2 / 3)
    elif world_size > 1:
        ring = 2 * (world_size - 1) / world_size * work.grad_bytes
        allreduce = ring / speed.allreduce_bytes_per_s
        if overlap_allreduce:  # behind the last micro-batch's backward, about 2/3 of it
            allreduce = max(0.0, allreduce - fb * 2 / 3)
    compute = accumulation * fb + optimizer + allreduce
    data = accumulation * loader.seconds(micro_batch) if loader else 0.0
    # On a GPU the host gathers batches while the device computes: only what is left over
    # counts. On CPU both run on the training thread.
    if speed.asynchronous:
        data = max(0.0, data - compute)
    seconds = compute + data
    tokens = micro_batch * accumulation * work.seq_len * world_size
    return StepTime(seconds, accumulation * fb, optimizer, allreduce, data, tokens / seconds)


@dataclass(frozen=True)
class SpeedModel:
    """What the planner predicts step times with: the device's speed and the run's shape."""

    device: DeviceSpeed
    world_size: int = 1
    overlap_allreduce: bool = True  # DDP's overlap with backward (off under OOM recovery)
    loader: LoaderCost | None = None  # the data loader's measured cost (measure_loader)
    compiled: bool = False  # torch.compile on a GPU (compiled_speed)
    fsdp: FsdpSettings | None = None  # FSDP's settings: its collectives (None: DDP)

    @functools.cached_property
    def step_device(self) -> DeviceSpeed:
        """The speed steps are predicted at: ``device``, compiled where ``compiled``."""
        return compiled_speed(self.device) if self.compiled else self.device

    def predict(self, work: StepWork, micro_batch: int, accumulation: int,
                loss_chunk_tokens: int | None = None) -> StepTime:
        return step_time(work, self.step_device, micro_batch, accumulation, self.world_size,
                         self.overlap_allreduce, self.loader, loss_chunk_tokens, self.fsdp)
