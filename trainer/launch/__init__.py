"""Launch edge: everything the driver does before and after the workers train, one module each.

- ``prepare``: ``prepare_run`` validates a config for launching, makes its paths absolute,
  resolves ``auto`` (``trainer.plan.choose``) and writes the resolved config into the run
  directory;
- ``local``: the local launcher (in-process, or worker processes forked from a preloaded server;
  no Ray);
- ``rendezvous``: the process group, its store listening on the ranks' meeting address alone
  (torch's own listens on every interface), NCCL with gloo beside it on GPUs;
- ``ray``: the Ray launcher (Ray Train's ``TorchTrainer``); with ``submit`` (the Jobs client) the
  only code that imports ``ray``.
"""
