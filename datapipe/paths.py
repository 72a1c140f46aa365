"""Whether a dataset or run path is a URI: importable without pyarrow (``memtrain submit``
checks its config's paths with it where only the core install is present)."""

from __future__ import annotations

from pathlib import Path


def is_remote(path: str | Path) -> bool:
    """``s3://``, ``gs://`` and other URIs go through pyarrow's filesystems; paths are local."""
    return "://" in str(path) and not str(path).startswith("file://")
