"""Launch edge: everything the driver does before and after the workers train, one module each.

- ``prepare``: ``prepare_run`` validates a config for launching, makes its paths absolute,
  resolves ``auto`` and writes the resolved config into the run directory;
- ``auto``: the planner's ``auto`` choices (micro-batch, activation checkpointing, bf16 norm
  inputs), resolved in the driver;
- ``worker_errors``: a failed worker's error as one line naming its rank;
- ``local``: the local launcher (in-process, or worker processes forked from a preloaded server;
  no Ray);
- ``ray``: the Ray launcher (Ray Train's ``TorchTrainer``); with ``submit`` (the Jobs client) the
  only code that imports ``ray``.
"""
