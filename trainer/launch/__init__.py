"""Launch edge: everything the driver does before and after the workers train, one module each.

- ``prepare``: ``prepare_run`` validates a config for launching, makes its paths absolute,
  resolves ``auto`` (``trainer.plan.auto``) and writes the resolved config into the run
  directory;
- ``resume``: what a resume changes against the run's last config, and which changes it refuses;
- ``local``: the local launcher (in-process, or worker processes forked from a preloaded server;
  no Ray);
- ``compile_preload``: what that server imports for workers that compile;
- ``ray``: the Ray launcher (Ray Train's ``TorchTrainer``); with ``submit`` (the Jobs client) the
  only code that imports ``ray``;
- ``console``: what a Ray run prints on the driver's console.

The process group the workers join is ``trainer.parallel.rendezvous``.
"""
