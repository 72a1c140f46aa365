"""Memory diagnostics during training: a leak guard, a profiler window, allocator summaries.

- ``LeakGuard`` samples, at step boundaries, the number of live tensors Python can see, the
  process's resident memory and (CUDA) the allocator's allocated bytes. After a warm-up it fits
  nothing fancy: it compares the latest sample to the first one after warm-up and reports growth
  beyond a tolerance. A graph kept alive by a reference (the classic ``total_loss += loss``
  without ``.detach()``) adds tensors every step and is caught; the real loop stays flat.
- ``profiler_window`` runs ``torch.profiler`` with ``profile_memory=True`` for steps A to B (its
  own schedule) and writes a Chrome trace per rank into ``run_dir/profile/``.
- ``write_memory_summary`` writes ``torch.cuda.memory_summary()`` at chosen steps (CUDA only).
- ``cpu_peak_bytes`` reads the CPU allocator's record of one call and returns its peak of live
  tensor bytes: the CPU's ``max_memory_allocated``, which torch does not keep. The planner is
  checked against it on CPU (``tests/unit/test_planner.py``, ``bench/memory.py``).

Counting live tensors walks every object gc tracks: it costs milliseconds, so the guard samples
every ``memory.leak_check_every`` steps, not every step. It reads each object's type and never
the object itself: a ``weakref.proxy`` whose referent has died raises on any other look.

A diagnostic must never cost the run: ``Diagnostics.run`` calls one, and a failure inside it
costs one warning and turns that diagnostic off for the rest of the run.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from monitoring.memory import resident_bytes
from monitoring.run_files import MEMORY_DIR, PROFILE_DIR
from trainer.compat import cpu_allocation_events, quiet_native_logs
from trainer.tensors import local_tensor, plain_tensors

log = logging.getLogger("memtrain")


def live_tensor_count() -> int:
    """Tensors that Python's gc tracks (tensors held by Python references, not by autograd).

    By ``type(obj)``, not ``isinstance``: ``isinstance`` falls back to ``obj.__class__``, which
    a dead ``weakref.proxy`` answers with ``ReferenceError`` (and some deprecated torch objects
    with a warning)."""
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


@dataclass
class Diagnostics:
    """Which of a run's diagnostics are still on: ``run(name, fn)`` calls ``fn`` unless
    ``name`` was turned off; an exception inside it is logged once, as a warning naming the
    diagnostic and the error, and turns ``name`` off. Training goes on either way."""

    rank: int = 0
    off: dict[str, str] = field(default_factory=dict)  # name -> the error that turned it off

    def run(self, name: str, fn: Callable[[], object]) -> object:
        if name in self.off:
            return None
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 (a diagnostic must not cost the run: logged)
            self.off[name] = f"{type(err).__name__}: {err}"
            log.warning("%s failed on rank %d and is off for the rest of this run: %s", name,
                        self.rank, self.off[name])
            return None


@dataclass
class LeakSample:
    step: int
    live_tensors: int
    resident_bytes: int
    cuda_allocated_bytes: int


@dataclass
class LeakGuard:
    warmup_steps: int = 5
    tensor_tolerance: int = 0  # live tensors may not grow at all after warm-up
    memory_tolerance: float = 0.05  # RSS / CUDA allocated may grow by 5% (allocator noise)
    samples: list[LeakSample] = field(default_factory=list)

    def sample(self, step: int, device: torch.device) -> None:
        if step <= self.warmup_steps:
            return
        cuda = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.samples.append(LeakSample(step, live_tensor_count(), resident_bytes(), cuda))

    def findings(self) -> list[str]:
        """What grew between the first and the last sample after warm-up (empty: nothing)."""
        if len(self.samples) < 2:
            return []
        first, last = self.samples[0], self.samples[-1]
        found = []
        if last.live_tensors - first.live_tensors > self.tensor_tolerance:
            found.append(f"live tensors grew {first.live_tensors} -> {last.live_tensors} "
                         f"between steps {first.step} and {last.step}")
        for name in ("resident_bytes", "cuda_allocated_bytes"):
            a, b = getattr(first, name), getattr(last, name)
            if a and (b - a) / a > self.memory_tolerance:
                found.append(f"{name} grew {a} -> {b} ({100 * (b - a) / a:.1f}%) between steps "
                             f"{first.step} and {last.step}")
        return found


def cpu_peak_bytes(fn: Callable[[], object], held: Iterable[torch.Tensor] = ()) -> int:
    """Peak bytes of live CPU tensors while ``fn`` runs: ``held`` plus the most ``fn`` added.

    ``held`` are the tensors alive before the call that should count (parameters, optimizer
    state, inputs; each storage once, a DTensor by its local shard). What ``fn`` allocates and
    frees comes from ``torch.profiler`` with ``profile_memory``, which records every allocation of
    the CPU allocator with its running total (``trainer.compat.cpu_allocation_events``). It
    costs a few times the call's own time: a check, not a training tool.
    """
    before = held_bytes(held)
    with quiet_native_logs(), profile(activities=[ProfilerActivity.CPU],
                                      profile_memory=True) as prof:
        fn()
    events = cpu_allocation_events(prof)
    if not events:
        return before
    # The running total also counts what earlier profiled calls allocated and left alive: start
    # from its value before this call's first event.
    _time, size, total = events[0]
    start = total - size
    return before + max(0, max(total for _t, _s, total in events) - start)


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of ``tensors``' storages, each once (a DTensor by its local shard, a quantized
    tensor by its parts): what ``cpu_peak_bytes`` counts as held before its call."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        for plain in plain_tensors(local_tensor(tensor)):
            storage = plain.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def parse_step_range(text: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B), 1-based inclusive optimizer steps."""
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a = b = -1
    if not sep or a < 1 or b < a:
        raise ValueError(f"memory.profile_steps {text!r} must be A:B with 1 <= A <= B")
    return a, b


def profiler_window(steps: str | None, first_step: int, run_dir: Path, rank: int,
                    device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.profiler`` with memory for optimizer steps A to B (``"A:B"``, 1-based), a Chrome
    trace per rank in ``run_dir/profile/``; a no-op without steps or when this run starts after
    A (``first_step``: the first step this run trains). Call ``.step()`` after every step."""
    window = parse_step_range(steps) if steps else None
    if window is None or window[0] < first_step:
        return _NoProfiler()
    first, last = window
    warmup = min(1, first - first_step)  # one warm-up step where there is room for it
    path = run_dir / PROFILE_DIR / f"rank-{rank}.trace.json"

    def write_trace(prof: torch.profiler.profile) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        if rank == 0:
            log.info("step %5d | profiler trace (memory on) written to %s", last, path)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    return profile(activities=activities, profile_memory=True, record_shapes=True,
                   schedule=torch.profiler.schedule(wait=first - first_step - warmup,
                                                    warmup=warmup, active=last - first + 1,
                                                    repeat=1),
                   on_trace_ready=write_trace)


class _NoProfiler(contextlib.AbstractContextManager):
    """What ``profiler_window`` gives when there is nothing to profile."""

    def __exit__(self, *exc_info: object) -> None:
        return None

    def step(self) -> None:
        pass


def write_memory_summary(run_dir: Path, step: int, rank: int, device: torch.device) -> Path | None:
    """``torch.cuda.memory_summary()`` into ``run_dir/memory/``; None on CPU."""
    if device.type != "cuda":
        return None
    path = run_dir / MEMORY_DIR / f"summary-step{step:08d}-rank{rank}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(torch.cuda.memory_summary(device))
    return path
