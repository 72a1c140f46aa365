"""Build a model on the meta device and give each rank only its shards of the weights a seeded
host build would have made, bit for bit.

A seeded host build (``torch.manual_seed(seed); factory()``) holds the whole model at once. Built
under ``torch.device("meta")`` the same factory allocates nothing, and ``MetaRecording`` writes
down every tensor operation it ran (a ``TorchDispatchMode``): construction, the module's own
initialisation (``reset_parameters``, an ``apply(init)`` pass, Hugging Face's ``post_init``),
buffers computed from ``arange``. ``replay`` runs that record again on the host with the same
seed, so every random draw is the one the host build made; it runs only the operations whose
results reach a final parameter or buffer (a parameter's first ``kaiming_uniform_``, overwritten
by a later ``normal_``, runs on a scratch tensor of its size only so that the random stream
advances as it did), and hands each parameter to ``take`` as soon as its last operation has run,
then frees it. At no time does a rank hold more than the few whole tensors under construction
(the largest one parameter's worth, for the models here): ``take`` keeps this rank's shard.

Tensors are matched by their storage and geometry, not by Python identity, so views, ``.data``
and ``nn.Parameter`` wrappers of one storage are the same tensor to the replay. A factory that
needs real values while it builds (``.item()``, a branch on data) cannot run on meta: it raises
there, and the caller builds on the host instead (``trainer.parallel.fsdp.build_sharded``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from trainer.tensors import storage_key

# In-place operations that overwrite every element of their tensor without reading it.
_OVERWRITES = {"normal_", "uniform_", "fill_", "zero_", "random_", "exponential_", "geometric_",
               "log_normal_", "cauchy_", "bernoulli_", "copy_"}
# Operations that draw from the random stream: the replay must run each one, in order.
_RANDOM = {"normal_", "uniform_", "random_", "exponential_", "geometric_", "log_normal_",
           "cauchy_", "bernoulli_", "normal", "bernoulli", "rand", "randn", "randint", "randperm",
           "rand_like", "randn_like", "randint_like", "multinomial", "poisson", "uniform",
           "native_dropout", "_fused_dropout"}


_HOST = torch.device("cpu")


@dataclass
class _Op:
    func: Any  # an OpOverload
    args: tuple
    kwargs: dict
    out: Any
    reads: set[int] = field(default_factory=set)
    writes: set[int] = field(default_factory=set)
    full_writes: set[int] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.func._schema.name.split("::")[-1]

    @property
    def random(self) -> bool:
        return self.name in _RANDOM


def _meta_tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_meta]


def _covers_storage(tensor: torch.Tensor) -> bool:
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes())


class MetaRecording(TorchDispatchMode):
    """Records the operations a factory runs under ``torch.device("meta")``; the meta tensors
    they touched are kept alive with the record, so no storage address is reused."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _meta_tensors((args, kwargs))
        outputs = _meta_tensors(out)
        in_keys = {storage_key(t) for t in inputs}
        if all(storage_key(t) in in_keys for t in outputs) and not _mutated(func):
            return out  # a view or a query: replayed through storages, never run again
        pinned_args, pinned_kwargs, pinned_out = tree_map(_pinned, (args, kwargs, out))
        self.ops.append(_classify(_Op(func, pinned_args, pinned_kwargs, pinned_out), inputs,
                                  outputs, in_keys))
        return out


def _pinned(value: Any) -> Any:
    """A meta tensor argument as an alias of the storage it has now: a later ``param.data =``
    (LoRA's cast of its frozen base, a user's own) gives the Parameter object another storage,
    and the replay, which finds each argument's storage when it runs, would run this operation
    on that one."""
    return value.detach() if isinstance(value, torch.Tensor) and value.is_meta else value


def _mutated(func: Any) -> list[int]:
    return [i for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write]


def _classify(op: _Op, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
              in_keys: set[int]) -> _Op:
    schema_args = op.func._schema.arguments
    written: list[torch.Tensor] = []
    for i in _mutated(op.func):
        arg = op.args[i] if i < len(op.args) else op.kwargs.get(schema_args[i].name)
        written += _meta_tensors(arg)
    written += [t for t in outputs if storage_key(t) not in in_keys]  # new storages
    op.writes = {storage_key(t) for t in written}
    op.reads = set(in_keys)
    self_arg = op.args[0] if op.args else None
    if op.name in _OVERWRITES and isinstance(self_arg, torch.Tensor) and self_arg.is_meta \
            and _covers_storage(self_arg):
        key = storage_key(self_arg)
        op.full_writes.add(key)
        if key not in {storage_key(t) for t in _meta_tensors((op.args[1:], op.kwargs))}:
            op.reads.discard(key)
    op.full_writes |= {storage_key(t) for t in outputs if storage_key(t) not in in_keys}
    return op


def record(factory: Callable[[], Any]) -> tuple[Any, MetaRecording]:
    """``factory()`` built on the meta device, with the record of what it ran. ValueError where
    it calls one of torch's initialisations that return a meta tensor untouched, drawing
    nothing and running no operation the record could see (``_SKIPPED_ON_META``): the replay
    would give that tensor the values it had before."""
    recording = MetaRecording()
    with torch.device("meta"), recording, _refusing_meta_no_ops():
        built = factory()
    return built, recording


# torch.nn.init's functions that return at once for a meta tensor (torch 2.13), by the name
# the public one looks them up with.
_SKIPPED_ON_META = {"_no_grad_trunc_normal_": "trunc_normal_", "dirac_": "dirac_",
                    "orthogonal_": "orthogonal_", "sparse_": "sparse_"}


@contextlib.contextmanager
def _refusing_meta_no_ops() -> Iterator[None]:
    init = torch.nn.init
    originals = {name: getattr(init, name) for name in _SKIPPED_ON_META if hasattr(init, name)}

    def refuse(public: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise ValueError(f"torch.nn.init.{public} draws nothing on the meta device")
        return refused

    try:
        for name in originals:
            setattr(init, name, refuse(_SKIPPED_ON_META[name]))
        yield
    finally:
        for name, original in originals.items():
            setattr(init, name, original)


def _needed(ops: list[_Op], finals: set[int]) -> tuple[list[bool], dict[int, int]]:
    """Which operations reach a final storage (dead-code elimination, backwards), and the index
    of the last needed operation touching each storage."""
    live = set(finals)
    needed = [False] * len(ops)
    last_use: dict[int, int] = {}
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if not op.writes & live:
            continue
        needed[i] = True
        for key in op.writes | op.reads:
            last_use.setdefault(key, i)
        live -= op.full_writes
        live |= op.reads
    return needed, last_use


def _schedule(ops: list[_Op], needed: list[bool]) -> list[int]:
    """The order in which ``replay`` runs the operations: the needed ones and the random ones
    (each draw in its recorded place), except that a needed operation that draws nothing runs
    as soon as every earlier operation touching one of its storages has run. A tensor that the
    factory converts long after making it (LoRA's frozen base, cast to bf16 once every adapter
    exists) is then converted, handed to ``take`` and freed as it is made, instead of every
    original being held until the last conversion. Operations on one storage keep their
    order, so the values are the recorded order's."""
    waiting = [0] * len(ops)
    after: list[list[int]] = [[] for _ in ops]
    last: dict[int, int] = {}  # the last needed operation touching each storage so far
    for i, op in enumerate(ops):
        if not needed[i]:
            continue
        before = {last[key] for key in op.reads | op.writes if key in last}
        waiting[i] = len(before)
        for j in before:
            after[j].append(i)
        for key in op.reads | op.writes:
            last[key] = i
    order: list[int] = []
    ran = [False] * len(ops)
    for i, op in enumerate(ops):
        if ran[i] or not (needed[i] or op.random):
            continue
        ready = [i]
        while ready:
            j = ready.pop()
            order.append(j)
            ran[j] = True
            for k in after[j]:
                waiting[k] -= 1
                if not waiting[k] and not ops[k].random and not ran[k]:
                    ready.append(k)
    return order


class _Storages:
    """Real host storages standing for the recorded meta ones."""

    def __init__(self) -> None:
        self.real: dict[int, torch.UntypedStorage] = {}

    def tensor(self, meta: torch.Tensor, scratch: bool = False) -> torch.Tensor:
        key = storage_key(meta)
        storage = None if scratch else self.real.get(key)
        if storage is None:
            storage = torch.UntypedStorage(meta.untyped_storage().nbytes())
            if not scratch:
                self.real[key] = storage
        real = torch.empty(0, dtype=meta.dtype)
        return real.set_(storage, meta.storage_offset(), meta.shape, meta.stride())

    def convert(self, tree: Any, scratch: bool = False) -> Any:
        def real(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_meta:
                return self.tensor(value, scratch)
            if isinstance(value, torch.device) and value.type == "meta":
                return _HOST
            return value
        return tree_map(real, tree)

    def adopt(self, meta_out: Any, real_out: Any) -> None:
        """Take the new storages an operation returned as the ones its meta outputs stand for."""
        for meta, real in zip(tree_flatten(meta_out)[0], tree_flatten(real_out)[0], strict=True):
            if isinstance(meta, torch.Tensor) and meta.is_meta:
                self.real.setdefault(storage_key(meta), real.untyped_storage())

    def free(self, key: int) -> None:
        self.real.pop(key, None)


def replay(recording: MetaRecording, finals: set[int], seed: int | None,
           take: Callable[[int, Callable[[torch.Tensor], torch.Tensor]], None]) -> None:
    """Run ``recording`` on the host from ``torch.manual_seed(seed)``. ``finals``: the storages
    (``storage_key``) of the parameters and buffers wanted. As soon as one is complete,
    ``take(key, real)`` is called, where ``real(meta)`` gives the host tensor a meta tensor of
    that storage stands for; the storage is freed after."""
    ops = recording.ops
    needed, last_use = _needed(ops, finals)
    last_random = max((i for i, op in enumerate(ops) if op.random and needed[i]), default=-1)
    storages = _Storages()
    if seed is not None:
        torch.manual_seed(seed)
    done_at: dict[int, list[int]] = {}
    for key, index in last_use.items():
        done_at.setdefault(index, []).append(key)
    for i in _schedule(ops, needed):
        op = ops[i]
        if not needed[i]:
            if i < last_random:  # advance the random stream as the host build did
                op.func(*storages.convert(op.args, scratch=True),
                        **storages.convert(op.kwargs, scratch=True))
            continue
        storages.adopt(op.out, op.func(*storages.convert(op.args), **storages.convert(op.kwargs)))
        # the storages this operation used last: intermediates freed before a final one is
        # taken (a weight's fp32 original before its cast is quantized)
        for key in sorted(done_at.get(i, ()), key=lambda key: key in finals):
            if key in finals:
                take(key, storages.tensor)
            storages.free(key)
    for key in finals - set(last_use):  # never written: torch.empty's undefined values
        take(key, storages.tensor)
        storages.free(key)


def unrecorded(recording: MetaRecording, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names among ``tensors`` whose values ``replay`` cannot make: a tensor off the meta
    device (``torch.from_numpy`` and ``load_state_dict(assign=True)`` make real ones, which
    the device context does not reach), or a meta one no recorded operation wrote."""
    written = set().union(*(op.writes for op in recording.ops))
    return [name for name, tensor in tensors.items()
            if not tensor.is_meta or storage_key(tensor) not in written]


def module_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` by name, shared ones under each name."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)
