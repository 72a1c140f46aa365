"""The planner: every choice's peak bytes and step time per rank, predicted before a run, and
the one place ``auto`` is decided.

It sits above the memory strategies it plans (``trainer.memory``), the models and the step,
and below the loop and the launchers. One concern a module:

- ``peak``: static bytes, activation profiles probed on CPU with fake tensors, and
  ``plan_row`` (one plan's predicted peak, the moment it falls at, and its step time);
- ``speed``: the time model: the step's operators counted, a CPU's calibration or a GPU's
  peaks, step time composed with the data loader's measured cost;
- ``candidates``: the plans that fit, fastest first, and the rules that pick among them (pure
  functions, no config: ``make gpu-check`` runs them without pydantic);
- ``choose``: a config's ``auto`` resolved once, for ``train``, ``memtrain plan``,
  ``make bench-plan`` and ``make gpu-check``.
"""
