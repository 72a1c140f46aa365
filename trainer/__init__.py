"""memtrain's trainer: config, CLI, the plain-torch loop, memory strategies, checkpoints, models.

Only the launch edge (``trainer.launch.ray``, ``trainer.launch.submit``) imports Ray; everything
else runs without it.
"""

__version__ = "0.1.0"
