"""AdamW's memory switches: the dtype of its state and the step in backward.

``memory.optimizer_states`` (``make_adamw``):
- ``fp32``: torch's AdamW, two fp32 moments, 8 bytes per parameter;
- ``bf16``: the moments in bf16 (4 bytes), the update computed in fp32 (torchao's AdamW step);
- ``8bit`` / ``4bit``: torchao's ``AdamW8bit`` / ``AdamW4bit``, the moments block-quantized
  (one byte, or half, per value and an fp32 scale per block of 256, or 128).
Tensors under 4,096 elements (norms, biases) or whose size a block does not divide keep
moments in their parameter's dtype (fp32, or bf16 under ``model.dtype: bf16``), as bitsandbytes
and torchao do. Over bf16 weights (``stochastic_round``) torchao rounds each updated weight
from fp32 to bf16 stochastically. ``state_bytes`` counts exactly that, per tensor, for the
planner. The learning rate, its schedule, weight decay and clipping are those of fp32 AdamW:
only how the moments are stored changes. torchao's step is compiled (``torch.compile``, once per
parameter shape): the first step of a run pays that.

``memory.optimizer_in_backward`` (``BackwardSteps``): each parameter steps as soon as its
gradient is complete and drops it, so the gradients never all live at once (torchtune's
``optimizer_in_bwd``). The optimizer stays one ``torch.optim.Optimizer`` (the schedule,
checkpoints and DCP see a plain AdamW); one single-parameter optimizer per parameter, sharing its
state and hyperparameters, does the steps. Where the gradient is complete:
- one process, and FSDP2, after its reduce-scatter: the parameter's post-accumulate-grad hook
  (FSDP2 runs the sharded parameter's hooks itself);
- DDP: after the all-reduce of the gradient's bucket, in a communication hook that then steps
  the bucket's parameters (``trainer.parallel.ddp.step_in_comm_hook``; DDP's own hook for this
  needs a CUDA stream).
The global gradient norm is summed from each gradient before its step (for the log); clipping by
it is impossible (the norm exists only once every parameter has stepped), so a non-zero
``train.grad_clip`` is refused, as are gradient accumulation, fp16's GradScaler and OOM retries.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.compat import compile_cache_of_states
from trainer.tensors import local_tensor, plain_tensors

STATE_DTYPES = ("fp32", "bf16", "8bit", "4bit")
# Elements per quantization block (torchao's defaults); bf16 has no blocks.
_BLOCK = {"8bit": 256, "4bit": 128, "bf16": 1}
_CODE_BYTES = {"8bit": 1.0, "4bit": 0.5, "bf16": 2.0}
_QMAP_VALUES = {"8bit": 256, "4bit": 16, "bf16": 0}  # each quantized moment's code book (fp32)
SMALLEST_QUANTIZED = 4096  # elements: smaller tensors keep fp32 moments


class MissingExtraError(RuntimeError):
    """A switch needs an optional dependency that is not installed."""


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """torchao's import logs each CUDA kernel library it cannot load on a CPU build, and torch
    a deprecation per enum it registers: noise on every run (PEFT imports torchao too)."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def torchao_optim() -> Any:
    """torchao's optimizers, or one line naming the extra that brings them."""
    try:
        with quiet_torchao_import():
            import torchao.optim as ao_optim
    except ImportError as err:
        raise MissingExtraError(
            "memory.optimizer_states other than fp32 needs torchao: pip install "
            "'memtrain[strategies]'") from err
    return ao_optim


def tensor_state_bytes(numel: int, states: str, itemsize: int = 4) -> int:
    """AdamW's state bytes for one tensor of ``numel`` elements whose parameter has
    ``itemsize`` bytes an element: its two moments (the step counter, 4 bytes a tensor, is left
    out)."""
    if states == "fp32":
        return 8 * numel
    block = _BLOCK[states]
    if numel < SMALLEST_QUANTIZED or numel % block:
        return 2 * itemsize * numel
    scales = 0 if states == "bf16" else 4 * (numel // block)
    return 2 * (math.ceil(_CODE_BYTES[states] * numel) + scales + 4 * _QMAP_VALUES[states])


def state_bytes(tensors: Sequence[torch.Tensor], states: str, shards: int = 1) -> int:
    """AdamW's state bytes for ``tensors`` (trainable ones), each split into ``shards`` by rows
    as FSDP splits them (the local shard decides whether it is quantized); 1: whole."""
    total = 0
    for tensor in tensors:
        numel = tensor.numel()
        if shards > 1:
            rows = tensor.shape[0] if tensor.dim() else 1
            numel = -(-rows // shards) * (numel // max(rows, 1))
        total += tensor_state_bytes(numel, states, tensor.element_size())
    return total


def _bf16_states_class(ao_optim: Any) -> type[torch.optim.Optimizer]:
    base = ao_optim.adam._AdamBase

    class AdamWBf16States(base):  # type: ignore[misc, valid-type]
        """AdamW with bf16 moments: torchao's step (fp32 arithmetic, moments copied back)."""

        def __init__(self, params: Any, lr: float = 1e-3,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                     weight_decay: float = 0.0, bf16_stochastic_round: bool = False) -> None:
            super().__init__(params, lr, betas, eps, weight_decay, False, block_size=1,
                             bf16_stochastic_round=bf16_stochastic_round, is_adamw=True)
            # torch's load_state_dict casts floating state to the parameter's dtype: the
            # moments go back to bf16 (exactly: they were bf16 values).
            self.register_load_state_dict_post_hook(_moments_to_bf16)

        @staticmethod
        def _subclass_zeros(p: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
            return torch.zeros_like(p, dtype=torch.bfloat16)

    return AdamWBf16States


def _moments_to_bf16(optimizer: torch.optim.Optimizer) -> None:
    for per_param in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            value = per_param.get(key)
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32 \
                    and value.numel() >= SMALLEST_QUANTIZED:
                per_param[key] = value.to(torch.bfloat16)


def adamw_class(states: str) -> Any:
    """The AdamW class keeping its moments in ``states``."""
    if states == "fp32":
        return torch.optim.AdamW
    if states not in STATE_DTYPES:
        raise ValueError(f"memory.optimizer_states {states!r} is not one of {STATE_DTYPES}")
    ao_optim = torchao_optim()
    if states == "bf16":
        return _bf16_states_class(ao_optim)
    return _quantized_class(ao_optim, states)


def _quantized_class(ao_optim: Any, states: str) -> type[torch.optim.Optimizer]:
    """torchao's ``AdamW8bit`` or ``AdamW4bit``, its quantized moments always looking fp32.

    torchao gives a moment its parameter's dtype as an appearance (the codes are the same);
    its ``view`` (which ``DTensor.from_local`` takes) forgets it, and a bf16-looking moment's
    fp32-looking view cannot be traced by ``torch.compile``: bf16 weights under FSDP2 would
    fail at their first step. fp32 is what the step computes the moments in anyway."""
    base = ao_optim.AdamW8bit if states == "8bit" else ao_optim.AdamW4bit
    state = ao_optim.subclass_8bit.OptimState8bit if states == "8bit" else \
        ao_optim.subclass_4bit.OptimState4bit

    def zeros(p: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
        return state.zeros(p.shape, signed, block_size, p.device, dtype=torch.float32)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        # torch's load_state_dict gives floating state its parameter's dtype: fp32 again
        self.register_load_state_dict_post_hook(_quantized_moments_look_fp32)
        compile_cache_of_states(states)  # one inductor cache mixed up 8-bit and 4-bit graphs

    return type(base.__name__, (base,), {"__init__": __init__, "__doc__": base.__doc__,
                                         "_subclass_zeros": staticmethod(zeros)})


def _quantized_moments_look_fp32(optimizer: torch.optim.Optimizer) -> None:
    for per_param in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            value = per_param.get(key)
            if isinstance(value, torch.Tensor) and value.dtype != torch.float32 and \
                    hasattr(local_tensor(value), "codes"):
                per_param[key] = value.to(torch.float32)  # the appearance only: no copy


def make_adamw(groups: list[dict[str, Any]], lr: float, betas: tuple[float, float],
               states: str = "fp32", fused: bool = False,
               stochastic_round: bool = False) -> torch.optim.Optimizer:
    """AdamW over ``groups`` with its moments in ``states`` (``fused``: torch's fused kernel,
    fp32 states only; ``stochastic_round``: bf16 weights get their updates rounded
    stochastically, torchao's states only)."""
    if states == "fp32":
        if stochastic_round:
            raise ValueError("bf16 weights need memory.optimizer_states bf16, 8bit or 4bit")
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True if fused else None)
    return adamw_class(states)(groups, lr=lr, betas=betas,
                               bf16_stochastic_round=stochastic_round)


def held_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the moments in ``optimizer``'s state, quantized ones by their parts (codes,
    scales, code book); the step counters left out, as ``state_bytes`` does."""
    return sum(part.numel() * part.element_size()
               for part in state_tensors(optimizer, with_steps=False))


def state_tensors(optimizer: torch.optim.Optimizer, with_steps: bool = True
                  ) -> list[torch.Tensor]:
    """Every tensor of ``optimizer``'s state (a DTensor by its shard), a quantized one by its
    parts (``__tensor_flatten__``: torchao's codes, scales and code book)."""
    return [part for per_param in optimizer.state.values()
            for key, value in per_param.items()
            if isinstance(value, torch.Tensor) and (with_steps or key != "step")
            for part in plain_tensors(local_tensor(value))]


_BACKWARD_STEPS: weakref.WeakKeyDictionary[torch.optim.Optimizer, BackwardSteps] = \
    weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class InBackward:
    """Where ``memory.optimizer_in_backward``'s steps attach, as the way of splitting the work
    says (``trainer.parallel``): each parameter's post-accumulate-grad hook by default, or DDP's
    communication hook (``comm_hook``); ``norm_over_ranks``: each rank steps its own shards
    (FSDP2), so the gradient norm's squares are summed over the ranks."""

    comm_hook: bool = False
    norm_over_ranks: bool = False


class BackwardSteps:
    """Steps each parameter of ``optimizer`` in backward (the module docstring says where).

    ``comm_hook``: the model will be wrapped in DDP, whose communication hook then steps each
    bucket's parameters (``trainer.parallel.ddp.step_in_comm_hook``). ``norm_over_ranks``: each
    rank steps its own shards (FSDP2), so the norm's squares are summed over ranks at the end.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm_hook: bool = False,
                 norm_over_ranks: bool = False):
        self.optimizer, self.norm_over_ranks = optimizer, norm_over_ranks
        # (a parameter's optimizer, the index of its group in ``optimizer.param_groups``: a
        # checkpoint's load replaces the group dicts themselves)
        self.singles: list[tuple[torch.optim.Optimizer, int]] = []
        self.squares: list[torch.Tensor] = []
        self.steppers: dict[int, _Stepper] = {}  # by id(parameter), for DDP's hook
        make: Any = type(optimizer)
        # torchao's optimizers keep stochastic rounding (bf16 weights) outside the groups
        rounding = {"bf16_stochastic_round": True} \
            if getattr(optimizer, "bf16_stochastic_round", False) else {}
        for index, group in enumerate(optimizer.param_groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            for param in group["params"]:
                single = make([{"params": [param], **hyper}], **rounding)
                self.singles.append((single, index))
                stepper = _Stepper(self, single)
                self.steppers[id(param)] = stepper
                if not comm_hook:  # DDP's communication hook steps (``step_in_comm_hook``)
                    param.register_post_accumulate_grad_hook(stepper.step_param)
        _BACKWARD_STEPS[optimizer] = self
        self.begin()

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> BackwardSteps | None:
        """The ``BackwardSteps`` stepping ``optimizer``, or None: it steps after backward."""
        return _BACKWARD_STEPS.get(optimizer)

    def begin(self) -> None:
        """Before a step's backward: every single-parameter optimizer takes the schedule's
        current hyperparameters and the optimizer's state (a checkpoint's load replaces it)."""
        self.squares.clear()
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # the schedule's check
        for single, index in self.singles:
            group = self.optimizer.param_groups[index]
            single.state = self.optimizer.state
            single.param_groups[0].update(
                {k: v for k, v in group.items() if k != "params" and k != "lr"})
            lr, own = group["lr"], single.param_groups[0]["lr"]
            if isinstance(own, torch.Tensor):  # torchao keeps it a tensor: copied, no sync
                own.copy_(lr if isinstance(lr, torch.Tensor) else torch.tensor(lr))
            else:
                single.param_groups[0]["lr"] = lr

    def step_one(self, single: torch.optim.Optimizer, param: torch.Tensor) -> None:
        grad = param.grad
        assert grad is not None
        self.squares.append(local_tensor(grad.detach()).float().square().sum())
        single.step()

    def grad_norm(self) -> torch.Tensor:
        """The global norm of the step's gradients (summed before each step); under FSDP over
        every rank's shards."""
        total = torch.stack(self.squares).sum() if self.squares else torch.zeros(())
        if self.norm_over_ranks and dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        return total.sqrt()


class _Stepper:
    """One parameter's step, as DDP's hook (``step()``) or a post-accumulate hook calls it."""

    def __init__(self, steps: BackwardSteps, single: torch.optim.Optimizer):
        self.steps, self.single = steps, single
        self.param = single.param_groups[0]["params"][0]

    def step(self) -> None:  # DDP's hook: ``param.grad`` is the all-reduced gradient
        self.steps.step_one(self.single, self.param)
        self.param.grad = None

    def step_param(self, param: torch.Tensor) -> None:
        self.steps.step_one(self.single, param)
        param.grad = None


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer steps (tied ones once)."""
    return [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
