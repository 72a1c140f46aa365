"""Imported by the local launcher's fork server for workers that compile (``PRELOAD_COMPILE``
in ``trainer.launch.local``): Inductor, which ``torch.compile`` imports on its first call, and
torchao's optimizers (quietly, as ``trainer.memory.optimizers`` imports them), so that each
worker forked from the server starts with them imported."""

from __future__ import annotations

import contextlib

import torch._inductor.compile_fx  # noqa: F401

from trainer.memory.optimizers import quiet_torchao_import

with contextlib.suppress(ImportError), quiet_torchao_import():  # (no strategies extra)
    import torchao.optim  # noqa: F401
