"""How memtrain saves memory: the strategies of PyTorch's memory guide and beyond, one module each.

- ``precision``: autocast to bf16 or fp16 (fp16 with a ``GradScaler``); ``auto`` picks what the
  device runs fast;
- ``activation_checkpointing``: every block (``full``) or every k-th (``selective``) of
  ``model.blocks`` recomputes its activations in backward;
- ``offload``: what autograd saves for backward held in host memory until backward needs it;
- ``loss``: the output projection and cross-entropy in chunks of tokens, so the ``(B, T, V)``
  logits never exist;
- ``norms``: LayerNorms that keep a bf16 copy of their input for backward under bf16 autocast;
- ``tiled_mlp``: each block's MLP over tiles of the sequence, recomputed in backward, so its
  intermediate exists for one tile at a time;
- ``optimizers``: AdamW's state in bf16, 8 or 4 bits, and the step in backward;
- ``lora``: LoRA adapters through PEFT, the base frozen (in bf16 where asked);
- ``allocator``: the CUDA caching allocator's settings, glibc's malloc on CPU, and the peak.

``trainer.models.build.build_model`` applies the transforms (tiled MLP, checkpointing, loss
chunking, norms, offload), in one order, for the loop, the planner, gpu-check and the benches
alike. The planner that predicts what they save and cost lives above them, in
``trainer.plan``; out-of-memory recovery, which retries a step, beside the step
(``trainer.oom``).
"""
