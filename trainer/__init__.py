"""memtrain's trainer: one worker's training run and everything around it, a folder per concern.

Lowest first (a module imports only from its own level or below; ``tests/unit/test_boundaries.py``
holds the order):

- the base, here: ``config`` (the typed configuration), ``errors`` (one line per error, exit
  codes), ``compat`` (every private torch and Ray API used), ``logs``, ``faults`` (fault
  injection for tests), ``batches`` (a micro-batch and its loader), ``global_batch`` (how the global
  batch divides over ranks and micro-batches, torch-free), ``tensors`` (a tensor's storage and this
  rank's part of it);
- ``memory/``: the memory strategies, one module each;
- ``models/``: what is trained (memtrain's GPT, Hugging Face models, the registry) and how a
  model is built with its memory transforms and weights;
- ``parallel/``: how the work is split over ranks: the process group and one ``Parallelism``
  object per way (one process, DDP, FSDP), which builds, wraps and steps the model its way;
- ``checkpoint/``, ``telemetry/`` (metrics, diagnostics, restarts, workers' errors), ``optim``
  (AdamW and its schedule), ``context`` (what the loop asks of its launcher), ``state``
  (``TrainState``: what a checkpoint holds);
- ``oom`` (out-of-memory recovery) and ``step`` (one optimizer step);
- ``plan/``: the planner and ``auto``;
- ``loop``: one worker's run, top to bottom;
- ``launch/``: what the driver does before and after the workers train;
- ``cli``: the ``memtrain`` command line.

Only the launch edge (``trainer.launch.ray``, ``trainer.launch.submit``) imports Ray; everything
else runs without it.
"""

__version__ = "0.1.0"
