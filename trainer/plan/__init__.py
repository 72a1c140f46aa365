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
- ``rescue``: what ``auto`` adds when nothing fits with the strategies a config has, and what
  it names in its refusal instead;
- ``table``: what ``memtrain plan`` prints;
- ``measure``: plans run for real, to hold the predictions against (``memtrain plan
  --measure``, ``make bench-plan``).

The bytes, in three steps: figures counted or measured, terms per feature, one formula.

- ``static``: what the parameters, gradients and AdamW state take on one rank, counted from the
  model without running it (``StaticBytes``), and where the parameters sit against the blocks;
- ``probe``: the model run on CPU (fake tensors by default) at batch 1 and 2, counting what a
  forward saves for backward, and what a block's backward and each feature hold, into an
  ``ActivationProfile`` (``profile``); ``emulation``: a CPU's emulated bf16 workspace for it;
- ``terms/``: one module per feature, each the bytes that feature adds at a moment of the step
  from its own figures (``fsdp``, ``in_backward``, ``optimizer``, ``nf4``, ``loss``,
  ``sequence``, ``offload``, ``checkpointing``, ``blocks``, ``tiled_mlp``);
- ``peak``: ``plan_row``, one plan's predicted peak as the largest of a few moments, each a sum
  of named terms, with its host bytes and step time.

The time: ``work`` counts a step's operators on fake tensors (FLOPs and bytes by kind and
dtype); ``devices`` says how fast a device runs each kind (``DeviceSpeed``; a GPU's datasheet
figures); ``calibrate`` measures this CPU's speed, fitted to a small model's steps, cached with
its age and stability; ``speed`` composes a plan's step time from the three and the data
loader's measured cost (``SpeedModel``).
"""
