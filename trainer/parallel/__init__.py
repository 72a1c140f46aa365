"""How the work is split over ranks: one ``Parallelism`` object per way, asked by everything
else (nothing outside this folder and ``trainer.plan`` branches on the kind of splitting).

- ``strategy``: ``Parallelism``, the contract every way answers (abstract), its capabilities
  (``DeferredReduction``, ``AppliesPrecision``), ``OneProcess``, and the one order in which a
  model is made ready (``Parallelism.build``);
- ``mesh``: ``Mesh``, the ranks as named dimensions (data ranks that replicate or shard the
  model, and the sequence ranks that share each row), read by every way and the loader;
- ``ddp``: ``DataParallel``: the whole model on every rank, gradients all-reduced;
- ``fsdp``: ``ShardedDataParallel``: FSDP2's settings and sharding, the model made on the meta
  device and each rank's shards filled, so that no rank holds the whole model;
- ``vocab_loss``: under FSDP, the loss and the embedding's lookup split by vocabulary over the
  ranks, so that a frozen output layer or embedding is never gathered;
- ``sequence``: Ulysses sequence parallelism: the ranks of a group each hold a slice of every
  row, attention's all-to-alls between slices of the tokens and shares of the heads, for
  memtrain's GPT and ``hf:`` models (``apply_sequence_parallel``);
- ``choice``: which way a run takes (``parallelism_for``) or a built model was given
  (``parallelism_of``);
- ``rendezvous``: the process group, its store listening on the ranks' meeting address alone
  (torch's own listens on every interface), NCCL with gloo beside it on GPUs.
"""
