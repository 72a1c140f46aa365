"""This machine's CPU, measured: each kind of work's rate in fp32 and bf16, an operator's fixed
cost and what a checkpointed block's wrapper adds (``calibrate_cpu``); then the fixed costs
(autocast's too) and each dtype's rates fitted to a small GPT's real steps at several sizes
(``_in_model``). Cached per machine, torch version and thread count (``cpu_speed``), with when
it was taken and how far its repeats spread: an unstable calibration is measured again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from monitoring.host import cache_dir, cpu_info
from trainer.memory.allocator import keep_freed_host_memory
from trainer.memory.loss import (
    summed_loss,
)
from trainer.memory.precision import precision_policy
from trainer.plan.devices import (
    ALLREDUCE_BYTES_PER_S,
    BYTE_KINDS,
    CALIBRATION_SPREAD_BOUND,
    FLOP_KINDS,
    DeviceSpeed,
)
from trainer.plan.work import MATMUL_K, Work, recording

log = logging.getLogger("memtrain.planner")

CALIBRATION_VERSION = 18
# Elements of the tensors the byte-counted kinds are calibrated on: 32 MiB in fp32, beyond a
# core's cache, as a step's activations are.
BYTE_ELEMENTS = 1 << 23
# The matrix products' rows (``_matmul_rows``): 2,048 where a call on them takes under a
# quarter of a second, else enough for that.
MATMUL_ROWS, MATMUL_MIN_ROWS, MATMUL_SECONDS = 2048, 64, 0.25


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """``fn``'s fastest time over ``repeats`` calls, after a warm-up."""
    return _interleaved_best({0: fn}, repeats)[0]


def _op_overhead_seconds() -> float:
    """The fixed cost of one operator in a real training forward and backward: a small
    network's step timed, over the operators it runs (dispatch, autograd, module calls)."""
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU())
                          for _ in range(16)))
    x_BC = torch.randn(2, 8)

    def step() -> None:
        net(x_BC).sum().backward()

    with recording() as work:
        step()
    return _best_seconds(step, 20) / sum(work.ops.values())


def _checkpoint_seconds(op_seconds: float) -> float:
    """The fixed cost of one checkpointed block in a forward and backward beyond its
    operators' (the wrapper's Python: saved-tensor hooks, RNG state, the recomputation's
    bookkeeping), from 16 narrow blocks timed with and without it."""
    from trainer.memory.activation_checkpointing import apply_activation_checkpointing

    def timed(wrap: bool) -> tuple[float, float]:
        torch.manual_seed(0)
        net = nn.Module()
        blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(16))
        net.blocks = blocks
        if wrap:
            apply_activation_checkpointing(net, "full")
        x_BC = torch.randn(2, 8, requires_grad=True)

        def step() -> None:
            y_BC = x_BC
            for block in blocks:
                y_BC = block(y_BC)
            y_BC.sum().backward()

        with recording() as work:
            step()
        return _best_seconds(step, 20), sum(work.ops.values())

    (plain, plain_ops), (wrapped, wrapped_ops) = timed(False), timed(True)
    return max(0.0, (wrapped - plain - (wrapped_ops - plain_ops) * op_seconds) / 16)


def _matmul_seconds(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    a_MK, b_KN = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return _best_seconds(lambda: a_MK @ b_KN, repeats)


def _matmul_rows(k: int, dtype: torch.dtype) -> int:
    """Rows of the product timed at contraction ``k``: ``MATMUL_ROWS``, or fewer where the
    kernel is slow enough that a call on fewer still takes ``MATMUL_SECONDS`` (at least
    ``MATMUL_MIN_ROWS``). bf16 emulated in software runs at about 1 GFLOP/s: 2,048 rows at
    k=1,024 took 5.9 s a call on an AVX2 EPYC, where 64 to 2,048 rows gave rates within 15% of
    each other. Fast kernels (fp32, native bf16) keep every row."""
    per_row = _matmul_seconds(MATMUL_MIN_ROWS, k, 1024, dtype, 1) / MATMUL_MIN_ROWS
    rows = int(MATMUL_SECONDS / per_row) // MATMUL_MIN_ROWS * MATMUL_MIN_ROWS
    return min(MATMUL_ROWS, max(MATMUL_MIN_ROWS, rows))


def _attention_seconds(dtype: torch.dtype) -> tuple[float, float]:
    """(FLOPs, seconds) of a causal attention's forward and backward (8 heads of 64, 512
    positions), with the FLOPs the recorder counts for it."""
    from torch.nn.functional import scaled_dot_product_attention
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shape = (1, 8, 512, 64)
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))

    def run() -> None:
        scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape,
                                                                            shape, shape)
    return flops, _best_seconds(run, 3)


def _bytes_per_second(fn: Callable[[torch.Tensor, torch.Tensor], object], dtype: torch.dtype,
                      out_dtype: torch.dtype, bytes_per_element: int) -> float:
    """Bytes read and written per second by ``fn(x, out)`` on ``BYTE_ELEMENTS`` elements
    (``bytes_per_element`` of its input and output together), less its time on 64. The output
    is allocated once: what a fresh large output costs in page faults is left out (the module's
    docstring)."""
    def seconds(elements: int, repeats: int) -> float:
        x, out = torch.randn(elements, dtype=dtype), torch.empty(elements, dtype=out_dtype)
        return _best_seconds(lambda: fn(x, out), repeats)

    spent = max(seconds(BYTE_ELEMENTS, 3) - seconds(64, 20), 1e-9)
    return BYTE_ELEMENTS * bytes_per_element / spent


def calibrate_cpu() -> DeviceSpeed:
    """Measure this CPU at torch's thread count, in fp32 and bf16: matrix products at three
    contraction dimensions, attention, elementwise products, GELU and dtype conversions, and an
    operator's fixed cost. From seconds to about half a minute on one thread (docs/memory.md
    gives the figures)."""
    keep_freed_host_memory()  # as the trainer's CPU workers run
    rates: dict[str, float] = {}
    matmul_fixed = float("inf")
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        size = torch.finfo(dtype).bits // 8
        other = torch.bfloat16 if dtype == torch.float32 else torch.float32
        fixed = _matmul_seconds(32, 32, 32, dtype, 20)
        matmul_fixed = min(matmul_fixed, fixed)
        for k in MATMUL_K:
            m, n = _matmul_rows(k, dtype), 1024
            seconds = max(_matmul_seconds(m, k, n, dtype, 3) - fixed, 1e-9)
            rates[f"matmul:{name}:k{k}"] = 2 * m * k * n / seconds
        flops, seconds = _attention_seconds(dtype)
        rates[f"attention:{name}"] = flops / seconds
        other_size = torch.finfo(other).bits // 8
        rates[f"memory:{name}"] = _bytes_per_second(
            lambda x, out: torch.mul(x, x, out=out), dtype, dtype, 3 * size)
        rates[f"math:{name}"] = _bytes_per_second(
            lambda x, out: torch.ops.aten.gelu.out(x, out=out), dtype, dtype, 2 * size)
        rates[f"convert:{name}"] = _bytes_per_second(
            lambda x, out: out.copy_(x), dtype, other, size + other_size)
    overhead = _op_overhead_seconds()
    op_seconds = {kind: overhead for kind in BYTE_KINDS}
    op_seconds.update({kind: overhead + matmul_fixed for kind in FLOP_KINDS}, view=overhead / 2,
                      checkpoint=_checkpoint_seconds(overhead))
    threads = torch.get_num_threads()
    speed = DeviceSpeed(cpu_name(), rates, op_seconds, ALLREDUCE_BYTES_PER_S["cpu"],
                        source=f"measured on this CPU, {threads} thread{'s' * (threads > 1)}",
                        calibrated_at=time.time())
    speed = _in_model(speed)
    speed.rates.update({key.replace("bf16", "fp16"): rate for key, rate in
                        list(speed.rates.items()) if ":bf16" in key})  # CPU fp16 is rare
    return speed


# The small GPT's steps the calibration times, (samples, positions): the fixed costs dominate
# the first (a step of 8 tokens is mostly dispatch), the compute the last. Without the first,
# the fixed costs were 5% of the smallest fp32 step, and their fitted scale ranged 1.0-3.4
# between idle calibrations on a 2-core EPYC.
IN_MODEL_STEPS = ((1, 8), (1, 256), (4, 256), (16, 256))
IN_MODEL_ROUNDS = 5


def _interleaved_times(steps: dict[Any, Callable[[], object]],
                       rounds: int) -> dict[Any, list[float]]:
    """Each step's times over ``rounds`` passes that take every step in turn: a machine whose
    speed drifts (a shared VM's, by 15-30% within minutes) slows all of them alike, rather than
    the ones timed during a slow spell."""
    for fn in steps.values():
        fn()  # warm-up: first-call allocation and kernel selection
    times: dict[Any, list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, fn in steps.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return times


def _interleaved_best(steps: dict[Any, Callable[[], object]], rounds: int) -> dict[Any, float]:
    """Each step's fastest time over ``rounds`` interleaved passes (``_interleaved_times``)."""
    return {key: min(times) for key, times in _interleaved_times(steps, rounds).items()}


def repeat_spread(times: dict[Any, list[float]]) -> float:
    """How far repeated timings disagree: the steps' medians added up, over their fastest
    times added up, less 1 (0.08: a pass at the median took 8% longer than the fastest). Summed,
    the longer steps weigh most: a step of a few milliseconds is mostly dispatch, and its
    repeats spread 5-15% on an idle machine."""
    best = sum(min(t) for t in times.values() if t)
    return sum(statistics.median(t) for t in times.values() if t) / best - 1 if best else 0.0


def _fit_scales(rows: list[tuple[float, float, float, float]],
                b_bounds: tuple[float, float] = (1.0, 4.0),
                a_bounds: tuple[float, float] = (0.5, 8.0)) -> tuple[float, float]:
    """(a, b) minimising the relative error of ``a x fixed + b x own + other`` against
    ``measured`` over ``rows`` (least squares, each row divided by its measured time), within
    bounds: where one scale is held at a bound, the other is fitted again with it held there
    (the unconstrained pair, clipped apart, over-predicts every step). The bounds keep a noisy
    measurement in check: rates never faster in a model than alone, nor over 4x slower; fixed
    costs 0.5-8x the isolated figure."""
    sff = sfc = scc = sfy = scy = 0.0
    for fixed, own, other, measured in rows:
        f, c, y = fixed / measured, own / measured, (measured - other) / measured
        sff, sfc, scc = sff + f * f, sfc + f * c, scc + c * c
        sfy, scy = sfy + f * y, scy + c * y
    det = sff * scc - sfc * sfc
    if det <= 0:  # (det > 0 implies sff > 0 and scc > 0, the divisors below)
        return 1.0, 1.0

    def clip(value: float, bounds: tuple[float, float]) -> float:
        return min(max(value, bounds[0]), bounds[1])

    a, b = (sfy * scc - scy * sfc) / det, (sff * scy - sfc * sfy) / det
    if not a_bounds[0] <= a <= a_bounds[1]:
        a = clip(a, a_bounds)
        b = (scy - a * sfc) / scc
    if not b_bounds[0] <= b <= b_bounds[1]:
        b = clip(b, b_bounds)
        a = clip((sfy - b * sfc) / sff, a_bounds)
    return a, b


def _in_model(speed: DeviceSpeed) -> DeviceSpeed:
    """The rates and fixed costs as a model reaches them: operators back to back on operands
    that come from memory, not from the cache of a repeated call (bf16's fast kernels lose the
    most), and autocast's dispatch on every operator.

    A small GPT's real forward and backward (2 blocks of width 128) is timed at each of
    ``IN_MODEL_STEPS`` in fp32 and in bf16, all interleaved (``_interleaved_best``), against
    what the isolated figures predict for the operators it ran. Its fixed costs are the same at
    every size and its compute grows with it, so two scales are fitted to each dtype's steps
    (``_fit_scales``): the operators' fixed cost and the dtype's rates. fp32 first:
    a bf16 step runs fp32 operators too, and its fixed-cost scale is autocast's
    (``op_seconds["autocast"]``, a factor)."""
    from trainer.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(seq_len=256, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.train()
    steps: dict[Any, Callable[[], object]] = {}
    works: dict[tuple[str, int, int], Work] = {}
    for name in ("fp32", "bf16"):
        policy = precision_policy(name, torch.device("cpu"), warn=False)
        for batch, positions in IN_MODEL_STEPS:
            tokens_BT = torch.randint(0, cfg.vocab_size, (batch, positions + 1))

            def step(policy: Any = policy, tokens_BT: torch.Tensor = tokens_BT) -> None:
                summed_loss(model, tokens_BT, policy).backward()
                model.zero_grad(set_to_none=True)

            with recording() as work:
                step()
            steps[name, batch, positions], works[name, batch, positions] = step, work
    times = _interleaved_times(steps, rounds=IN_MODEL_ROUNDS)
    measured = {key: min(t) for key, t in times.items()}
    current = dataclasses.replace(speed, spread=repeat_spread(times))
    for name in ("fp32", "bf16"):
        rows = []  # (fixed, own compute, other compute, measured) seconds at each size
        for shape in IN_MODEL_STEPS:
            work = works[(name, *shape)]
            fixed = current.seconds(work.scaled(0.0))
            own = current.seconds(work.only(name)) - current.seconds(work.only(name).scaled(0.0))
            rows.append((fixed, own, current.seconds(work) - fixed - own,
                         measured[(name, *shape)]))
        fixed_scale, rate_scale = _fit_scales(rows)
        rates = {k: v / rate_scale if k.split(":")[1] == name else v
                 for k, v in current.rates.items()}
        log.debug("planner: %s in a model: fixed costs x %.2f, rates / %.2f", name, fixed_scale,
                  rate_scale)
        if name == "fp32":  # every operator's fixed cost (the checkpoint wrapper's is its own)
            op_seconds = {k: v if k == "checkpoint" else v * fixed_scale
                          for k, v in current.op_seconds.items()}
        else:
            op_seconds = {**current.op_seconds, "autocast": max(1.0, fixed_scale)}
        current = dataclasses.replace(current, rates=rates, op_seconds=op_seconds)
    return current


def cpu_name() -> str:
    return cpu_info().name


# The calibrations this process took, by cache file: an unstable one is measured again once
# per process, not at every call.
_TAKEN: dict[Path, DeviceSpeed] = {}


def cpu_speed(refresh: bool = False) -> DeviceSpeed:
    """This CPU's calibration, measured once per machine, torch version and thread count, and
    kept in ``cache_dir()``. A stable one is kept until ``refresh``; an unstable one
    (``CALIBRATION_SPREAD_BOUND``) is measured again by the next process that reads it, and the
    steadier of the two is kept."""
    from trainer.compat import cpu_bf16_support, cpu_capability

    key = json.dumps([CALIBRATION_VERSION, cpu_name(), cpu_capability(), cpu_bf16_support(),
                      torch.__version__, torch.get_num_threads()])
    path = cache_dir() / f"cpu-speed-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    cached = None
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        cached = DeviceSpeed(**json.loads(path.read_text()))
    if not refresh and cached is not None and (cached.stable or path in _TAKEN):
        return cached
    start = time.perf_counter()
    speed = calibrate_cpu()
    _TAKEN[path] = speed
    log.info("planner: calibrated this CPU in %.1f s, repeats within %.0f%% (%s)",
             time.perf_counter() - start, 100 * speed.spread, path)
    if not speed.stable:
        log.warning("planner: this CPU's calibration is unstable (its repeats spread %.0f%%, "
                    "over %.0f%%: the machine is busy); it is used now and measured again at "
                    "the next plan", 100 * speed.spread, 100 * CALIBRATION_SPREAD_BOUND)
    if cached is not None and not refresh and cached.spread < speed.spread:
        return cached  # the steadier of the two
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(speed.as_dict(), indent=1))
        tmp.replace(path)
    return speed
