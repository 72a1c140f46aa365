"""Every private or experimental torch and Ray API memtrain uses, in one place.

torch is pinned at 2.13.0 and Ray at 2.60.0, and each function here wraps one API that those
projects may move or rename without notice. ``tests/unit/test_compat.py`` calls each of them
and fails naming the installed torch or Ray version when one has moved, so an upgrade breaks
there, with a clear line, and not deep inside a run. Nothing here imports ``ray`` at import
time, nor ``torch``: ``memtrain submit`` uses the Ray helpers on machines without torch, so every
torch API is imported inside the function that wraps it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch
    from torch import nn

CpuBf16 = Literal["native", "onednn-emulated", "emulated"]


def checkpoint_wrapper_api() -> ModuleType:
    """torch's activation-checkpointing module wrapper (``CheckpointWrapper``,
    ``checkpoint_wrapper``, ``CheckpointImpl``, ``apply_activation_checkpointing``). It lives in a
    private package of torch.distributed; torchtitan and FSDP's docs use it, and there is no
    public equivalent."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper

    return checkpoint_wrapper


# oneDNN's names for the instruction sets ``ONEDNN_MAX_CPU_ISA`` may cap it at (its "CPU
# dispatcher control" guide), by what they give bf16 matrix products on an AVX-512 CPU.
ONEDNN_NATIVE_BF16_ISAS = frozenset({
    "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
    "AVX10_2_512_AMX_2"})
ONEDNN_EMULATED_BF16_ISAS = frozenset({"AVX512_CORE", "AVX512_CORE_VNNI"})
ONEDNN_BELOW_AVX512_ISAS = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"})


def onednn_max_cpu_isa(environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """The instruction set oneDNN is capped at (``ONEDNN_MAX_CPU_ISA``, or its older name
    ``DNNL_MAX_CPU_ISA``), upper-cased; None where unset, ``ALL`` or ``DEFAULT``, or a value
    oneDNN does not know (it ignores those too). oneDNN reads the variable once, at its first
    kernel, so a process sets it before it starts."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = environ.get(name, "").strip().upper()
        if value:
            known = ONEDNN_NATIVE_BF16_ISAS | ONEDNN_EMULATED_BF16_ISAS | ONEDNN_BELOW_AVX512_ISAS
            return value if value in known else None
    return None


def bf16_kind(cpu_native: bool, cpu_avx512: bool, max_isa: str | None) -> CpuBf16:
    """What oneDNN runs bf16 matrix products with, from what the CPU has (``cpu_native``:
    AVX512_BF16 or AMX; ``cpu_avx512``: AVX-512 BW/VL/DQ, oneDNN's bf16 emulation) and the
    instruction set it is capped at (``onednn_max_cpu_isa``). A cap below AVX-512 leaves no
    oneDNN bf16 kernel: ``emulated``."""
    native_allowed = max_isa is None or max_isa in ONEDNN_NATIVE_BF16_ISAS
    avx512_allowed = native_allowed or max_isa in ONEDNN_EMULATED_BF16_ISAS
    if cpu_native and native_allowed:
        return "native"
    if (cpu_native or cpu_avx512) and avx512_allowed:
        return "onednn-emulated"
    return "emulated"


def cpu_bf16_support(environ: dict[str, str] | os._Environ[str] = os.environ) -> CpuBf16:
    """How this process's bf16 matrix products run on the CPU: what the CPU has, under the cap
    ``ONEDNN_MAX_CPU_ISA`` puts on oneDNN (``bf16_kind``; ``environ``: the environment of the
    process asked about, this one's by default).

    - ``native``: AVX512_BF16 or AMX instructions; oneDNN runs bf16 kernels directly.
    - ``onednn-emulated``: AVX-512 without them (or with them, and oneDNN capped at
      ``AVX512_CORE``); oneDNN takes bf16 and emulates it with fp32 instructions (its own
      conversions and buffers).
    - ``emulated``: no oneDNN bf16 at all (for example AVX2 only); ATen's fallback kernels
      convert around fp32 arithmetic.
    The two emulated kinds are about 2-3x slower than fp32 and allocate temporaries the native
    path does not (``trainer.plan.emulation`` measures them).
    """
    import torch

    cpu_native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return bf16_kind(cpu_native, torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                     onednn_max_cpu_isa(environ))


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode``: tensors made inside have shapes, dtypes, devices and storages but
    no data, and operators on them compute only those (torch.compile's tracer, private but
    stable since torch 2.0)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


@contextlib.contextmanager
def modules_kept_in_place() -> Iterator[None]:
    """``nn.Module.to`` returns a module untouched where every tensor of it already has the
    device and dtype asked for. Under ``fake_tensor_mode`` torch swaps a module's parameters even
    for such a move (``Module._apply`` on fake parameters), which fails; PEFT moves each adapter
    it injects to its base layer's device so, a move that changes nothing here."""
    import torch
    from torch import nn

    to = nn.Module.to

    def kept_in_place(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if all((device is None or t.device == device) and
               (dtype is None or not t.is_floating_point() or t.dtype == dtype) for t in tensors):
            return self
        return to(self, *args, **kwargs)

    nn.Module.to = kept_in_place  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.to = to  # type: ignore[method-assign]


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor (``fake_tensor_mode``'s: no data to copy)."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return bool(_is_fake(tensor))


@contextlib.contextmanager
def hf_positions_read_as_unpacked() -> Iterator[None]:
    """transformers' check for packed documents in ``position_ids`` (``masking_utils.
    find_packed_sequence_indices``, private) answers "none", as it does on a real forward whose
    positions run 0 to T-1. On fake tensors it cannot read them and assumes packing: it builds an
    explicit mask, and SDPA leaves its grouped-query path for ``repeat_kv``'s copies of every key
    and value head, bytes a real step never holds."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def compile_cache_of_states(states: str) -> None:
    """Compiles in this process from here on keep inductor's on-disk caches (its FX graph
    cache and AOTAutograd's) in a directory of their own for torchao's ``states`` format
    (``memtrain-states-8bit`` beside the user's cache directory, ``TORCHINDUCTOR_CACHE_DIR``),
    which every run of a user shares. The caches' keys do not tell 8-bit and 4-bit states
    apart under FSDP's DTensors: a step compiled for one format was taken from the cache for
    the other and failed ("wrong number of dimensions"); one format's graphs are still cached
    for its next run. ``tests/distributed/test_strategies.py`` runs both in either order."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    base = Path(cache_dir())
    if base.name.startswith(_STATES_CACHE):  # a format's already (a worker of this process)
        base = base.parent
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / f"{_STATES_CACHE}{states}")


_STATES_CACHE = "memtrain-states-"


def compile_counts() -> tuple[int, float]:
    """(frames torch.compile has compiled, seconds spent compiling) in this process so far:
    dynamo's own counters (private; every torch.compile user reads them, torchtitan included).
    A backward graph is compiled lazily, at the first backward, and counted in the seconds."""
    from torch._dynamo import utils

    metrics = utils.compilation_time_metrics
    seconds = sum(sum(metrics.get(key, ())) for key in ("_compile.compile_inner",
                                                         "backward._backward_impl"))
    return int(utils.counters["frames"]["ok"]), seconds


def cpu_capability() -> str:
    """The instruction set ATen's CPU kernels were dispatched to (``AVX512``, ``AVX2``, ...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def is_checkpoint_wrapper(module: nn.Module) -> bool:
    return isinstance(module, checkpoint_wrapper_api().CheckpointWrapper)


def allocator_settings() -> str:
    """The CUDA caching allocator's effective settings, or the environment's request."""
    import torch

    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return getter() or "(defaults)"
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "(defaults)") + " (requested)"


def record_memory_history(enabled: bool = True, max_entries: int = 100_000) -> None:
    """CUDA: start (or stop) recording allocations with Python stacks, for snapshots."""
    import torch

    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: Path) -> None:
    """CUDA: the recorded history as a pickle that pytorch.org/memory_viz opens."""
    import torch

    torch.cuda.memory._dump_snapshot(str(path))


def _event_tree(prof: torch.profiler.profile) -> list[Any]:
    """The root events of a finished profile (``experimental_event_tree``)."""
    assert prof.profiler is not None and prof.profiler.kineto_results is not None, \
        "the profile must have finished"
    return prof.profiler.kineto_results.experimental_event_tree()


# torch's profiler library (Kineto) logs to file descriptor 2 from C++, bypassing Python's
# logging, in glog's shape: "USDT:2026-12-03 13:05:48 8853:8853 SyncActivityProfilerHandler.cpp:52]
# profiler_start". There is no setting for that level (KINETO_LOG_LEVEL leaves it on).
_NATIVE_LOG_LINE = re.compile(rb"^[A-Z]+:\d{4}-\d\d-\d\d [\d:.]+ \d+:\d+ [\w.]+:\d+\] ")


@contextlib.contextmanager
def quiet_native_logs() -> Iterator[None]:
    """Hold back what torch's native profiler logs to the process's stderr inside the block:
    its lines go to the ``memtrain`` logger at DEBUG (``memtrain --debug`` shows them); any
    other stderr output of the block is written back after it, unchanged. Where the logger is
    at DEBUG already, nothing is held back."""
    log = logging.getLogger("memtrain")
    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held:
                if _NATIVE_LOG_LINE.match(line):
                    log.debug("torch: %s", line.decode(errors="replace").rstrip())
                else:
                    os.write(2, line)


def cpu_allocation_events(prof: torch.profiler.profile) -> list[tuple[int, int, int]]:
    """``(time ns, bytes allocated (+) or freed (-), running total after)`` of every CPU
    allocation a finished ``profile(profile_memory=True)`` recorded, in time order.

    Read from the profiler's event tree (``experimental_event_tree``): the memory profile's
    own data-flow pass asserts on FSDP's ops, and the tree is the only other place that keeps
    the allocator's running total.
    """
    from torch._C._profiler import _EventType

    pending = list(_event_tree(prof))
    events = []
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            events.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
    return sorted(events)


def ray_server_version(client: Any) -> str | None:
    """The Ray version a ``JobSubmissionClient``'s cluster answered at ``/api/version`` (kept
    by the client in a private attribute; there is no public getter)."""
    return client._server_ray_version


def ray_loopback_init_kwargs(node_ip: str, metrics_export_port: int | None) -> dict[str, Any]:
    """``ray.init`` keywords that pin a new local cluster's node IP (and metrics port).

    Ray documents no public way to choose the node IP of a cluster that ``ray.init`` starts;
    ``ray start --node-ip-address`` is the CLI's equivalent.
    """
    kwargs: dict[str, Any] = {"_node_ip_address": node_ip}
    if metrics_export_port is not None:
        kwargs["_metrics_export_port"] = metrics_export_port
    return kwargs



def ray_metrics_export_seconds() -> float:
    """How often a Ray worker exports its metrics to the node's agent, in seconds.

    Ray 2.60 floors ``metrics_report_interval_ms`` at 1 s for the export (``src/ray/stats/
    stats.h``), and its agent drops a gauge not refreshed for two exports
    (``open_telemetry_metric_recorder.py``). The config is read through ``ray._config``.
    """
    import ray

    return max(ray._config.metrics_report_interval_ms(), 1000) / 1000


def ray_grafana_dashboards() -> dict[str, str]:
    """Ray's own Grafana dashboards (Default and Train), uid -> JSON, as Ray's head generates
    them into ``/tmp/ray/session_latest/metrics/grafana/dashboards``: the dashboards its web UI
    embeds by uid once ``RAY_GRAFANA_HOST`` is set. Ray has no public API for them; this is its
    dashboard factory module."""
    from ray.dashboard.modules.metrics import grafana_dashboard_factory as factory

    made = {}
    for generate in (factory.generate_default_grafana_dashboard,
                     factory.generate_train_grafana_dashboard):
        content, uid = generate()
        made[uid] = content
    return made


def cpu_op_workspace_bytes(prof: torch.profiler.profile, op_names: frozenset[str]) -> int:
    """The most CPU memory any call of the named ops allocated and freed again before it ended
    (kernel workspace, conversion buffers), from a finished ``profile(profile_memory=True)``.

    For each such call: the highest running total inside it less the larger of the totals just
    before and just after it, so its outputs (alive after it) do not count.
    """
    from torch._C._profiler import _EventType

    def allocations(event: Any) -> list[Any]:
        found, pending = [], list(event.children)
        while pending:
            child = pending.pop()
            pending.extend(child.children)
            if child.tag == _EventType.Allocation and child.extra_fields.device.type == "cpu":
                found.append(child)
        return sorted(found, key=lambda e: e.start_time_ns)

    workspace = 0
    pending = list(_event_tree(prof))
    while pending:
        event = pending.pop()
        if event.tag == _EventType.TorchOp and event.name in op_names:
            inside = allocations(event)
            if inside:
                before = inside[0].extra_fields.total_allocated - inside[0].extra_fields.alloc_size
                after = inside[-1].extra_fields.total_allocated
                highest = max(e.extra_fields.total_allocated for e in inside)
                workspace = max(workspace, highest - max(before, after))
            continue  # nested calls of the same ops are inside this one's figure
        pending.extend(event.children)
    return workspace


def ray_cancel_train_request(requester_id: str, timeout: float = 10.0) -> None:
    """Cancel a Ray Train run's resource request (``train-<run id>``) in the cluster's
    AutoscalingCoordinator: Ray 2.60's detached actor, from a private package of Ray Data,
    which Train V2's scaling policies register their workers with
    (``ray.train.v2._internal.execution.scaling_policy``). A no-op where the request is gone."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    coordinator = get_or_create_autoscaling_coordinator()
    ray.get(coordinator.cancel_request.remote(requester_id=requester_id), timeout=timeout)


def ddp_ignore(model: nn.Module, names: list[str]) -> None:
    """Have DDP leave the parameters ``names`` (fully qualified) out of everything it does, its
    first broadcast of rank 0's values included (torch's private
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``, pytorch #43690)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def hf_checkpoint_renamer(hf_model: Any, model_names: set[str]
                          ) -> Callable[[str], tuple[str, str | None]]:
    """How ``from_pretrained`` (transformers 5) names a checkpoint's tensor in ``hf_model``:
    a function of the file's name giving the model's, and the pattern of the conversion that
    changes its values, if one does (experts fused, say; None for a rename alone). It applies
    the model class's registered renames, then adds or takes off the base model's prefix where
    ``model_names`` (the model's) call for it (``transformers/core_model_loading.py``
    ``rename_source_key``, ``conversion_mapping.py`` ``get_model_conversion_mapping``)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(hf_model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    wanted = dict.fromkeys(model_names, True)  # the lookup rename_source_key makes of its dict

    def rename(file_name: str) -> tuple[str, str | None]:
        return rename_source_key(file_name, renamings, converters, hf_model.base_model_prefix,
                                 wanted)
    return rename


def hf_fusions(hf_model: Any) -> dict[str, tuple[tuple[str, ...], list[tuple[str, int]]]]:
    """The conversions ``from_pretrained`` (transformers 5) makes of several checkpoint tensors
    into one of ``hf_model``'s (the experts stored one by one, fused): by each source pattern
    (``hf_checkpoint_renamer``'s second answer), all the patterns fused with it, in order, and
    the operations, as (class name, dim) (``MergeModulelist`` stacks a pattern's tensors on
    ``dim``, ``Concatenate`` joins the patterns' on ``dim``: ``conversion_mapping.py``)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    fusions = {}
    for converter in get_model_conversion_mapping(hf_model):
        if isinstance(converter, WeightConverter):
            patterns = tuple(converter.source_patterns)
            steps = [(type(op).__name__, getattr(op, "dim", -1)) for op in converter.operations]
            fusions.update(dict.fromkeys(patterns, (patterns, steps)))
    return fusions


def ray_torch_backend() -> tuple[type, Callable[[], None], Callable[[], tuple[str, int]], type]:
    """Ray Train 2.60's torch backend, to subclass (``_TorchBackend``: its ``on_start`` makes
    the process group with torch's ``env://`` store, which listens on every interface), the
    function that sets torchrun's variables in a worker (``LOCAL_RANK``, ``RANK``, ...), the
    one that picks rank 0's node address and a free port, as its ``on_start`` calls them, and
    Train V1's worker group, for which it sets no torchrun variables
    (``ray/train/torch/config.py``, ``ray/train/_internal/utils.py``)."""
    from ray.train._internal.utils import get_address_and_port
    from ray.train._internal.worker_group import WorkerGroup
    from ray.train.torch.config import _set_torch_distributed_env_vars, _TorchBackend

    return _TorchBackend, _set_torch_distributed_env_vars, get_address_and_port, WorkerGroup


def ray_train_request_id(trainer: Any) -> str:
    """The id a ``TorchTrainer``'s controller registers its resource request under
    (``ray_cancel_train_request``): ``train-`` and the run id of its private run context."""
    return f"train-{trainer.train_run_context.run_id}"


def ray_worker_output_filter(keep: Any) -> None:
    """Pass the workers' output Ray forwards to this driver through ``keep(batch) -> batch``
    (a batch: a dict with the worker's ``pid`` and its ``lines``): Ray 2.60 prints it from one
    handler of a private dispatcher (``ray._private.ray_logging``), registered by ``ray.init``
    as ``"ray_print_logs"``, which is replaced here by one that filters first. A no-op where the
    handler is not there (``log_to_driver=False``)."""
    from ray._private import ray_logging

    dispatcher = ray_logging.global_worker_stdstream_dispatcher
    with dispatcher._lock:
        for index, (name, handler) in enumerate(dispatcher.handlers):
            if name == "ray_print_logs" and not getattr(handler, "memtrain_filter", False):
                def filtered(data: Any, handler: Any = handler) -> None:
                    kept = keep(data)
                    if kept["lines"]:
                        handler(kept)

                filtered.memtrain_filter = True  # type: ignore[attr-defined]
                dispatcher.handlers[index] = (name, filtered)
