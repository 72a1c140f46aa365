"""The dataset contract: Arrow IPC shard files plus a ``manifest.json`` that lists them.

A dataset is a directory holding shard files and one manifest. The manifest records the format
version, the schema (per column: dtype and fixed shape) and, per shard, its rows, bytes, a
SHA-256 checksum and (optional) the rows per record batch. Writers publish every shard first
and the manifest last, each through a temporary name and an atomic rename, so a half-written
dataset is never readable as complete.
Readers trust only a manifest that validates (``Manifest.from_json``): every field of the right
type and range, dtypes numpy knows, shapes of positive sizes, the format version this reader
speaks, no key it does not know; errors name the manifest, the shard or column and the field.
A shard file that the manifest does not list does not exist for readers, and a shard path must
stay inside the dataset: relative, without ``..`` and, for local datasets, inside the root once
symlinks are resolved (``shard_location``), checked before any shard is opened.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from datapipe.paths import is_remote

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# The numeric dtypes a column may hold (numpy names): what Arrow's fixed-size lists and torch
# both take.
DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64")
MAX_ROWS = 2**48  # far beyond any real shard; larger counts are corrupt, not big


class DatasetError(ValueError):
    """A dataset on disk does not match its contract; the message names the file."""


@dataclass(frozen=True)
class ColumnSpec:
    """One column: a fixed-shape numeric tensor per row."""

    name: str
    dtype: str  # numpy dtype name, e.g. "uint8", "int32", "float32"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the dataset directory
    num_rows: int
    num_bytes: int
    sha256: str
    # Rows per record batch (all but the last), when the writer used a fixed size: lets a
    # remote reader fetch only the batches a row range needs. Optional; older manifests lack it.
    batch_rows: int | None = None


@dataclass
class Manifest:
    columns: list[ColumnSpec]
    shards: list[ShardInfo]
    format_version: int = FORMAT_VERSION
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return sum(shard.num_rows for shard in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(shard.num_bytes for shard in self.shards)

    def column(self, name: str) -> ColumnSpec:
        for column in self.columns:
            if column.name == name:
                return column
        valid = ", ".join(c.name for c in self.columns)
        raise DatasetError(f"column {name!r} is not in the dataset (columns: {valid})")

    def to_json(self) -> str:
        payload = asdict(self)
        return json.dumps(payload, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate a manifest; raises DatasetError naming ``source`` and the field."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{source}: not valid JSON ({err})") from err
        fields = _Fields(source)
        top = fields.mapping(raw, "", {"format_version", "columns", "shards", "metadata"},
                             {"format_version", "columns", "shards"})
        version = fields.integer(top, "format_version", "")
        if version != FORMAT_VERSION:
            raise DatasetError(f"{source}: format_version {version} is not supported (this "
                               f"reader speaks {FORMAT_VERSION})")
        columns = [fields.column(item, f"columns[{i}]")
                   for i, item in enumerate(fields.sequence(top, "columns", ""))]
        if not columns:
            raise DatasetError(f"{source}: columns: the manifest lists no column")
        names = [c.name for c in columns]
        if len(set(names)) != len(names):
            raise DatasetError(f"{source}: columns: a name appears twice ({names})")
        shards = [fields.shard(item, f"shards[{i}]")
                  for i, item in enumerate(fields.sequence(top, "shards", ""))]
        paths = [s.path for s in shards]
        if len(set(paths)) != len(paths):
            raise DatasetError(f"{source}: shards: a path appears twice")
        metadata = top.get("metadata", {})
        if not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise DatasetError(f"{source}: metadata: must map strings to strings")
        return cls(columns=columns, shards=shards, format_version=version,
                   metadata=dict(metadata))


class _Fields:
    """Field-by-field checks of a parsed manifest; each error names the source and field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, where: str, field: str, what: str) -> DatasetError:
        name = f"{where}.{field}" if where else field
        return DatasetError(f"{self.source}: {name}: {what}")

    def mapping(self, value: Any, where: str, allowed: set[str], required: set[str]
                ) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise DatasetError(f"{self.source}: {where or 'the top level'}: must be an object, "
                               f"got {type(value).__name__}")
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise self.fail(where, unknown[0], "unknown key (format v1 has "
                                               f"{', '.join(sorted(allowed))})")
        missing = sorted(required - set(value))
        if missing:
            raise self.fail(where, missing[0], "missing")
        return value

    def sequence(self, parent: dict[str, Any], field: str, where: str) -> list[Any]:
        value = parent[field]
        if not isinstance(value, list):
            raise self.fail(where, field, f"must be a list, got {type(value).__name__}")
        return value

    def integer(self, parent: dict[str, Any], field: str, where: str, low: int = 0,
                high: int = MAX_ROWS) -> int:
        value = parent[field]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, field, f"must be an integer, got {value!r}")
        if not low <= value <= high:
            raise self.fail(where, field, f"{value} is out of range ({low} to {high})")
        return value

    def string(self, parent: dict[str, Any], field: str, where: str) -> str:
        value = parent[field]
        if not isinstance(value, str) or not value:
            raise self.fail(where, field, f"must be a non-empty string, got {value!r}")
        return value

    def column(self, value: Any, where: str) -> ColumnSpec:
        item = self.mapping(value, where, {"name", "dtype", "shape"}, {"name", "dtype", "shape"})
        name = self.string(item, "name", where)
        dtype = self.string(item, "dtype", where)
        if dtype not in DTYPES:
            raise self.fail(where, "dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
        shape = self.sequence(item, "shape", where)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise self.fail(where, "shape", f"{shape!r}: every size must be an integer >= 1 "
                                            "([] for a scalar per row)")
        if len(shape) > 8 or any(d > MAX_ROWS for d in shape):
            raise self.fail(where, "shape", f"{shape!r} is out of range")
        return ColumnSpec(name, dtype, tuple(shape))

    def shard(self, value: Any, where: str) -> ShardInfo:
        item = self.mapping(value, where, {"path", "num_rows", "num_bytes", "sha256",
                                           "batch_rows"},
                            {"path", "num_rows", "num_bytes", "sha256"})
        path = self.string(item, "path", where)
        problem = relative_path_problem(path)
        if problem:
            raise self.fail(where, "path", f"{path!r} {problem}")
        num_rows = self.integer(item, "num_rows", where)
        num_bytes = self.integer(item, "num_bytes", where, high=2**50)
        sha256 = self.string(item, "sha256", where)
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise self.fail(where, "sha256", f"{sha256!r} is not a hex SHA-256")
        batch_rows = None
        if item.get("batch_rows") is not None:
            batch_rows = self.integer(item, "batch_rows", where, low=1)
        return ShardInfo(path, num_rows, num_bytes, sha256, batch_rows)


def relative_path_problem(path: str) -> str | None:
    """Why a shard path could leave its dataset (None: it cannot): it must be relative, in
    forward slashes, without ``..`` or empty segments, and not a URI."""
    if "://" in path or path.startswith(("/", "~")) or "\\" in path or ":" in path[:2]:
        return "must be a path relative to the dataset"
    parts = PurePosixPath(path).parts
    if any(part in ("..", "") for part in path.split("/")) or not parts:
        return "must not contain '..' or empty segments"
    return None


def shard_location(root: str | Path, shard: ShardInfo) -> str:
    """Where ``shard`` lives: ``root/path``, checked to stay inside ``root`` before anything
    opens it. Local roots are resolved with symlinks followed (a shard that is a symlink out of
    the dataset is refused); remote keys are checked as strings (no ``..``, see
    ``relative_path_problem``). Raises DatasetError naming the shard."""
    problem = relative_path_problem(shard.path)
    if problem:
        raise DatasetError(f"shard {shard.path!r}: {problem}")
    if is_remote(root):
        return f"{str(root).rstrip('/')}/{shard.path}"
    base = Path(str(root).removeprefix("file://"))
    location = base / shard.path
    resolved, resolved_root = location.resolve(), base.resolve()
    if resolved != resolved_root and resolved_root not in resolved.parents:
        raise DatasetError(f"shard {location}: resolves to {resolved}, outside the dataset "
                           f"{resolved_root}")
    return str(location)


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 of a local file or, for a URI, of an object read through pyarrow's filesystem."""
    digest = hashlib.sha256()
    if is_remote(path):
        filesystem, inner = remote_filesystem(str(path))
        with filesystem.open_input_stream(inner) as stream:
            while chunk := stream.read(chunk_bytes):
                digest.update(chunk)
        return digest.hexdigest()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Publish the manifest; call this only after every shard it lists is in place."""
    path = directory / MANIFEST_NAME
    atomic_write_bytes(path, manifest.to_json().encode())
    return path


def remote_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and path for ``uri``. S3 endpoints, credentials and region come
    from the usual environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...)."""
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"dataset path {uri}: {err}") from err


def read_text_bytes(path: str | Path) -> bytes:
    """A small file's bytes, local or remote; raises FileNotFoundError when it is absent."""
    if not is_remote(path):
        return Path(str(path).removeprefix("file://")).read_bytes()
    filesystem, inner = remote_filesystem(str(path))
    if filesystem.get_file_info(inner).type != pafs.FileType.File:
        raise FileNotFoundError(path)
    with filesystem.open_input_stream(inner) as stream:
        return stream.read()


def read_text(path: str | Path) -> str:
    """A small file's text, local or remote; raises FileNotFoundError when it is absent."""
    return read_text_bytes(path).decode()


def read_manifest(directory: str | Path) -> Manifest:
    """Read a dataset's manifest; raises DatasetError naming the path when it is absent or bad."""
    if is_remote(directory):
        path = f"{str(directory).rstrip('/')}/{MANIFEST_NAME}"
        try:
            text = read_text(path)
        except FileNotFoundError:
            raise DatasetError(f"{path} is missing: {directory} is not a complete memtrain "
                               "dataset") from None
        except OSError as err:
            raise DatasetError(f"{path}: cannot be read ({err})") from err
        return _checked(Manifest.from_json(text, source=path), path)
    directory = Path(str(directory).removeprefix("file://"))
    if not directory.exists():
        raise DatasetError(f"dataset path {directory} does not exist")
    local = directory / MANIFEST_NAME
    if not local.is_file():
        raise DatasetError(f"{local} is missing: {directory} is not a complete memtrain dataset")
    return _checked(Manifest.from_json(local.read_text(), source=str(local)), str(local))


def _checked(manifest: Manifest, path: str) -> Manifest:
    if not manifest.shards or manifest.num_rows == 0:
        raise DatasetError(f"{path}: the dataset is empty (no rows)")
    return manifest
