"""Tokenized text: documents from text files, JSON lines or Parquet, encoded with a Hugging Face
``tokenizers`` tokenizer (``tokenizer.json``) and packed into rows of ``seq_len + 1`` tokens.

- **Documents.** A text file is one document (read in pieces that end at a line break, so
  files larger than memory convert); a JSON line's ``text_field`` is one; a string column's
  value is one, in Parquet or in a ``save_to_disk`` dataset's Arrow files (``datapipe.rows``).
  Documents are read in sorted path order, lines and rows in order.
- **Encoding.** ``encode_batch_fast`` over batches of documents (the Rust library spreads a
  batch over every core), the next batch read and encoded on a thread while this one is packed
  and written, without the tokenizer's own special tokens, truncation or padding (a
  ``tokenizer.json`` saved for a model's inputs may have both on); each document is followed
  by the end-of-text token. The token stream is cut into rows of ``seq_len + 1``; the last,
  partial row is dropped. The same inputs and tokenizer give the same shards.
- **Token dtype.** ``uint16`` while every id fits (vocabulary up to 65,536), else ``uint32``.
- **Provenance.** The dataset keeps a copy of its tokenizer (``tokenizer.json`` beside the
  manifest) and the manifest's metadata records it: file name, SHA-256, vocabulary size and
  end-of-text id. ``memtrain train`` refuses a model whose vocabulary is smaller than the
  dataset's; ``memtrain export --hf`` writes the tokenizer beside the trained model.
- **A tokenizer without the hub.** ``train_tokenizer`` trains a byte-level BPE tokenizer on the
  same documents, offline.

Bad input (an empty file, bytes that are not UTF-8, a JSON line without the field, a file that
is not a tokenizer, a vocabulary the dtype cannot hold) is a ``DatasetError`` naming the file,
and the line or row where there is one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from datapipe.manifest import DatasetError, read_manifest, read_text_bytes
from datapipe.rows import record_batches, saved_schema

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOT_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"  # the name of a dataset's copy of its tokenizer
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # a chat template's
PIECE_BYTES = 1 << 20  # a text file is read and encoded in pieces of about this size
BATCH_BYTES = 4 << 20  # text handed to one encode_batch call (spread over every core)
TOKEN_DTYPES = {"uint16": 1 << 16, "uint32": 1 << 32}
ByteProgress = Callable[[int], None]  # called with the input bytes just read


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records of the tokenizer a dataset was written with."""

    name: str
    sha256: str
    vocab_size: int
    eot_id: int
    raw: bytes = field(repr=False, default=b"")  # the file's bytes, copied into the dataset

    def metadata(self) -> dict[str, str]:
        return {"tokenizer": self.name, "tokenizer_sha256": self.sha256,
                "vocab_size": str(self.vocab_size), "eot_id": str(self.eot_id)}


def _require_tokenizers() -> None:
    try:
        import tokenizers  # noqa: F401
    except ImportError as err:  # an install without the dependency: say which
        raise DatasetError("--tokenizer needs the `tokenizers` package (pip install "
                           "tokenizers)") from err


def load_tokenizer(path: Path, eot_token: str | None = None
                   ) -> tuple[Tokenizer, TokenizerInfo]:
    """A ``tokenizer.json`` (or a model directory's, as Hugging Face saves one beside its
    ``config.json``) and what the manifest records of it, with its saved truncation and
    padding turned off. The end-of-text token: ``eot_token``, else the ``eos_token`` a model
    directory's ``tokenizer_config.json`` names, else ``<|endoftext|>``."""
    _require_tokenizers()
    from tokenizers import Tokenizer

    if path.is_dir():
        if not (path / TOKENIZER_FILE).is_file():
            raise DatasetError(f"tokenizer {path}: a directory without a {TOKENIZER_FILE}")
        eot_token = eot_token or configured_eos(path)
        path = path / TOKENIZER_FILE
    eot_token = eot_token or EOT_TOKEN
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DatasetError(f"tokenizer {path}: cannot be read ({err.strerror})") from err
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # tokenizers raises a plain Exception for every parse error
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DatasetError(f"tokenizer {path}: not a tokenizers tokenizer.json ({first})") from err
    # A tokenizer.json saved for a model's inputs may cut or pad every encoding; documents are
    # encoded whole here (rows are cut and padded by packing, pads never trained).
    tokenizer.no_truncation()
    tokenizer.no_padding()
    eot_id = tokenizer.token_to_id(eot_token)
    if eot_id is None:
        raise DatasetError(f"tokenizer {path}: has no end-of-text token {eot_token!r} "
                           "(pass --eot-token)")
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    return tokenizer, TokenizerInfo(TOKENIZER_FILE, hashlib.sha256(raw).hexdigest(), vocab_size,
                                    eot_id, raw)


def tokenizer_config(directory: Path) -> dict[str, Any]:
    """A model directory's ``tokenizer_config.json`` (empty where it has none); DatasetError
    naming the file where it is not a JSON object."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return {}
    try:
        found = json.loads(config.read_text())
    except (OSError, ValueError) as err:
        raise DatasetError(f"tokenizer {config}: not a readable JSON object ({err})") from err
    if not isinstance(found, dict):
        raise DatasetError(f"tokenizer {config}: not a readable JSON object (a JSON "
                           f"{type(found).__name__})")
    return found


def special_token(config: dict[str, Any], name: str) -> str | None:
    """The special token ``name`` (``eos_token``, ``bos_token``, ...) a tokenizer config names:
    a string, or an added token's ``{"content": ...}``; None where it names none."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def special_tokens(directory: Path | None) -> dict[str, str]:
    """The special tokens (``SPECIAL_TOKENS``) a model directory's ``tokenizer_config.json``
    names, by name; a chat dataset's manifest keeps them, as its template renders with them."""
    config = tokenizer_config(directory) if directory is not None and directory.is_dir() else {}
    return {name: token for name in SPECIAL_TOKENS
            if (token := special_token(config, name)) is not None}


def configured_eos(directory: Path) -> str | None:
    """The ``eos_token`` a model directory's ``tokenizer_config.json`` names; None where it
    names none."""
    return special_token(tokenizer_config(directory), "eos_token")


def dataset_tokenizer(directory: str | Path) -> tuple[bytes, int] | None:
    """The ``tokenizer.json`` a dataset was written with (local or remote), checked against its
    manifest's SHA-256, and its end-of-text id; None for a dataset of byte tokens or columns,
    or one written before datasets kept their tokenizer."""
    metadata = read_manifest(directory).metadata
    if "tokenizer" not in metadata:
        return None
    location = f"{str(directory).rstrip('/')}/{metadata['tokenizer']}"
    try:
        raw = read_text_bytes(location)
    except FileNotFoundError:
        return None
    if hashlib.sha256(raw).hexdigest() != metadata.get("tokenizer_sha256"):
        raise DatasetError(f"{location}: its SHA-256 is not the manifest's tokenizer_sha256 "
                           "(the file was changed after the dataset was written)")
    return raw, int(metadata["eot_id"])


def token_dtype(vocab_size: int, requested: str = "auto") -> str:
    """The narrowest dtype that holds every id of the vocabulary, or ``requested`` if it does."""
    if requested == "auto":
        return next(name for name, limit in TOKEN_DTYPES.items() if vocab_size <= limit)
    if requested not in TOKEN_DTYPES:
        raise DatasetError(f"--token-dtype {requested!r} is not one of auto, "
                           f"{', '.join(TOKEN_DTYPES)}")
    if vocab_size > TOKEN_DTYPES[requested]:
        raise DatasetError(f"--token-dtype {requested} holds ids below "
                           f"{TOKEN_DTYPES[requested]:,}; the vocabulary has {vocab_size:,}")
    return requested


# ---- documents ------------------------------------------------------------------------------
def _cut(data: bytes) -> int:
    """Where a piece of ``data`` may end: after its last line break, else before a UTF-8
    character that the read cut off."""
    cut = data.rfind(b"\n") + 1
    if cut:
        return cut
    cut = len(data)
    while cut > max(0, len(data) - 4) and data[cut - 1] & 0xC0 == 0x80:
        cut -= 1  # continuation bytes: back off to the character's lead byte
    return cut - 1 if cut and data[cut - 1] >= 0xC0 else len(data)


def _text_pieces(file: Path, progress: ByteProgress | None) -> Iterator[tuple[str, bool]]:
    """A text file as pieces of about PIECE_BYTES that end at a line break, then ``("",
    True)`` for the end of the document."""
    line, has_text = 1, False
    with file.open("rb") as handle:
        pending = b""
        while True:
            chunk = handle.read(PIECE_BYTES)
            data = pending + chunk
            cut = _cut(data) if chunk else len(data)
            piece, pending = data[:cut], data[cut:]
            if piece:
                if b"\0" in piece:
                    at = line + piece[:piece.index(b"\0")].count(b"\n")
                    raise DatasetError(f"{file}: line {at}: binary data (a NUL byte), not text")
                try:
                    text = piece.decode("utf-8")
                except UnicodeDecodeError as err:
                    at = line + piece[:err.start].count(b"\n")
                    raise DatasetError(f"{file}: line {at}: not UTF-8 text (byte "
                                       f"0x{piece[err.start]:02x})") from err
                has_text = has_text or bool(text.strip())
                line += piece.count(b"\n")
                if progress is not None:
                    progress(len(piece))
                yield text, False
            if not chunk:
                break
    if not has_text:
        raise DatasetError(f"{file}: empty (no text)")
    yield "", True


def _jsonl_documents(file: Path, field: str, progress: ByteProgress | None
                     ) -> Iterator[tuple[str, bool]]:
    found = False
    with file.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if progress is not None:
                progress(len(raw))
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise DatasetError(f"{file}: line {number}: not a JSON object ({err})") from err
            if not isinstance(row, dict) or field not in row:
                raise DatasetError(f"{file}: line {number}: no text field {field!r} "
                                   "(pass --text-field)")
            if not isinstance(row[field], str):
                raise DatasetError(f"{file}: line {number}: field {field!r} is "
                                   f"{type(row[field]).__name__}, not a string")
            found = True
            yield row[field], True
    if not found:
        raise DatasetError(f"{file}: empty (no JSON lines)")


def _text_column(file: Path, schema: pa.Schema, field: str) -> None:
    """Refuse a table whose ``field`` is not a column of strings."""
    if field not in schema.names:
        raise DatasetError(f"{file}: no text column {field!r} (columns: "
                           f"{', '.join(schema.names)}; pass --text-field)")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DatasetError(f"{file}: column {field!r} is {kind}, not strings")


def _column_documents(file: Path, batches: Iterator[pa.RecordBatch], field: str,
                      progress: ByteProgress | None) -> Iterator[tuple[str, bool]]:
    """Each value of the string column ``field`` of ``batches`` as one document; a null value
    or a table of no rows is refused."""
    first = 0
    for batch in batches:
        column = batch.column(field)
        if column.null_count:
            row = first + int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise DatasetError(f"{file}: row {row}: column {field!r} is null")
        values = column.to_pylist()
        if progress is not None:
            progress(sum(len(v) for v in values))
        for value in values:
            yield value, True
        first += len(column)
    if first == 0:
        raise DatasetError(f"{file}: empty (no rows)")


def _parquet_documents(file: Path, field: str, progress: ByteProgress | None
                       ) -> Iterator[tuple[str, bool]]:
    try:
        reader = pq.ParquetFile(file)
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{file}: not readable as Parquet ({err})") from err
    _text_column(file, reader.schema_arrow, field)
    yield from _column_documents(
        file, reader.iter_batches(batch_size=8192, columns=[field]), field, progress)


def _saved_documents(file: Path, field: str, progress: ByteProgress | None
                     ) -> Iterator[tuple[str, bool]]:
    """The text column of one Arrow file of a ``save_to_disk`` dataset."""
    _text_column(file, saved_schema(file), field)
    yield from _column_documents(file, record_batches(file, "hf", [field]), field, progress)


def documents(files: list[Path], kind: str, text_field: str = "text",
              progress: ByteProgress | None = None) -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` for every document of ``files``, in order."""
    read = {"text": lambda f: _text_pieces(f, progress),
            "jsonl": lambda f: _jsonl_documents(f, text_field, progress),
            "parquet": lambda f: _parquet_documents(f, text_field, progress),
            "hf": lambda f: _saved_documents(f, text_field, progress)}.get(kind)
    if read is None:
        raise DatasetError(f"--tokenizer reads text, jsonl, parquet or saved (hf) datasets, "
                           f"not {kind}")
    for file in files:
        yield from read(file)


# ---- encoding and packing -------------------------------------------------------------------
def _batches(docs: Iterator[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    batch: list[tuple[str, bool]] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[0])
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def token_blocks(docs: Iterator[tuple[str, bool]], tokenizer: Tokenizer, info: TokenizerInfo,
                 row_len: int, dtype: str, block_rows: int = 8192) -> Iterator[np.ndarray]:
    """``(n, row_len)`` blocks of the packed token stream: each document's ids, then the
    end-of-text id; the last partial row is dropped."""
    np_dtype = np.dtype(dtype)
    eot = np.array([info.eot_id], dtype=np_dtype)
    pending: list[np.ndarray] = []
    pending_tokens = 0
    block_tokens = block_rows * row_len
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def cut(pieces: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The whole rows of the concatenated ``pieces``, and the tokens left over."""
        stream = np.concatenate(pieces)
        whole = len(stream) // row_len * row_len
        return stream[:whole].reshape(-1, row_len), stream[whole:]

    def encoded() -> Iterator[tuple[list[tuple[str, bool]], list]]:
        """Each batch with its encodings; the next batch is read and encoded on a thread while
        the caller packs and writes this one (the Rust encoder releases the GIL)."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="memtrain-encode") as pool:
            batches = _batches(docs)

            def next_encoded() -> tuple[list[tuple[str, bool]], list] | None:
                batch = next(batches, None)
                if batch is None:
                    return None
                return batch, encode([text for text, _ in batch], add_special_tokens=False)

            ahead = pool.submit(next_encoded)
            while (done := ahead.result()) is not None:
                ahead = pool.submit(next_encoded)
                yield done

    for batch, encodings in encoded():
        for (_, ends), encoding in zip(batch, encodings, strict=True):
            ids = np.asarray(encoding.ids, dtype=np_dtype)
            pending.append(ids)
            pending_tokens += len(ids)
            if ends:
                pending.append(eot)
                pending_tokens += 1
        if pending_tokens >= block_tokens:
            block, rest = cut(pending)
            yield block
            pending, pending_tokens = [rest], len(rest)
    if pending_tokens >= row_len:
        yield cut(pending)[0]


def text_documents(docs: Iterator[tuple[str, bool]], tokenizer: Tokenizer, info: TokenizerInfo,
                   dtype: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(ids, loss_mask)`` of each whole document, its end-of-text id last and every token
    trained: the documents ``datapipe.pack`` packs with their boundaries (``--pack``)."""
    np_dtype = np.dtype(dtype)
    pieces: list[np.ndarray] = []
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    for batch in _batches(docs):
        for (_, ends), encoding in zip(batch, encode([t for t, _ in batch],
                                                     add_special_tokens=False), strict=True):
            pieces.append(np.asarray(encoding.ids, dtype=np_dtype))
            if ends:
                pieces.append(np.array([info.eot_id], dtype=np_dtype))
                ids = np.concatenate(pieces)
                pieces = []
                yield ids, np.ones(len(ids), dtype=np.uint8)


# ---- training a tokenizer -------------------------------------------------------------------
def train_tokenizer(files: list[Path], kind: str, out: Path, vocab_size: int, *,
                    text_field: str = "text", min_frequency: int = 2,
                    overwrite: bool = False, progress: ByteProgress | None = None
                    ) -> TokenizerInfo:
    """A byte-level BPE tokenizer trained on ``files``' documents, saved at ``out``; its
    vocabulary is the 256 byte symbols, the end-of-text token and the merges learned."""
    _require_tokenizers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    floor = 256 + 1
    if vocab_size < floor:
        raise DatasetError(f"--vocab-size must be at least {floor} (the 256 byte symbols and "
                           f"{EOT_TOKEN}), got {vocab_size}")
    if out.exists() and not overwrite:
        raise DatasetError(f"{out} exists: pass --overwrite to replace it")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOT_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(
        (text for text, _ in documents(files, kind, text_field, progress)), trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tokenizer.save(str(tmp))
    tmp.replace(out)
    return load_tokenizer(out)[1]
