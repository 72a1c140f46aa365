"""``memtrain data``: build, inspect and verify datasets, and train a tokenizer for them.

The commands of the datapipe package, mounted by the main CLI (``trainer.cli``), which turns
their errors into one line (a ``ValueError``, ``DatasetError`` among them: exit 2). Like the
rest of datapipe, nothing here imports the trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

data_app = typer.Typer(help="Build and inspect sharded Arrow datasets.", no_args_is_help=True)
tokenizer_app = typer.Typer(help="Train a tokenizer for `data write --tokenizer`.",
                            no_args_is_help=True)
data_app.add_typer(tokenizer_app, name="tokenizer")
console = Console(stderr=False)


@data_app.command("corpus")
def data_corpus(
    out: Annotated[Path, typer.Argument(help="Output directory (gets train/ and val/).")],
    seq_len: Annotated[int, typer.Option(help="Tokens per training sequence.")] = 256,
    max_mb: Annotated[float, typer.Option(help="Source megabytes for the train split.")] = 8.0,
    rows_per_shard: Annotated[int, typer.Option(help="Rows per Arrow shard file.")] = 4096,
) -> None:
    """Build a byte-level token dataset from the Python standard library's source files."""
    from datapipe.corpus import build_stdlib_corpus

    if max_mb <= 0:
        raise ValueError(f"--max-mb must be > 0, got {max_mb}")
    estimate = int(max_mb * (1 + 1 / 20) * 2**20 / (seq_len + 1))
    with Progress(TextColumn("building corpus"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("rows"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("rows", total=estimate)
        manifests = build_stdlib_corpus(out, seq_len=seq_len, max_bytes=int(max_mb * 2**20),
                                        rows_per_shard=rows_per_shard,
                                        progress=lambda n: progress.advance(task, n))
        progress.update(task, total=sum(m.num_rows for m in manifests.values()),
                        completed=sum(m.num_rows for m in manifests.values()))
    for split, manifest in manifests.items():
        console.print(f"{out / split}: {manifest.num_rows} rows of {seq_len + 1} tokens in "
                      f"{len(manifest.shards)} shards, {manifest.num_bytes / 2**20:.1f} MiB")


# The options of `data write`, named here so that its signature reads as a list.
FormatOption = Annotated[str, typer.Option(
    "--format", help="auto | parquet | jsonl | text | numpy (auto: by file suffix; a "
                     "save_to_disk directory is read as one) | chat | instruction "
                     "(fine-tuning rows: packed, assistant tokens trained).")]
ColumnsOption = Annotated[str | None, typer.Option(
    help="Parquet/JSON: the columns to keep, comma-separated (default: all).")]
ColumnOption = Annotated[str, typer.Option(
    help="Text/.npy: the column's name; a tokenized dataset: its token column (ragged rows are "
         "packed; input_ids is found without it).")]
TokenizerOption = Annotated[Path | None, typer.Option(
    help="A tokenizers tokenizer.json, or a model directory holding one: text, JSON lines, "
         "Parquet or a saved (save_to_disk) dataset's text become tokens.")]
TextFieldOption = Annotated[str, typer.Option(
    help="With --tokenizer: the JSON field, or the Parquet or saved dataset's column, holding "
         "the text.")]
TokenDtypeOption = Annotated[str, typer.Option(
    help="With --tokenizer: auto (uint16 up to 65,536 tokens, else uint32) | uint16 | uint32.")]
EotOption = Annotated[str | None, typer.Option(
    help="With --tokenizer: the token that ends each document (default: the eos_token of the "
         "model directory's tokenizer_config.json, else <|endoftext|>).")]
SplitOption = Annotated[str | None, typer.Option(
    help="A Hugging Face dataset's split (a DatasetDict's, or a snapshot's train-*.parquet, "
         "train/, dev.jsonl or test.txt files); needed where the inputs hold several.")]
PackOption = Annotated[bool, typer.Option(
    help="With --tokenizer: pack whole documents into rows, with their boundaries, instead of "
         "one stream cut into rows.")]
TooLongOption = Annotated[str, typer.Option(
    help="Packing: a document longer than a row is cut to it, or dropped (cut | drop).")]


@data_app.command("write")
def data_write(
    sources: Annotated[list[Path], typer.Argument(help="Input files or directories.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output dataset directory.")],
    fmt: FormatOption = "auto",
    columns: ColumnsOption = None,
    column: ColumnOption = "tokens",
    seq_len: Annotated[int, typer.Option(help="Text: tokens per row, plus one target.")] = 256,
    shard_size: Annotated[str, typer.Option(help="Target shard size, e.g. 64MiB.")] = "64MiB",
    overwrite: Annotated[bool, typer.Option(help="Replace a dataset already at --out.")] = False,
    tokenizer: TokenizerOption = None,
    text_field: TextFieldOption = "text",
    token_dtype: TokenDtypeOption = "auto",
    eot_token: EotOption = None,
    split: SplitOption = None,
    pack: PackOption = False,
    too_long: TooLongOption = "cut",
    messages_field: Annotated[str, typer.Option(help="--format chat: the messages field.")
                              ] = "messages",
    prompt_field: Annotated[str, typer.Option(help="--format instruction: the prompt field.")
                            ] = "prompt",
    response_field: Annotated[str, typer.Option(
        help="--format instruction: the response field.")] = "response",
) -> None:
    """Convert Parquet, JSON lines, text files, numpy arrays, Hugging Face datasets, or chat and
    instruction rows into a memtrain dataset."""
    from datapipe.convert import PackOptions, write_dataset
    from monitoring.units import parse_bytes

    formats = ("auto", "parquet", "jsonl", "text", "numpy", "chat", "instruction")
    if fmt not in formats:
        raise ValueError(f"--format {fmt!r} is not one of {', '.join(formats)}")
    if too_long not in ("cut", "drop"):
        raise ValueError(f"--too-long {too_long!r} is not one of cut, drop")
    shard_bytes = parse_bytes(shard_size, "--shard-size")
    packing = PackOptions(pack=pack, too_long=too_long, split=split,  # type: ignore[arg-type]
                          messages_field=messages_field, prompt_field=prompt_field,
                          response_field=response_field)
    in_bytes = tokenizer is not None and fmt not in ("chat", "instruction")
    with _write_progress(sources, in_bytes) as (progress, task):
        manifest = write_dataset(
            list(sources), out, fmt, columns=columns.split(",") if columns else None,
            column=column, seq_len=seq_len, shard_bytes=shard_bytes, overwrite=overwrite,
            tokenizer=tokenizer, text_field=text_field, token_dtype=token_dtype,
            eot_token=eot_token,
            progress=None if in_bytes else lambda n: progress.advance(task, n),
            input_progress=(lambda n: progress.advance(task, n)) if in_bytes else None,
            packing=packing)
    described = ", ".join(f"{c.name} {c.dtype}{list(c.shape)}" for c in manifest.columns)
    console.print(f"{out}: {manifest.num_rows} rows ({described}) in {len(manifest.shards)} "
                  f"shards, {manifest.num_bytes / 2**20:.1f} MiB")
    if manifest.metadata.get("packed"):
        console.print(packing.stats.report())


@contextlib.contextmanager
def _write_progress(sources: list[Path], in_bytes: bool) -> Iterator[tuple[Progress, Any]]:
    """``data write``'s bar: input bytes with their rate (tokenizing text), else rows."""
    from rich.progress import DownloadColumn, TransferSpeedColumn

    from datapipe.convert import expand_sources

    if in_bytes:
        total = sum(f.stat().st_size for f in expand_sources(list(sources)))
        shown = [TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                 TimeElapsedColumn()]
    else:
        total = None
        shown = [TextColumn("writing"), BarColumn(), TextColumn("{task.completed:,} rows"),
                 TimeElapsedColumn()]
    with Progress(*shown, console=console) as progress:
        yield progress, progress.add_task("input", total=total)


@tokenizer_app.command("train")
def tokenizer_train(
    sources: Annotated[list[Path], typer.Argument(help="Input files or directories.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write tokenizer.json.")],
    vocab_size: Annotated[int, typer.Option(help="Vocabulary size, end-of-text included.")
                          ] = 32768,
    fmt: Annotated[str, typer.Option(
        "--format", help="auto | text | jsonl | parquet (auto: by file suffix).")] = "auto",
    text_field: Annotated[str, typer.Option(
        help="The JSON field or Parquet column holding the text.")] = "text",
    min_frequency: Annotated[int, typer.Option(help="Merges seen fewer times are not learned.")
                             ] = 2,
    overwrite: Annotated[bool, typer.Option(help="Replace a file already at --out.")] = False,
) -> None:
    """Train a byte-level BPE tokenizer on your text, offline (Hugging Face tokenizers)."""
    from rich.progress import DownloadColumn, TransferSpeedColumn

    from datapipe.convert import detect_format, expand_sources
    from datapipe.tokenize import train_tokenizer

    files = expand_sources(list(sources))
    kind = detect_format(files) if fmt == "auto" else fmt
    # Reading and counting the input is a bar in its bytes; the merges are learned after it.
    with Progress(TextColumn(f"reading for a {vocab_size:,}-token BPE tokenizer"), BarColumn(),
                  DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("input", total=sum(f.stat().st_size for f in files))
        info = train_tokenizer(files, kind, out, vocab_size, text_field=text_field,
                               min_frequency=min_frequency, overwrite=overwrite,
                               progress=lambda n: progress.advance(task, n))
    console.print(f"{out}: vocabulary {info.vocab_size:,}, end-of-text id {info.eot_id}, "
                  f"sha256 {info.sha256[:16]}")


@data_app.command("inspect")
def data_inspect(path: Annotated[str, typer.Argument(
        help="Dataset directory or URI (s3://bucket/prefix).")]) -> None:
    """Show a dataset's schema, shards, rows and bytes."""
    from datapipe.manifest import read_manifest, shard_location

    manifest = read_manifest(path)
    for shard in manifest.shards:  # a shard path out of the dataset is an error here too
        shard_location(path, shard)
    console.print(f"[bold]{path}[/]  format v{manifest.format_version}  "
                  f"{manifest.num_rows} rows  {manifest.num_bytes / 2**20:.2f} MiB  "
                  f"{len(manifest.shards)} shards")
    meta = manifest.metadata
    if "tokenizer" in meta:
        console.print(f"tokenizer {meta['tokenizer']} (sha256 "
                      f"{meta.get('tokenizer_sha256', '?')[:16]}), vocabulary "
                      f"{meta.get('vocab_size', '?')}, end-of-text id {meta.get('eot_id', '?')}")
    elif "vocab_size" in meta:
        console.print(f"vocabulary {meta['vocab_size']} (byte tokens)")
    if meta.get("packed"):  # fine-tuning rows (datapipe.pack)
        console.print(f"packed: {meta.get('packed_documents', '?')} documents, padding "
                      f"{float(meta.get('padding_share', 0)):.1%} of tokens, "
                      f"{meta.get('trained_tokens', '?')} trained tokens"
                      + (f"; {meta['chat_template_source']}" if "chat_template_source" in meta
                         else ""))
    schema = Table("column", "dtype", "shape")
    for column in manifest.columns:
        schema.add_row(column.name, column.dtype, str(list(column.shape)))
    console.print(schema)
    shards = Table("shard", "rows", "bytes", "sha256")
    for shard in manifest.shards:
        shards.add_row(shard.path, str(shard.num_rows), str(shard.num_bytes), shard.sha256[:16])
    console.print(shards)


@data_app.command("verify")
def data_verify(path: Annotated[str, typer.Argument(
        help="Dataset directory or URI (s3://bucket/prefix).")]) -> None:
    """Check every shard against the manifest, checksums included."""
    from rich.progress import DownloadColumn, TransferSpeedColumn

    from datapipe.manifest import DatasetError, read_manifest
    from datapipe.shards import verify_dataset

    with Progress(TextColumn("verifying"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("shards", total=read_manifest(path).num_bytes)
        problems = verify_dataset(path, lambda n: progress.advance(task, n))
    if problems:  # one line: the first problem and how many shards are bad
        raise DatasetError(f"{problems[0]} ({len(problems)} bad of "
                           f"{len(read_manifest(path).shards)} shards)")
    console.print(f"{path}: {len(read_manifest(path).shards)} shards verified")
