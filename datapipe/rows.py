"""Rows of Hugging Face datasets, Parquet and JSON lines, read as they are, for packing.

- **A ``save_to_disk`` directory** (``state.json`` beside ``data-*.arrow``, and a
  ``dataset_dict.json`` above its splits' directories for a ``DatasetDict``): its Arrow files,
  listed by ``state.json``, are read with pyarrow (the ``datasets`` package is not needed). A
  dataset of several splits needs ``--split``; ``train`` is taken where there is one.
- **Parquet, JSON lines or text from a dataset's snapshot**
  (``data/train-00000-of-00002.parquet``, ``train/*.parquet``, ``dev.jsonl``, ``test.txt``): a
  file's split is named as ``datasets`` names it (``file_split``); which files a write reads
  (``--split``, or refused where they are of several splits) is
  ``datapipe.convert.input_splits``' decision, for directories and files named alike.
- **Rows** come in input order as dicts of the fields asked for, each with where it came from
  (``file: row N``, ``file: line N``) for the one-line errors.

What the rows become: ragged token columns (``input_ids``, with ``labels`` where -100 marks a
token not to train on) are documents as they are (``token_documents``); chat and instruction
rows go through the chat template (``datapipe.chat``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from datapipe.manifest import DatasetError

STATE = "state.json"
DICT = "dataset_dict.json"
IGNORE_LABEL = -100  # a label Hugging Face's losses skip
# The split names datasets' data files resolution knows, with the keywords that name each.
SPLIT_KEYWORDS = {"train": ("train", "training"),
                  "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
_DELIMITER = "[-._ 0-9]"  # what may stand beside a split's keyword in a name
_SHARDED = re.compile(r"(\w+(?:\.\w+)*)-[0-9]{5}-of-[0-9]{5}")  # train-00000-of-00002.parquet
ATTENTION_MASK = "attention_mask"  # a tokenizer's padding: 1 for a token, 0 for a pad


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / STATE).is_file() or (path / DICT).is_file())


def saved_dataset_files(path: Path, split: str | None) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory, of ``split`` for a DatasetDict."""
    if (path / DICT).is_file():
        try:
            splits = json.loads((path / DICT).read_text())["splits"]
        except (ValueError, KeyError, TypeError) as err:
            raise DatasetError(f"{path / DICT}: not a dataset_dict.json ({err})") from err
        chosen = split or ("train" if "train" in splits else
                           splits[0] if len(splits) == 1 else None)
        if chosen is None or chosen not in splits:
            raise DatasetError(f"{path}: {'no split ' + repr(split) if split else 'several splits'}"
                               f" (splits: {', '.join(splits)}; pass --split)")
        path = path / chosen
    try:
        files = [entry["filename"] for entry in json.loads((path / STATE).read_text())
                 ["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DatasetError(f"{path / STATE}: not a datasets state.json ({err})") from err
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        raise DatasetError(f"{path}: {missing[0]} is listed in {STATE} but missing")
    return [path / name for name in files]


def split_name(name: str) -> str:
    """The split ``name`` stands for: train, validation or test for one of their keywords
    (``dev`` is validation), else ``name`` itself."""
    return next((split for split, words in SPLIT_KEYWORDS.items() if name in words), name)


def file_split(file: Path, relative: PurePath, wanted: str | None = None) -> str | None:
    """The split of ``file`` (at ``relative`` in the directory given) as ``datasets``' data
    files resolution names it: ``{split}`` of ``data/{split}-00000-of-00002.*``; else the
    split whose keyword names a directory of ``relative``, else its file name, the keyword
    delimited by ``-._``, a space, a digit or the name's ends; None where nothing names one.
    ``wanted`` (a split asked for) is one more keyword where it is none of theirs."""
    sharded = _SHARDED.match(file.name)
    if sharded and file.parent.name == "data":
        return sharded.group(1)
    groups = dict(SPLIT_KEYWORDS)
    if wanted is not None and split_name(wanted) not in groups:
        groups[wanted] = (wanted,)
    # Directories first, as datasets tries them first; a file name's keyword is followed by
    # a delimiter (at least the suffix's dot).
    for names, after in ((relative.parts[:-1], f"(?:{_DELIMITER}|$)"), ((file.name,), _DELIMITER)):
        for split, words in groups.items():
            keyword = re.compile(f"(?:^|{_DELIMITER})(?:{'|'.join(map(re.escape, words))}){after}")
            if any(keyword.search(name) for name in names):
                return split
    return None


def record_batches(file: Path, kind: str, fields: list[str]) -> Iterator[pa.RecordBatch]:
    """The ``fields`` of a Parquet or ``save_to_disk`` Arrow file, batch by batch."""
    try:
        if kind == "parquet":
            reader = pq.ParquetFile(file)
            names = reader.schema_arrow.names
            _check_fields(file, fields, names)
            yield from reader.iter_batches(batch_size=4096, columns=fields)
            return
        with pa.memory_map(str(file)) as source:
            reader = _arrow_reader(source)
            _check_fields(file, fields, reader.schema.names)
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                for index in range(reader.num_record_batches):
                    yield reader.get_batch(index).select(fields)
            else:
                for batch in reader:
                    yield batch.select(fields)
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{file}: not readable as {kind} ({err})") from err


def _arrow_reader(source: pa.MemoryMappedFile) -> Any:
    """An Arrow IPC file's reader: a stream (as ``datasets`` writes them), else the file
    format."""
    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_file(source)


def saved_schema(file: Path) -> pa.Schema:
    """The schema of one Arrow file of a ``save_to_disk`` dataset."""
    try:
        with pa.memory_map(str(file)) as source:
            return _arrow_reader(source).schema
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{file}: not readable as hf ({err})") from err


def _check_fields(file: Path, fields: list[str], names: list[str]) -> None:
    missing = [f for f in fields if f not in names]
    if missing:
        raise DatasetError(f"{file}: no column {missing[0]!r} (columns: {', '.join(names)})")


def table_fields(file: Path, kind: str) -> list[str]:
    """The columns of the first input file (to choose the optional ones)."""
    if kind == "jsonl":
        with file.open("rb") as handle:
            for raw in handle:
                if raw.strip():
                    try:
                        row = json.loads(raw)
                    except ValueError as err:
                        raise DatasetError(f"{file}: line 1: not a JSON object ({err})") from err
                    return list(row) if isinstance(row, dict) else []
        return []
    if kind == "parquet":
        return pq.ParquetFile(file).schema_arrow.names
    with pa.memory_map(str(file)) as source:
        return _arrow_reader(source).schema.names


def rows(files: list[Path], kind: str, fields: list[str]
         ) -> Iterator[tuple[dict[str, Any], str]]:
    """Each row's ``fields`` as Python values, with where it is."""
    for file in files:
        if kind == "jsonl":
            yield from _jsonl_rows(file, fields)
            continue
        first = 0
        for batch in record_batches(file, kind, fields):
            columns = [batch.column(i).to_pylist() for i in range(len(fields))]
            for offset, values in enumerate(zip(*columns, strict=True)):
                yield dict(zip(fields, values, strict=True)), f"{file}: row {first + offset}"
            first += batch.num_rows


def _jsonl_rows(file: Path, fields: list[str]) -> Iterator[tuple[dict[str, Any], str]]:
    with file.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            where = f"{file}: line {number}"
            try:
                row = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise DatasetError(f"{where}: not a JSON object ({err})") from err
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: not a JSON object")
            missing = [f for f in fields if f not in row]
            if missing:
                raise DatasetError(f"{where}: no field {missing[0]!r}")
            yield {f: row[f] for f in fields}, where


def token_documents(rows_: Iterator[tuple[dict[str, Any], str]], column: str,
                    labels: str | None, dtype: str, vocab_limit: int,
                    attention: str | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(ids, loss_mask)`` of pre-tokenized rows: ``column`` holds a list of token ids;
    ``labels`` (optional) a list of the same length where -100 marks a token not trained;
    ``attention`` (optional) a 0/1 list of the same length where 0 marks a pad, dropped."""
    for row, where in rows_:
        ids = row[column]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise DatasetError(f"{where}: {column!r} is not a list of token ids")
        kept = _attended(row, where, column, attention) if attention else slice(None)
        array = np.asarray(ids, dtype=np.int64)[kept]
        if len(array) and (array.min() < 0 or array.max() >= vocab_limit):
            raise DatasetError(f"{where}: {column!r} holds id {int(array.max())} outside "
                               f"[0, {vocab_limit}) of --token-dtype {dtype}")
        mask = np.ones(len(ids), dtype=np.uint8)
        if labels is not None:
            marks = row[labels]
            if not isinstance(marks, list) or len(marks) != len(ids):
                raise DatasetError(f"{where}: {labels!r} is not a list as long as {column!r}")
            mask = (np.asarray(marks, dtype=np.int64) != IGNORE_LABEL).astype(np.uint8)
        yield array.astype(dtype), mask[kept]


def _attended(row: dict[str, Any], where: str, column: str, attention: str) -> np.ndarray:
    """Which of ``row``'s ids its attention mask keeps (1), not a pad (0), as booleans."""
    marks, ids = row[attention], row[column]
    if not isinstance(marks, list):
        raise DatasetError(f"{where}: {attention!r} is not a list of 0s and 1s")
    if len(marks) != len(ids):
        raise DatasetError(f"{where}: {attention!r} has {len(marks)} values, {column!r} "
                           f"{len(ids)}")
    bad = [m for m in marks if m not in (0, 1)]
    if bad:
        raise DatasetError(f"{where}: {attention!r} holds {bad[0]!r}, not only 0 and 1")
    return np.asarray(marks, dtype=bool)
