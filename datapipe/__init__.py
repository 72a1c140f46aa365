"""memtrain's data pipeline: the sharded Arrow dataset format, writers and loaders.

- ``manifest``: the dataset contract: Arrow IPC shards and the ``manifest.json`` that lists them;
- ``writer``: fixed-shape numeric rows written as a sharded dataset;
- ``convert``: ``memtrain data write``: Parquet, JSON lines, text or numpy into a dataset;
- ``rows``: rows of Hugging Face datasets, Parquet and JSON lines, read as they are;
- ``tokenize``: text encoded with a ``tokenizers`` tokenizer and packed into rows;
- ``chat``: chat and instruction rows as token ids with a mask of the assistant's tokens;
- ``pack``: documents packed into rows of ``seq_len + 1`` tokens, with boundaries and masks;
- ``corpus``: a real text corpus every machine with Python has (the standard library's source);
- ``shards``: opening, checking and reading the shards of one column;
- ``split``: which rows each rank reads in an epoch, pure functions (property-tested);
- ``loader``: the streaming loader, one rank's batches of a column;
- ``audit``: ``data.record_rows``, which rows each rank trained, step by step;
- ``paths``: whether a path is a URI, importable without pyarrow;
- ``commands``: ``memtrain data``'s subcommands.

Never imports ``trainer`` or ``ray``.
"""
