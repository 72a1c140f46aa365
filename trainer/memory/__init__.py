"""How memtrain saves memory: the strategies of PyTorch's memory guide, one module each, and
the planner that predicts what they save before a run.

- ``precision``: autocast to bf16 or fp16 (fp16 with a ``GradScaler``); ``auto`` picks what the
  device runs fast.
- ``activation_checkpointing``: every block (``full``) or every k-th (``selective``) of
  ``model.blocks`` recomputes its activations in backward.
- ``loss``: the output projection and cross-entropy in chunks of tokens, so the ``(B, T, V)``
  logits never exist.
- ``norms``: LayerNorms that keep a bf16 copy of their input for backward under bf16 autocast.
- ``allocator``: the CUDA caching allocator's settings (expandable segments), and the peak.
- ``oom``: out-of-memory recovery that keeps the global batch, agreed on by every rank.
- ``planner``: the step's peak bytes for every precision x checkpointing x micro-batch choice,
  probed on CPU; ``auto`` takes the fastest plan that fits.
- ``speed``: each plan's step time, from the step's operators (counted on fake tensors) over
  this CPU's measured speed or a GPU's peaks.

``trainer.build.build_model`` applies the transforms (checkpointing, loss chunking, norms), in
one order, for the loop, the planner, gpu-check and the benches alike.
"""
