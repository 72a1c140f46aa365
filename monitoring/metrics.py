"""The metrics contract: the single source of metric names, kinds, labels, units and help text.

Names follow ``memtrain_<area>_<what>_<unit>``; counters end in ``_total``. Every series carries
the labels in ``LABELS`` and nothing unbounded (no steps, no paths). ``gpu_uuid`` (NVML's
``GPU-...``, empty on CPU) and ``hostname`` (the pod name on Kubernetes) are there to join other
GPU views: dcgm-exporter's series carry the same UUID in ``UUID`` and the host in ``Hostname``.
Under Ray the node's metrics endpoint exposes a metric ``memtrain_x`` as ``ray_memtrain_x``; the
standalone exporter (``monitoring.sinks.PrometheusSink``) uses the same final names
(``exposed_name``), so one set of dashboards and alert rules serves both.

Families: ``cuda`` (the PyTorch caching allocator, from ``torch.cuda.memory_stats()``), ``device``
(NVML, else ``torch.cuda.mem_get_info``), ``host`` and ``train``. On CPU runs the ``cuda`` and
``device`` families are absent, not zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LABELS = ("run", "rank", "local_rank", "node", "device", "gpu_uuid", "hostname")
RAY_PREFIX = "ray_"
# Step-time histogram buckets, seconds: from fast GPU steps to slow CPU ones.
STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Literal["gauge", "counter", "histogram"]
    family: Literal["cuda", "device", "host", "train"]
    help: str
    # Labels of this metric's own beyond LABELS, each with a bounded set of values; a value of
    # such a metric is published as {label value: number}.
    extra_labels: tuple[str, ...] = ()

    @property
    def exposed_name(self) -> str:
        """The name Prometheus sees, for Ray's endpoint and the standalone exporter alike."""
        return RAY_PREFIX + self.name


METRICS: tuple[MetricSpec, ...] = (
    # CUDA caching allocator (per worker).
    MetricSpec("memtrain_gpu_memory_allocated_bytes", "gauge", "cuda",
               "Bytes held by live tensors (allocator current)."),
    MetricSpec("memtrain_gpu_memory_reserved_bytes", "gauge", "cuda",
               "Bytes reserved by the caching allocator from the device."),
    MetricSpec("memtrain_gpu_memory_active_bytes", "gauge", "cuda",
               "Bytes in active allocator blocks."),
    MetricSpec("memtrain_gpu_memory_peak_allocated_bytes", "gauge", "cuda",
               "Highest allocated bytes within the last monitoring.peak_window_seconds."),
    MetricSpec("memtrain_gpu_memory_inactive_split_bytes", "gauge", "cuda",
               "Bytes in inactive, split blocks: allocator fragmentation."),
    MetricSpec("memtrain_gpu_alloc_retries_total", "counter", "cuda",
               "Allocations that needed a cache flush and retry."),
    MetricSpec("memtrain_gpu_ooms_total", "counter", "cuda",
               "Out-of-memory errors raised by the allocator."),
    # Device, through NVML.
    MetricSpec("memtrain_gpu_device_used_bytes", "gauge", "device",
               "Device memory in use, all processes (NVML)."),
    MetricSpec("memtrain_gpu_device_total_bytes", "gauge", "device",
               "Device memory in total (NVML)."),
    # Host.
    MetricSpec("memtrain_host_rss_bytes", "gauge", "host", "Resident memory of the worker."),
    MetricSpec("memtrain_host_pinned_bytes", "gauge", "host",
               "Pinned host memory held by the data loader's staging buffers."),
    # Training.
    MetricSpec("memtrain_train_step_seconds", "histogram", "train",
               "Wall time of one optimizer step."),
    MetricSpec("memtrain_train_samples_total", "counter", "train", "Samples trained on."),
    MetricSpec("memtrain_train_tokens_total", "counter", "train", "Tokens trained on."),
    MetricSpec("memtrain_train_run_active", "gauge", "train",
               "1 while the worker's training loop runs (republished on a timer), 0 at its end."),
    MetricSpec("memtrain_train_loss", "gauge", "train", "Training loss at the last log step."),
    MetricSpec("memtrain_train_grad_norm", "gauge", "train",
               "Gradient norm before clipping at the last log step."),
    MetricSpec("memtrain_train_grad_scale", "gauge", "train", "GradScaler scale (1 without)."),
    MetricSpec("memtrain_train_skipped_steps_total", "counter", "train",
               "Optimizer steps skipped for non-finite gradients."),
    MetricSpec("memtrain_data_wait_seconds_total", "counter", "train",
               "Seconds spent waiting for the data loader."),
    MetricSpec("memtrain_checkpoint_seconds_total", "counter", "train",
               "Seconds spent saving checkpoints, in the step or beside it (asynchronous)."),
    MetricSpec("memtrain_checkpoint_blocking_seconds_total", "counter", "train",
               "Seconds the training step waited for checkpoints (the whole save, or an "
               "asynchronous save's staging and the wait for the one before)."),
    MetricSpec("memtrain_train_micro_batch_size", "gauge", "train",
               "Current micro-batch size (changes under auto and OOM recovery)."),
    MetricSpec("memtrain_train_accumulation_steps", "gauge", "train",
               "Current micro-batches per optimizer step."),
    MetricSpec("memtrain_train_world_size", "gauge", "train", "Workers in the running group."),
    MetricSpec("memtrain_train_world_size_changes_total", "counter", "train",
               "Resumes at another world size than the checkpoint's (an elastic resize, a lost "
               "node, another --workers)."),
    MetricSpec("memtrain_train_restarts_total", "counter", "train",
               "Restarts of the run after a failure, by cause (worker_error, controller_error, "
               "node_lost, resize, relaunch, worker_exit): the whole run's count, published by "
               "rank 0.",
               extra_labels=("cause",)),
    MetricSpec("memtrain_train_recovery_seconds_total", "counter", "train",
               "Seconds lost to restarts: from a failed attempt's last step to the next "
               "attempt's first, summed over the whole run (rank 0)."),
    MetricSpec("memtrain_data_skipped_shards_total", "counter", "train",
               "Bad shards skipped by the loader (on_bad_shard: skip)."),
)

BY_NAME = {spec.name: spec for spec in METRICS}


def spec(name: str) -> MetricSpec:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not in the metrics contract (monitoring/metrics.py)") from None
