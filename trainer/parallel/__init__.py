"""How the work is split over ranks: one ``Parallelism`` object per way, asked by everything
else (nothing outside this folder and ``trainer.plan`` branches on the kind of splitting).

- ``strategy``: ``Parallelism``, the interface and the one-process way; the order in which a
  model is made ready, written once (``Parallelism.build``);
- ``ddp``: ``DistributedDataParallel``: the whole model on every rank, gradients all-reduced;
- ``fsdp``: ``FullyShardedDataParallel``: FSDP2's settings, sharding, and the sharded build
  (meta device, then each rank's shards filled), so that no rank holds the whole model;
- ``vocab_loss``: under FSDP, the loss and the embedding's lookup split by vocabulary over the
  ranks, so that a frozen output layer or embedding is never gathered;
- ``sequence``: Ulysses sequence parallelism: the ranks of a group each hold a slice of every
  row, attention's all-to-alls between slices of the tokens and shares of the heads, for
  memtrain's GPT and ``hf:`` models (``apply_sequence_parallel``);
- ``mesh``: ``parallel.sequence``: the data x sequence mesh, and DDP or FSDP with each row split
  over a sequence group (``SequenceDDP``, ``SequenceFSDP``);
- ``choice``: which way a run takes (``parallelism_for``) or a built model was given
  (``parallelism_of``);
- ``rendezvous``: the process group, its store listening on the ranks' meeting address alone
  (torch's own listens on every interface), NCCL with gloo beside it on GPUs.
"""
