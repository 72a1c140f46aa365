"""What is trained, and how a model is built.

- ``gpt``: memtrain's own GPT (decoder-only transformer);
- ``hf``: Hugging Face causal language models as memtrain models, and their safetensors read by
  rows (``SafetensorsRows``);
- ``sequence_split``: what a model asks when each rank holds a slice of every row
  (``SequenceSplit``: positions, the whole rows' mask, attention over whole rows);
- ``registry``: which model a name builds (``create_model``: a registered name, a
  ``module:function`` entry point, or ``hf:DIR``);
- ``build``: a model from its config with its memory transforms applied in one order
  (``build_model``, ``build_whole``), LoRA and bf16 weights in its factory (``model_factory``);
- ``weights``: a built model's tensors filled from an ``hf:`` directory, each rank its rows;
- ``meta_init``: a seeded build on the meta device recorded, and replayed tensor by tensor (each
  rank keeps its shard), so that no process holds the whole model while it is built.

How a model is split over ranks, and the order in which a built model is made ready for its
kind of split, is ``trainer.parallel``.
"""
