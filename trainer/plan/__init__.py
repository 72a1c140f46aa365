"""The planner: every choice's peak bytes and step time per rank, predicted before a run, and
the one place the plan's ``auto`` choices are decided.

It sits above the memory strategies it plans (``trainer.memory``), the models, the ways of
splitting the work and the step, and below the loop and the launchers. One concern a module:

- ``auto``: the ``auto`` choices the plan decides, resolved once (``resolve_auto``: the
  strategy, then the rest, ``decide``), for ``train``, ``memtrain plan``, ``make bench-plan``
  and ``make gpu-check`` (precision, OOM recovery and compile, which depend on a worker's
  device, are resolved there by the functions the planner asks);
- ``candidates``: the plans that fit, fastest first, and the rules that pick among them (pure
  functions, no config: ``make gpu-check`` runs them without pydantic);
- ``rescue``: what ``auto`` adds when nothing fits with the strategies a config has;
- ``peak``: static bytes, activation profiles probed on CPU with fake tensors, and
  ``plan_row`` (one plan's predicted peak, the moment it falls at, and its step time);
- ``work``: a step's operators counted on fake tensors (FLOPs and bytes by kind and dtype);
- ``devices``: how fast a device runs each kind of work (``DeviceSpeed``; a GPU's datasheet
  figures);
- ``calibrate``: this CPU's speed, measured, fitted to a small model's steps, cached with its
  age and stability;
- ``speed``: a plan's step time, composed from the three and the data loader's measured cost
  (``SpeedModel``);
- ``measure``: plans run for real, to hold the predictions against (``memtrain plan
  --measure``, ``make bench-plan``);
- ``table``: what ``memtrain plan`` prints.
"""
