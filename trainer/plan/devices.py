"""How fast a device runs each kind of work (``DeviceSpeed``): a GPU from its datasheet peaks
times the share eager PyTorch reaches (``gpu_speed``; ``make gpu-check`` measures that share
against its rows), compiled or not (``compiled_speed``); a CPU from its calibration
(``trainer.plan.calibrate``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from trainer.plan.work import BYTE_KINDS, DTYPES, FLOP_KINDS, Work

log = logging.getLogger("memtrain.planner")

# A calibration is stable when the small GPT's steps it times take, at the median of their
# repeats, at most this much longer than at their fastest (``repeat_spread``): 1-4% on an idle
# 2-core EPYC, 10-40% beside a test suite's other process. An unstable one is used by the call
# that took it, and taken again by the next process that finds it in the cache.
CALIBRATION_SPREAD_BOUND = 0.10
# Datasheet peaks of the GPUs a plan can name (dense, no sparsity): FLOP/s per dtype (fp32
# without TF32: torch's default for matrix products) and memory bandwidth in bytes/s.
GPU_PEAKS: dict[str, dict[str, float]] = {
    "h200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "bandwidth": 4.8e12},
    "h100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "bandwidth": 3.35e12},
    "a100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "bandwidth": 2.0e12},
}
# The share of those peaks an eager PyTorch step reaches: FLOPs by dtype, and bandwidth. Fitted
# to ``make gpu-check``'s H200 rows of 2026-11-30 (GPT-2 124M, micro-batch 16, fp32 and bf16 x
# no, selective and full checkpointing; measured 774 TFLOP/s for a bf16 8192^3 product): the
# model then predicts those rows' tokens/s within -8% to +4%, in the measured order.
GPU_EFFICIENCY = {"fp32": 0.75, "bf16": 0.7, "fp16": 0.7, "memory": 0.6}
GPU_LAUNCH_SECONDS = 6e-6
# torch.compile (Inductor) fuses a step's elementwise, normalising and conversion operators into
# fewer kernels that read and write less; matrix products and attention stay as they are. On a
# GPU the model counts those operators' bytes and launches at this share
# (``compiled_speed``), fitted to ``make gpu-check``'s compiled row of 2026-11-30 (H200, GPT-2
# 124M, bf16, no checkpointing, micro-batch 16: 452,726 tokens/s compiled, 335,620 eager; the
# model then predicts 1.35x). One row of one model: the fusion of other models is a guess.
GPU_COMPILED_SHARE = 0.57
# Collective bandwidth (bus bytes/s). On a GPU, NCCL over NVLink between the GPUs of a node
# (H100/H200 class, about a third of its 900 GB/s after NCCL's protocol), all-gather and
# reduce-scatter at the all-reduce's rate. On CPU, gloo over loopback, measured on the 2-core
# AMD EPYC (Zen 5), idle, 16 MiB a rank (``python -m bench.gloo_link``,
# bench/results/gloo-link-2026-12-03-vm.json): all-reduce 1.23 GB/s at 2 ranks and 1.01 at 4,
# all-gather 0.39 at both, reduce-scatter 0.34 and 0.29: FSDP's collectives are the slow ones.
ALLREDUCE_BYTES_PER_S = {"cuda": 300e9, "cpu": 1.1e9}
GATHER_BYTES_PER_S = {"cuda": 300e9, "cpu": 0.35e9}
# FSDP's CPU offload: a GPU's copies to and from pinned host memory (PCIe Gen5 x16, about 64 GB/s
# each way on the datasheet, at the memory efficiency above). A CPU run copies nothing: 0.
HOST_LINK_BYTES_PER_S = {"cuda": 64e9 * 0.6, "cpu": 0.0}


@dataclass(frozen=True)
class DeviceSpeed:
    """How fast a device runs each kind of work: ``rates`` in FLOP/s (matmul, attention) or
    bytes/s (memory, math, convert) by key ``kind:dtype[:kK]``, the fixed seconds of one
    operator by kind, and whether operators overlap their launches (a GPU)."""

    name: str
    rates: dict[str, float]
    op_seconds: dict[str, float]  # by kind
    allreduce_bytes_per_s: float
    asynchronous: bool = False  # a GPU: the host launches while the device computes
    source: str = ""
    # A CPU's calibration: when it was taken (Unix seconds) and how far its repeats spread
    # (``CALIBRATION_SPREAD_BOUND``); 0 for a GPU's datasheet figures.
    calibrated_at: float = 0.0
    spread: float = 0.0
    # FSDP: all-gather and reduce-scatter bus bytes/s (0: the all-reduce's rate), and copies to
    # and from the host under CPU offload (0: none, host and device being the same memory).
    gather_bytes_per_s: float = GATHER_BYTES_PER_S["cpu"]
    host_link_bytes_per_s: float = 0.0

    @property
    def stable(self) -> bool:
        return self.spread <= CALIBRATION_SPREAD_BOUND

    def describe(self, now: float | None = None) -> str:
        """Where the figures come from, and for a calibration its age and stability."""
        if not self.calibrated_at:
            return self.source
        age = max(0.0, (time.time() if now is None else now) - self.calibrated_at)
        ago = (f"{age / 86400:.0f} days" if age >= 2 * 86400 else
               f"{age / 3600:.0f} h" if age >= 2 * 3600 else f"{age / 60:.0f} min")
        verdict = "stable" if self.stable else \
            f"over {CALIBRATION_SPREAD_BOUND:.0%}: unstable, measured again at the next plan"
        return f"{self.source}, {ago} ago, repeats within {self.spread:.0%} ({verdict})"

    def rate(self, key: str) -> float:
        """The rate of ``key``, else of a less specific key (no size, then fp32)."""
        parts = key.split(":")
        for candidate in (key, ":".join(parts[:2]), f"{parts[0]}:fp32"):
            if candidate in self.rates:
                return self.rates[candidate]
        fallback = "matmul:fp32:k256" if parts[0] in FLOP_KINDS else "memory:fp32"
        return self.rates[fallback]

    def seconds(self, work: Work, autocast: bool = False) -> float:
        """Seconds of ``work``; ``autocast``: run under a low precision's autocast, whose
        dispatch multiplies every operator's fixed cost by ``op_seconds["autocast"]``."""
        launch = compute = 0.0
        scale = self.op_seconds.get("autocast", 1.0) if autocast else 1.0
        for key in work.kinds():
            kind = key.split(":")[0]
            launch += work.ops.get(key, 0) * self.op_seconds.get(kind, 0.0) * scale
            if kind != "view":
                compute += work.amount.get(key, 0) / self.rate(key)
        return max(launch, compute) if self.asynchronous else launch + compute

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def gpu_speed(name: str, efficiency: dict[str, float] | None = None) -> DeviceSpeed:
    """A GPU from its datasheet peaks (``GPU_PEAKS``) times the share eager PyTorch reaches."""
    key = name.lower().replace("nvidia", "").replace(" ", "").split("-")[0]
    match = next((gpu for gpu in GPU_PEAKS if key.startswith(gpu)), None)
    if match is None:
        raise ValueError(f"GPU {name!r} has no peak figures; known: {', '.join(GPU_PEAKS)}")
    eff = {**GPU_EFFICIENCY, **(efficiency or {})}
    peaks = GPU_PEAKS[match]
    rates = {f"{kind}:{dtype}": peaks[dtype] * eff[dtype]
             for kind in FLOP_KINDS for dtype in DTYPES.values()}
    rates.update({f"{kind}:{dtype}": peaks["bandwidth"] * eff["memory"]
                  for kind in BYTE_KINDS for dtype in DTYPES.values()})
    launch = {kind: GPU_LAUNCH_SECONDS for kind in (*FLOP_KINDS, *BYTE_KINDS)}
    return DeviceSpeed(match.upper(), rates, {**launch, "view": 0.0},
                       ALLREDUCE_BYTES_PER_S["cuda"], asynchronous=True,
                       gather_bytes_per_s=GATHER_BYTES_PER_S["cuda"],
                       host_link_bytes_per_s=HOST_LINK_BYTES_PER_S["cuda"],
                       source=f"datasheet peaks x {eff['bf16']:.0%} (bf16), "
                              f"{eff['fp32']:.0%} (fp32), {eff['memory']:.0%} (bandwidth)")


def compiled_speed(device: DeviceSpeed, share: float = GPU_COMPILED_SHARE) -> DeviceSpeed:
    """``device`` (a GPU) running a ``torch.compile``'d step: the byte-counted operators'
    bytes and launches at ``share`` of the eager step's (``GPU_COMPILED_SHARE``)."""
    if not device.asynchronous:
        raise ValueError(f"{device.name}: the compiled step is modelled on GPUs only")
    rates = {key: rate / share if key.split(":")[0] in BYTE_KINDS else rate
             for key, rate in device.rates.items()}
    op_seconds = {kind: seconds * share if kind in BYTE_KINDS else seconds
                  for kind, seconds in device.op_seconds.items()}
    return dataclasses.replace(device, rates=rates, op_seconds=op_seconds,
                               source=f"{device.source}; compiled: element-wise work x {share}")


def named_gpu_speed(name: str | None) -> DeviceSpeed:
    """``gpu_speed(name)``, or an H200's where no GPU is named or the name has no figures
    (said in the log)."""
    if name is None:
        log.info("planner: no GPU to plan for here; planning speed with an H200's figures")
    else:
        try:
            return gpu_speed(name)
        except ValueError as err:
            log.info("planner: %s; planning speed with an H200's", err)
    return gpu_speed("h200")
