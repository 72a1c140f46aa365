"""``memtrain data write``: convert Parquet, JSON lines, plain text or numpy arrays into a
memtrain dataset (Arrow IPC shards + manifest, published last).

- **Parquet / JSON lines**: every column must hold one fixed-shape numeric value per row: a
  number, or a (nested) list of numbers of the same length in every row. Read in record
  batches (Parquet) or blocks (JSON), so inputs larger than memory convert.
- **Text**: the files' bytes, concatenated in sorted path order, cut into rows of
  ``seq_len + 1`` byte tokens (a language model's inputs plus next-token targets).
- **Tokenized text** (``tokenizer``): text files, a JSON lines field, or a string column of
  Parquet or a ``save_to_disk`` dataset, through a Hugging Face ``tokenizers`` tokenizer
  (``datapipe.tokenize``).
- **numpy**: ``.npy`` files are rows of one column (concatenated in order); an ``.npz`` file's
  arrays are columns (e.g. ``image`` and ``label``), memory-mapped where numpy allows.

Shards are cut at a target size in bytes. The output is deterministic: the same inputs give
byte-identical shards and manifest.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq

from datapipe.chat import chat_template, encode_conversations
from datapipe.corpus import token_rows
from datapipe.manifest import (
    MANIFEST_NAME,
    ColumnSpec,
    DatasetError,
    Manifest,
    atomic_write_bytes,
)
from datapipe.pack import DOCUMENT_IDS, LOSS_MASK, Packing, TooLong, pack
from datapipe.rows import (
    ATTENTION_MASK,
    SPLIT_KEYWORDS,
    file_split,
    is_saved_dataset,
    rows,
    saved_dataset_files,
    split_name,
    table_fields,
    token_documents,
)
from datapipe.tokenize import (
    TOKEN_DTYPES,
    TOKENIZER_FILE,
    ByteProgress,
    documents,
    load_tokenizer,
    special_tokens,
    text_documents,
    token_blocks,
)
from datapipe.tokenize import token_dtype as token_dtype_for
from datapipe.writer import DatasetWriter, ProgressFn

Format = Literal["auto", "parquet", "jsonl", "text", "numpy"]
_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl",
             ".ndjson": "jsonl", ".npy": "numpy", ".npz": "numpy"}
Block = dict[str, np.ndarray]
# datasets' data files of these kinds carry a split in their names; other text (a code
# corpus's .py files) is read whatever it is called.
_SPLIT_SUFFIXES = {"parquet": None, "jsonl": None, "text": (".txt",)}
log = logging.getLogger("memtrain.data")


def expand_sources(sources: list[Path]) -> list[Path]:
    """Files as given, directories as their files (recursively), in a stable order. A
    directory's hidden files (a hub snapshot's ``.gitattributes``, ``.cache/``) and its
    ``README.md`` (the dataset card) are left out, as ``datasets`` leaves them out of a
    directory's data files; a file given by name is read whatever its name."""
    files: list[Path] = []
    for source in sources:
        if source.is_dir():
            found = {p.relative_to(source).as_posix(): p for p in source.rglob("*")
                     if p.is_file() and not _documentation(p.relative_to(source))}
            files += [found[name] for name in sorted(found)]
        elif source.is_file():
            files.append(source)
        else:
            raise DatasetError(f"input {source} does not exist")
    if not files:
        raise DatasetError(f"no input files in {', '.join(map(str, sources))}")
    return files


def _documentation(relative: PurePath) -> bool:
    return relative.name.lower() == "readme.md" or any(
        part.startswith(".") for part in relative.parts)


def detect_format(files: list[Path]) -> str:
    found = {_SUFFIXES.get(f.suffix.lower(), "text") for f in files}
    if len(found) != 1:
        raise DatasetError(f"inputs mix formats ({', '.join(sorted(found))}): pass --format")
    return found.pop()


def _rows(array: pa.Array | pa.ChunkedArray, name: str, source: Path) -> np.ndarray:
    """One Arrow column as ``(rows, *shape)`` numpy: numbers, or equal-length (nested) lists."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    rows = len(array)
    shape: list[int] = []
    values = array
    while pa.types.is_list(values.type) or pa.types.is_large_list(values.type) or \
            pa.types.is_fixed_size_list(values.type):
        if values.null_count:
            raise DatasetError(f"{source}: column {name!r} has null rows")
        lengths = np.diff(np.asarray(values.offsets)) if not \
            pa.types.is_fixed_size_list(values.type) else None
        width = values.type.list_size if lengths is None else \
            (int(lengths[0]) if len(lengths) else 0)
        if lengths is not None and (lengths != width).any():
            bad = int(np.nonzero(lengths != width)[0][0])
            raise DatasetError(f"{source}: column {name!r} is ragged: row {bad} has "
                               f"{int(lengths[bad])} values, row 0 has {width}")
        shape.append(width)
        values = values.flatten()
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise DatasetError(f"{source}: column {name!r} is {array.type}; memtrain datasets hold "
                           "numbers or fixed-length lists of numbers")
    if values.null_count:
        raise DatasetError(f"{source}: column {name!r} has nulls")
    return values.to_numpy(zero_copy_only=False).reshape((rows, *shape))


def _select(table: pa.Table | pa.RecordBatch, columns: list[str] | None, source: Path) -> Block:
    names = columns or list(table.schema.names)
    missing = [n for n in names if n not in table.schema.names]
    if missing:
        raise DatasetError(f"{source}: no column {missing[0]!r} (columns: "
                           f"{', '.join(table.schema.names)})")
    return {name: _rows(table.column(name), name, source) for name in names}


def parquet_blocks(files: list[Path], columns: list[str] | None) -> Iterator[Block]:
    for file in files:
        try:
            reader = pq.ParquetFile(file)
            for batch in reader.iter_batches(batch_size=8192, columns=columns):
                yield _select(batch, columns, file)
        except (pa.ArrowInvalid, OSError) as err:
            raise DatasetError(f"{file}: not readable as Parquet ({err})") from err


def jsonl_blocks(files: list[Path], columns: list[str] | None) -> Iterator[Block]:
    for file in files:
        try:
            with pajson.open_json(file) as reader:
                for batch in reader:
                    yield _select(batch, columns, file)
        except pa.ArrowInvalid as err:
            raise DatasetError(f"{file}: not readable as JSON lines ({err})") from err


def text_blocks(files: list[Path], seq_len: int, column: str) -> Iterator[Block]:
    return ({column: block} for block in token_rows(files, seq_len + 1))


def numpy_blocks(files: list[Path], column: str, block_rows: int = 65536) -> Iterator[Block]:
    for file in files:
        try:
            if file.suffix.lower() == ".npz":
                with np.load(file, allow_pickle=False) as archive:
                    arrays = {name: archive[name] for name in sorted(archive.files)}
            else:
                arrays = {column: np.load(file, mmap_mode="r", allow_pickle=False)}
        except (ValueError, OSError) as err:
            raise DatasetError(f"{file}: not readable as numpy ({err})") from err
        lengths = {name: len(a) for name, a in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise DatasetError(f"{file}: arrays have different lengths {lengths}")
        total = next(iter(lengths.values()))
        for first in range(0, total, block_rows):
            yield {name: np.asarray(a[first:first + block_rows]) for name, a in arrays.items()}


def _write_blocks(blocks: Iterator[Block], out: Path, shard_bytes: int,
                  metadata: dict[str, str], progress: ProgressFn | None) -> DatasetWriter | None:
    """Every block into shards of about ``shard_bytes`` at ``out``, the columns taken from the
    first block; the writer, still open (None: there was no block)."""
    writer: DatasetWriter | None = None
    for block in blocks:
        if writer is None:
            specs = [ColumnSpec(name, array.dtype.name, tuple(array.shape[1:]))
                     for name, array in block.items()]
            row_bytes = sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in specs)
            writer = DatasetWriter(out, specs, rows_per_shard=max(1, shard_bytes // row_bytes),
                                   metadata=metadata, progress=progress)
        writer.write(block)
    return writer


@dataclass
class PackOptions:
    """Fine-tuning inputs (``datapipe.pack``): documents packed into rows with their loss masks
    and boundaries. ``fmt`` "chat" / "instruction" rows go through the chat template; a
    tokenized dataset's ``input_ids`` (ragged, or padded with an ``attention_mask`` whose pads
    are dropped) or, with ``pack``, tokenized text documents are packed as they are."""

    pack: bool = False  # text with --tokenizer: whole documents into rows, not one stream
    too_long: TooLong = "cut"
    split: str | None = None
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    labels_field: str = "labels"
    stats: Packing = field(default_factory=Packing)


def write_dataset(sources: list[Path], out: Path, fmt: str = "auto", *,
                  columns: list[str] | None = None, column: str = "tokens", seq_len: int = 256,
                  shard_bytes: int = 64 << 20, overwrite: bool = False,
                  tokenizer: Path | None = None, text_field: str = "text",
                  token_dtype: str = "auto", eot_token: str | None = None,
                  progress: ProgressFn | None = None,
                  input_progress: ByteProgress | None = None,
                  packing: PackOptions | None = None) -> Manifest:
    """Convert ``sources`` into a dataset at ``out``; returns its manifest.

    With ``tokenizer`` (a ``tokenizer.json``), text, JSON lines (``text_field``) or Parquet (a
    string column ``text_field``) become rows of ``seq_len + 1`` tokens (``datapipe.tokenize``).
    Chat and instruction rows, a tokenized dataset's ragged ``input_ids`` and, with
    ``packing.pack``, text documents are packed with loss masks and boundaries (``packing``).
    An existing dataset at ``out`` is refused unless ``overwrite``: then its manifest is
    removed first, so no reader ever pairs the old manifest with new shards.
    """
    packing = packing or PackOptions()
    files, kind = _inputs(sources, fmt, packing.split)
    tokenized = None  # (tokenizer, its info, the token dtype), checked before anything is written
    if tokenizer is not None:
        tok, info = load_tokenizer(tokenizer, eot_token)
        tokenized = (tok, info, token_dtype_for(info.vocab_size, token_dtype))
    if seq_len < 1 and (kind == "text" or tokenized or fmt in ("chat", "instruction")):
        raise DatasetError(f"--seq-len must be >= 1, got {seq_len}")
    if shard_bytes < 1:
        raise DatasetError(f"--shard-size must be > 0, got {shard_bytes}")
    packed = _packed_blocks(files, kind, fmt, tokenized, tokenizer, seq_len, column,
                            token_dtype, text_field, packing, input_progress)
    _clear(out, overwrite)
    metadata = {"source_format": kind if fmt not in ("chat", "instruction") else fmt}
    if packed is not None:
        blocks, more = packed
        metadata |= more
    elif tokenized is not None:
        tok, info, dtype = tokenized
        docs = documents(files, kind, text_field, input_progress)
        blocks = ({column: block} for block in token_blocks(docs, tok, info, seq_len + 1, dtype))
        metadata |= info.metadata()
    else:
        blocks = {
            "parquet": lambda: parquet_blocks(files, columns),
            "jsonl": lambda: jsonl_blocks(files, columns),
            "text": lambda: text_blocks(files, seq_len, column),
            "numpy": lambda: numpy_blocks(files, column),
        }[kind]()
        if kind == "text":
            metadata["vocab_size"] = "256"  # byte tokens
    writer = _write_blocks(blocks, out, shard_bytes, metadata, progress)
    if writer is None:
        unit = "tokens" if tokenized else "bytes"
        raise DatasetError(f"no rows in {', '.join(map(str, sources))} (text needs at least "
                           f"seq_len + 1 = {seq_len + 1} {unit})")
    if packed is not None:  # known once every row is written
        writer.metadata |= packing.stats.metadata()
        if "vocab_size" not in packed[1]:  # ids without their tokenizer: what they need
            writer.metadata["vocab_size"] = str(packing.stats.largest_id + 1)
    if tokenized is not None:  # the tokenizer travels with its dataset, before the manifest
        atomic_write_bytes(out / TOKENIZER_FILE, tokenized[1].raw)
    return writer.close()


def _clear(out: Path, overwrite: bool) -> None:
    """Refuse a dataset already at ``out`` unless ``overwrite``; then remove its manifest
    first, so that no reader ever pairs the old manifest with new shards."""
    existing = out / MANIFEST_NAME
    if existing.exists():
        if not overwrite:
            raise DatasetError(f"{out} already holds a dataset: pass --overwrite to replace it")
        existing.unlink()


def _inputs(sources: list[Path], fmt: str, split: str | None) -> tuple[list[Path], str]:
    """The input files and their kind: a ``save_to_disk`` directory is one dataset ("hf", its
    Arrow files), else files by suffix (or ``fmt``); ``split`` chooses a split."""
    if len(sources) == 1 and is_saved_dataset(sources[0]):
        return saved_dataset_files(sources[0], split), "hf"
    files = expand_sources(sources)
    if split is not None:
        splits = input_splits(files, sources, split)
        files = [f for f in files if splits[f] == split_name(split)]
        if not files:
            raise DatasetError(f"--split {split}: no input file is of that split (names like "
                               f"{split}-00000-of-00001.parquet or a {split}/ directory)")
    kind = detect_format(files) if fmt in ("auto", "chat", "instruction") else fmt
    if split is None and kind in _SPLIT_SUFFIXES:  # a hub snapshot's layouts
        files = _one_split(files, sources, kind)
    return files, kind


def input_splits(files: list[Path], sources: list[Path], wanted: str | None = None
                 ) -> dict[Path, str | None]:
    """Each of ``files``' split (``rows.file_split``, as ``split_name`` names it), or None.

    A file found in a directory given is named by its path inside it; where no file there
    is, by the directory's own name. A file given by name is named by its name, else by its
    folder's. A directory's or folder's own name counts where it is a split's keyword
    (``train``, ``dev``) or ``wanted`` (the split asked for).
    """
    def own(name: str) -> str | None:
        return split_name(name) if name == wanted or split_name(name) in SPLIT_KEYWORDS else None

    splits: dict[Path, str | None] = {}
    for source in sources:
        if source.is_dir():
            inside = {f: file_split(f, f.relative_to(source), wanted)
                      for f in files if f.is_relative_to(source)}
            if not any(inside.values()):
                inside = dict.fromkeys(inside, own(source.name))
            splits |= {f: split_name(s) if s else None for f, s in inside.items()}
        else:
            named = file_split(source, PurePath(source.name), wanted)
            splits[source] = split_name(named) if named else own(source.parent.name)
    return splits


def _one_split(files: list[Path], sources: list[Path], kind: str) -> list[Path]:
    """``files`` without ``--split``: refused where they are of several splits; where some
    are of one split, those files (others are left out in one log line, as ``datasets``
    takes only a split's files); all of them where none is of a split."""
    suffixes = _SPLIT_SUFFIXES[kind]
    splits = {f: s for f, s in input_splits(files, sources).items()
              if suffixes is None or f.suffix.lower() in suffixes}
    found = {s for s in splits.values() if s is not None}
    where = str(sources[0]) if len(sources) == 1 else f"{len(sources)} inputs"
    if len(found) > 1:
        named = [s for s in SPLIT_KEYWORDS if s in found] + sorted(found - set(SPLIT_KEYWORDS))
        raise DatasetError(f"{where}: files of several splits ({', '.join(named)}): pass "
                           "--split to choose one")
    if not found:
        return files
    left_out = {f for f, s in splits.items() if s is None}
    if left_out:
        log.warning("%s: only the %s split's files are read; left out (no split in their "
                    "names): %s", where,
                    found.pop(), ", ".join(str(f) for f in files if f in left_out))
    return [f for f in files if f not in left_out]


def _packed_blocks(files: list[Path], kind: str, fmt: str, tokenized: tuple | None,
                   tokenizer_path: Path | None, seq_len: int, column: str, token_dtype: str,
                   text_field: str, packing: PackOptions, input_progress: ByteProgress | None
                   ) -> tuple[Iterator[Block], dict[str, str]] | None:
    """Packed rows' blocks and their metadata where the inputs are fine-tuning documents (see
    ``PackOptions``); None for the other conversions."""
    chat = fmt in ("chat", "instruction")
    ragged, names = None, []
    if not chat and kind in ("hf", "parquet", "jsonl") and tokenized is None:
        names = table_fields(files[0], kind)
        ragged = next((c for c in (column, "input_ids") if c in names and
                       (kind == "hf" or c == "input_ids")), None)
    if not (chat or ragged or (packing.pack and tokenized is not None)):
        if kind == "hf" and tokenized is None:
            raise DatasetError(f"{files[0]}: a saved dataset needs a token column ({column!r} "
                               "or 'input_ids'), --format chat|instruction, or --tokenizer")
        return None
    if chat and tokenized is None:
        raise DatasetError(f"--format {fmt} needs --tokenizer (a model directory with "
                           "tokenizer.json, and its chat template where it has one)")
    if chat:
        assert tokenized is not None and tokenizer_path is not None
        tok, info, dtype = tokenized
        template = chat_template(tokenizer_path if tokenizer_path.is_dir() else None,
                                 tok.id_to_token(info.eot_id))
        docs = encode_conversations(_conversations(files, kind, fmt, packing), tok, template,
                                    dtype)
        more = info.metadata() | special_tokens(tokenizer_path) | {
            "chat_template_source": template.source, "chat_template": template.jinja}
        pad = info.eot_id
    elif ragged:
        # The vocabulary is not known without a tokenizer: auto is the wide dtype, and a
        # dtype asked for is checked as with one (each id is checked against it as it comes).
        dtype = "uint32" if token_dtype == "auto" else token_dtype_for(0, token_dtype)
        labels = packing.labels_field if packing.labels_field in names else None
        attention = ATTENTION_MASK if ATTENTION_MASK in names else None  # padded ids
        fields = [ragged, *(f for f in (labels, attention) if f)]
        docs = token_documents(rows(files, kind, fields), ragged, labels, dtype,
                               TOKEN_DTYPES[dtype], attention)
        more, pad = {"token_column": ragged}, 0
    else:
        assert tokenized is not None
        tok, info, dtype = tokenized
        docs = text_documents(documents(files, kind, text_field, input_progress), tok, info,
                              dtype)
        more, pad = info.metadata(), info.eot_id
    blocks = pack(docs, seq_len + 1, pad, dtype, packing.too_long, packing.stats)
    return blocks, more | {"packed": "true", "loss_mask": LOSS_MASK, "document_ids": DOCUMENT_IDS}


def _conversations(files: list[Path], kind: str, fmt: str, packing: PackOptions
                   ) -> Iterator[tuple[object, str]]:
    """``(messages, where)`` of chat rows, or of instruction rows as a user's prompt and the
    assistant's response."""
    if fmt == "chat":
        for row, where in rows(files, kind, [packing.messages_field]):
            yield row[packing.messages_field], where
        return
    for row, where in rows(files, kind, [packing.prompt_field, packing.response_field]):
        prompt, response = row[packing.prompt_field], row[packing.response_field]
        yield [{"role": "user", "content": prompt},
               {"role": "assistant", "content": response}], where
