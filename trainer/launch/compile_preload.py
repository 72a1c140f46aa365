"""Imported by the local launcher's fork server for workers that compile (``PRELOAD_COMPILE``
in ``trainer.launch.local``): Inductor, which ``torch.compile`` imports on its first call, and
torchao's optimizers (through ``trainer.memory.optimizers.torchao_optim``, quietly), so that each
worker forked from the server starts with them imported."""

from __future__ import annotations

import contextlib

import torch._inductor.compile_fx  # noqa: F401

from trainer.memory.optimizers import MissingExtraError, torchao_optim

with contextlib.suppress(MissingExtraError):  # (no strategies extra: nothing to preload)
    torchao_optim()
