"""The dataset contract: Arrow IPC shard files plus a ``manifest.json`` that lists them.

A dataset is a directory holding shard files and one manifest. The manifest records the format
version, the schema (per column: dtype and fixed shape) and, per shard, its rows, bytes, a
SHA-256 checksum and (optional) the rows per record batch. Writers publish every shard first
and the manifest last, each through a temporary name and an atomic rename, so a half-written
dataset is never readable as complete.
Readers trust only the manifest: a shard file that it does not list does not exist for them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


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
        try:
            raw = json.loads(text)
            version = raw["format_version"]
            if version != FORMAT_VERSION:
                raise DatasetError(f"{source}: format_version {version} is not supported "
                                   f"(expected {FORMAT_VERSION})")
            columns = [
                ColumnSpec(c["name"], c["dtype"], tuple(int(d) for d in c["shape"]))
                for c in raw["columns"]
            ]
            shards = [
                ShardInfo(s["path"], int(s["num_rows"]), int(s["num_bytes"]), s["sha256"],
                          int(s["batch_rows"]) if s.get("batch_rows") else None)
                for s in raw["shards"]
            ]
        except (KeyError, TypeError, json.JSONDecodeError) as err:
            raise DatasetError(f"{source}: malformed manifest ({err})") from err
        return cls(columns=columns, shards=shards, format_version=version,
                   metadata=dict(raw.get("metadata", {})))


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


def is_remote(path: str | Path) -> bool:
    """``s3://``, ``gs://`` and other URIs go through pyarrow's filesystems; paths are local."""
    return "://" in str(path) and not str(path).startswith("file://")


def remote_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and path for ``uri``. S3 endpoints, credentials and region come
    from the usual environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...)."""
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"dataset path {uri}: {err}") from err


def read_text(path: str | Path) -> str:
    """A small file's text, local or remote; raises FileNotFoundError when it is absent."""
    if not is_remote(path):
        return Path(str(path).removeprefix("file://")).read_text()
    filesystem, inner = remote_filesystem(str(path))
    if filesystem.get_file_info(inner).type != pafs.FileType.File:
        raise FileNotFoundError(path)
    with filesystem.open_input_stream(inner) as stream:
        return stream.read().decode()


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


def verify_dataset(directory: str | Path) -> list[str]:
    """Check every shard against the manifest: present, size and SHA-256, local or remote
    (remote shards are streamed through once).

    Returns one line per problem, naming the shard (empty: the dataset is intact).
    """
    manifest = read_manifest(directory)
    problems = []
    for shard in manifest.shards:
        if is_remote(directory):
            path = f"{str(directory).rstrip('/')}/{shard.path}"
            filesystem, inner = remote_filesystem(path)
            info = filesystem.get_file_info(inner)
            size = info.size if info.type == pafs.FileType.File else None
        else:
            local = Path(str(directory).removeprefix("file://")) / shard.path
            path, size = str(local), local.stat().st_size if local.is_file() else None
        if size is None:
            problems.append(f"shard {path}: missing")
            continue
        if size != shard.num_bytes:
            problems.append(f"shard {path}: {size} bytes, the manifest says {shard.num_bytes}")
            continue
        digest = sha256_file(path)
        if digest != shard.sha256:
            problems.append(f"shard {path}: checksum {digest[:16]}... does not match the "
                            f"manifest's {shard.sha256[:16]}...")
    return problems
