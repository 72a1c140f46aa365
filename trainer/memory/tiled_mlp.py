"""Tiled MLP (``memory.tiled_mlp: K``): the MLP of each block runs over K tiles of the sequence,
and backward recomputes each tile's forward, so the MLP's intermediate activation (4 x n_embd a
token in memtrain's GPT, ``intermediate_size`` in a Llama-family MLP) exists for one tile at a
time instead of for the whole sequence, in the forward and in backward alike.

``TiledMLPFunction`` is an autograd function in the manner of DeepSpeed's ``TiledMLP`` (Arctic
Long Sequence Training): its forward runs each tile without grad and saves only the MLP's
input; its backward runs each tile again with grad, under the forward's autocast and RNG state,
and returns the input's gradient and the trained parameters' gradients, which autograd then
accumulates as any other (DDP's and FSDP's hooks, LoRA's frozen base and the step in backward
see nothing different). The recomputation reads the module's parameters as they are when
backward runs: under FSDP, inside the block's backward, where they are gathered again.

An MLP acts on each token alone, so only the summation order of the weight gradients changes
(the tiles' sums added one after another): exact within fp32's rounding of a reordered sum.
Under bf16 autocast each tile's weight gradient is rounded to bf16 before the fp32 sum, and
where the parameters themselves are bf16 the tiles' gradients are added in bf16. The cost is
one more forward of the MLP a step (with activation checkpointing too: the checkpoint's
recomputation runs the tiles without grad, then backward with it). Under ``torch.compile`` the
backward's ``torch.autograd.grad`` breaks the block's graph; the result is the same.

Which MLPs are tiled (``tile_mlps``): the module named ``mlp`` in each block of
``model.blocks`` that has the linear layers of a known token-wise MLP (``MLP_LAYOUTS``). Its
class becomes a subclass (``Tiled<its class>``) whose forward tiles, so parameter names and
state_dict keys are unchanged and ``print(model)`` shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

# The layouts of the token-wise MLPs that tiling recognises, by the names of their linear
# layers (PEFT's LoRA layers keep those names).
MLP_LAYOUTS: dict[str, tuple[str, ...]] = {
    "memtrain's GPT": ("fc", "proj"),
    "Llama family": ("gate_proj", "up_proj", "down_proj"),
}
TOKEN_DIM = -2  # inputs are (B, T, C) or (N, C): the sequence is the second dimension from last


def tile_sizes(tokens: int, tiles: int) -> list[int]:
    """The tokens of each of ``tiles`` tiles of a sequence of ``tokens`` (tiles differ by at
    most one token where ``tiles`` does not divide it; never an empty tile, so fewer than
    ``tiles`` where the sequence is shorter)."""
    base, extra = divmod(tokens, tiles)
    return [base + 1] * extra + [base] * (tiles - extra) if base else [1] * tokens


def mlp_layout(module: nn.Module) -> str | None:
    """The ``MLP_LAYOUTS`` name ``module`` matches, or None."""
    children = {name for name, _ in module.named_children()}
    return next((layout for layout, names in MLP_LAYOUTS.items()
                 if children.issuperset(names)), None)


def block_mlps(model: nn.Module) -> list[nn.Module | None]:
    """Per block of ``model.blocks``: its module named ``mlp`` (inside a checkpoint wrapper
    too) where that has a known layout, else None."""
    found: list[nn.Module | None] = []
    for block in getattr(model, "blocks", None) or ():
        mlps = [module for name, module in block.named_modules()
                if name.rsplit(".", 1)[-1] == "mlp"]
        found.append(mlps[0] if len(mlps) == 1 and mlp_layout(mlps[0]) else None)
    return found


def tile_mlps(model: nn.Module, tiles: int) -> int:
    """Make the MLP of each block of ``model.blocks`` run over ``tiles`` sequence tiles (1: off,
    nothing changes). Returns how many MLPs were tiled.

    Raises:
        ValueError: ``tiles`` below 1, or a model without blocks or with a block whose MLP is
            not one of ``MLP_LAYOUTS``, naming the model.
    """
    if tiles < 1:
        raise ValueError(f"memory.tiled_mlp must be at least 1 (1: off), got {tiles}")
    if tiles == 1:
        return 0
    mlps = block_mlps(model)
    if not mlps or any(mlp is None for mlp in mlps):
        named = type(getattr(model, "hf", model)).__name__
        known = "; ".join(f"{layout}: {', '.join(names)}"
                          for layout, names in MLP_LAYOUTS.items())
        raise ValueError(f"memory.tiled_mlp {tiles}: {named} has no MLP it can tile in each of "
                         f"its blocks (a module named mlp in each of model.blocks, with the "
                         f"linear layers {known}); set memory.tiled_mlp 1")
    for mlp in mlps:
        assert mlp is not None
        mlp.__class__ = _tiled_class(type(mlp))
        mlp.mlp_tiles = tiles  # type: ignore[assignment]
    return len(mlps)


class TiledMLPMixin(nn.Module):
    """The mixin of a tiled MLP's class: ``forward`` runs the MLP's own over ``mlp_tiles``
    tiles through ``TiledMLPFunction``."""

    mlp_tiles: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = tile_sizes(x.shape[TOKEN_DIM], self.mlp_tiles)
        if len(sizes) < 2:  # one tile (or none): nothing to tile
            return super().forward(x)
        params = [p for p in self.parameters() if p.requires_grad]
        random = self.training and any(isinstance(m, nn.Dropout) and m.p > 0
                                       for m in self.modules())
        out: torch.Tensor = TiledMLPFunction.apply(super().forward, sizes, random, x, *params)
        return out


def untiled_forward(mlp: TiledMLPMixin, x: torch.Tensor) -> torch.Tensor:
    """The MLP's own forward, on ``x`` whole (one tile's, for the planner's probe)."""
    out: torch.Tensor = super(TiledMLPMixin, mlp).forward(x)
    return out


_TILED_CLASSES: dict[type, type] = {}


def _tiled_class(cls: type) -> type:
    """``Tiled<cls>``: ``TiledMLPMixin`` before ``cls``, one class per MLP class."""
    if issubclass(cls, TiledMLPMixin):
        return cls
    if cls not in _TILED_CLASSES:
        _TILED_CLASSES[cls] = type(f"Tiled{cls.__name__}", (TiledMLPMixin, cls),
                                   {"__module__": __name__})
    return _TILED_CLASSES[cls]


class TiledMLPFunction(torch.autograd.Function):
    """``forward_fn`` over the tiles ``sizes`` of ``x``'s sequence, each recomputed in backward
    (the module docstring). ``params``: the trained parameters ``forward_fn`` reads, whose
    gradients it returns; ``random``: the MLP draws random numbers (dropout), so the forward's
    RNG state is replayed in backward."""

    @staticmethod
    def forward(ctx: Any, forward_fn: Callable[[torch.Tensor], torch.Tensor],
                sizes: Sequence[int], random: bool, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.forward_fn, ctx.sizes, ctx.params = forward_fn, sizes, params
        device_type = x.device.type
        ctx.autocast = (device_type, torch.get_autocast_dtype(device_type),
                        torch.is_autocast_enabled(device_type))
        ctx.rng = _rng_state(x.device) if random else None
        ctx.save_for_backward(x)
        out = None
        for start, size, tile in _tiles(x, sizes):
            y = forward_fn(tile)  # grad is off in an autograd function's forward
            if out is None:
                shape = list(y.shape)
                shape[TOKEN_DIM] = x.shape[TOKEN_DIM]
                out = y.new_empty(shape)
            out.narrow(TOKEN_DIM, start, size).copy_(y)
            del y  # the tile's output, before the next tile's intermediate
        assert out is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        wants_x = ctx.needs_input_grad[3]
        trained = [p for p, wanted in zip(ctx.params, ctx.needs_input_grad[4:], strict=True)
                   if wanted]
        grad_x = torch.empty_like(x) if wants_x else None
        sums: list[torch.Tensor] | None = None
        device_type, dtype, enabled = ctx.autocast
        with _replayed_rng(x.device, ctx.rng) if ctx.rng is not None else nullcontext():
            for start, size, tile in _tiles(x, ctx.sizes):
                tile = tile.detach().requires_grad_(wants_x)
                with torch.enable_grad(), torch.autocast(device_type, dtype, enabled):
                    y = ctx.forward_fn(tile)
                inputs = [tile, *trained] if wants_x else trained
                grads = torch.autograd.grad(y, inputs, grad_out.narrow(TOKEN_DIM, start, size))
                del y
                if grad_x is not None:
                    grad_x.narrow(TOKEN_DIM, start, size).copy_(grads[0])
                    grads = grads[1:]
                if sums is None:
                    sums = list(grads)
                else:
                    for total, grad in zip(sums, grads, strict=True):
                        total.add_(grad)  # the one change from the untiled sum: its order
        by_param = iter(sums or ())
        param_grads = [next(by_param) if wanted else None for wanted in ctx.needs_input_grad[4:]]
        return (None, None, None, grad_x, *param_grads)


def _tiles(x: torch.Tensor, sizes: Sequence[int]) -> list[tuple[int, int, torch.Tensor]]:
    """(start, size, view) of each tile of ``x`` along the sequence."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(start, size, x.narrow(TOKEN_DIM, start, size))
            for start, size in zip(starts, sizes, strict=True)]


@contextmanager
def _replayed_rng(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]
                  ) -> Iterator[None]:
    """The generators of the CPU and ``device`` at ``state`` inside, as they were after."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index or 0] if cuda else [],
                               device_type="cuda" if cuda else "cpu"):
        cpu_state, cuda_state = state
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        yield


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and ``device``'s (CUDA), as dropout draws from them."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda
