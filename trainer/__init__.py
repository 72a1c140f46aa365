"""memtrain's trainer: config, CLI, the plain-torch loop, memory strategies, checkpoints, models.

Only ``trainer.launch.ray`` imports Ray; everything else runs without it.
"""

__version__ = "0.1.0"
