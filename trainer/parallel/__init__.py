"""How the work is split over ranks.

- ``rendezvous``: the process group, its store listening on the ranks' meeting address alone
  (torch's own listens on every interface), NCCL with gloo beside it on GPUs;
- ``fsdp``: FSDP2's settings, sharding a model and the sharded build (meta device, then each
  rank's shards filled), so that no rank holds the whole model;
- ``meta_init``: a seeded build on the meta device recorded, and replayed per shard.
"""
