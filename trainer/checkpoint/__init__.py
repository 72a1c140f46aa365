"""Checkpoints: what one holds, how it is written, published, found, read back and exported.

- ``files``: a checkpoint on disk (DCP files for the model and optimizer, ``state.pt``,
  ``meta.json``), its name, writing a rank's part, finding the latest whole one, reading it;
- ``integrity``: ``meta.json``, the list of every file with its size and SHA-256, and the check
  before a checkpoint is trusted;
- ``publish``: the ranks' parts in a temporary directory, the checkpoint published in the run
  directory (an atomic rename) or uploaded to a run store, the store's latest fetched back;
- ``async_save``: saves on a thread once staged in host memory (``train.checkpoint_async``);
- ``store``: a run directory on object storage (``run.dir: s3://...``);
- ``adapters``: a LoRA run's checkpoints: what they record of the frozen base, the check at
  a resume, the export as PEFT adapters or merged;
- ``export``: ``memtrain export``: a run's weights in the model's own format.
"""
