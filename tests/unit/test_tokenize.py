"""Real corpora: a tokenizer trained offline on files the test makes, tokenized shards from
text, JSON lines and Parquet, and every bad input as one line naming the file (exit 2, no
manifest)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datapipe.convert import write_dataset
from datapipe.corpus import stdlib_source_files
from datapipe.manifest import DatasetError
from datapipe.shards import ShardSource
from datapipe.split import Range
from datapipe.tokenize import (
    EOT_TOKEN,
    dataset_tokenizer,
    load_tokenizer,
    token_dtype,
    train_tokenizer,
)
from tests.conftest import REPO

pytestmark = pytest.mark.unit
VOCAB = 400


def make_texts(root: Path, count: int = 12) -> Path:
    """Text files from the standard library's source: real, varied and local."""
    root.mkdir(parents=True, exist_ok=True)
    for i, source in enumerate(stdlib_source_files()[:count]):
        (root / f"doc-{i:02d}.txt").write_text(source.read_text(encoding="utf-8"),
                                               encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_texts(tmp_path_factory.mktemp("texts") / "corpus")


@pytest.fixture(scope="module")
def tokenizer(texts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    info = train_tokenizer(sorted(texts.iterdir()), "text", out, VOCAB)
    assert info.vocab_size == VOCAB and out.exists()
    return out


def memtrain(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI's entry point in this process (a subprocess per call cost a second of imports
    each): its exit code and what it printed."""
    import contextlib
    import io

    from trainer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def memtrain_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed entry point as a user's shell runs it."""
    return subprocess.run([sys.executable, "-m", "trainer.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def all_rows(path: Path) -> np.ndarray:
    source = ShardSource(path, "tokens")
    return np.concatenate([part for i, rows in enumerate(source.shard_rows)
                           for part in source.read(Range(i, 0, rows))])


def test_a_trained_tokenizer_has_bytes_eot_and_merges(tokenizer: Path) -> None:
    tok, info = load_tokenizer(tokenizer)
    assert info.vocab_size == VOCAB and tok.id_to_token(info.eot_id) == EOT_TOKEN
    text = "def main():\n    return 'héllo'\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges learned: fewer tokens than bytes


def test_text_becomes_packed_rows_that_decode_to_the_documents(
        texts: Path, tokenizer: Path, tmp_path: Path) -> None:
    """Documents in path order, each followed by the end-of-text token, cut into rows of
    seq_len + 1: decoding the rows gives the documents back (up to the dropped tail)."""
    manifest = write_dataset([texts], tmp_path / "ds", tokenizer=tokenizer, seq_len=63,
                             shard_bytes=8 << 10)
    tok, info = load_tokenizer(tokenizer)
    assert manifest.columns[0].dtype == "uint16" and manifest.columns[0].shape == (64,)
    assert len(manifest.shards) > 1
    assert manifest.metadata["tokenizer"] == "tokenizer.json"
    assert manifest.metadata["tokenizer_sha256"] == info.sha256
    assert manifest.metadata["vocab_size"] == str(VOCAB)
    assert manifest.metadata["eot_id"] == str(info.eot_id)
    stream = all_rows(tmp_path / "ds").reshape(-1)
    docs = [p.read_text(encoding="utf-8") for p in sorted(texts.iterdir())]
    expected = [i for doc in docs for i in tok.encode(doc, add_special_tokens=False).ids
                + [info.eot_id]]
    assert len(stream) == len(expected) // 64 * 64
    assert stream.tolist() == expected[:len(stream)]
    decoded = tok.decode(stream.tolist(), skip_special_tokens=False).split(EOT_TOKEN)
    assert decoded[:-1] == docs[:len(decoded) - 1]

    again = write_dataset([texts], tmp_path / "again", tokenizer=tokenizer, seq_len=63,
                          shard_bytes=8 << 10)
    assert [s.sha256 for s in again.shards] == [s.sha256 for s in manifest.shards]
    model_dir = tmp_path / "model"  # a Hugging Face model directory: its tokenizer.json inside
    model_dir.mkdir()
    shutil.copy(tokenizer, model_dir / "tokenizer.json")
    from_dir = write_dataset([texts], tmp_path / "from-dir", tokenizer=model_dir, seq_len=63,
                             shard_bytes=8 << 10)
    assert [s.sha256 for s in from_dir.shards] == [s.sha256 for s in manifest.shards]
    with pytest.raises(DatasetError, match="a directory without a tokenizer.json"):
        load_tokenizer(texts)


def test_a_dataset_keeps_the_tokenizer_it_was_written_with(texts: Path, tokenizer: Path,
                                                           tmp_path: Path) -> None:
    """Beside the manifest, checked against its SHA-256 when read back; a dataset of byte
    tokens has none."""
    write_dataset([texts], tmp_path / "ds", tokenizer=tokenizer, seq_len=63)
    raw, eot_id = dataset_tokenizer(tmp_path / "ds")
    assert raw == tokenizer.read_bytes() and eot_id == load_tokenizer(tokenizer)[1].eot_id
    (tmp_path / "ds" / "tokenizer.json").write_bytes(raw.replace(b"<|endoftext|>", b"<|eot|>"))
    with pytest.raises(DatasetError, match=r"ds/tokenizer.json: its SHA-256 is not the "
                                           r"manifest's tokenizer_sha256"):
        dataset_tokenizer(tmp_path / "ds")
    write_dataset([texts], tmp_path / "bytes", seq_len=63)
    assert dataset_tokenizer(tmp_path / "bytes") is None


def test_jsonl_and_parquet_give_the_same_rows_as_text(texts: Path, tokenizer: Path,
                                                      tmp_path: Path) -> None:
    docs = [p.read_text(encoding="utf-8") for p in sorted(texts.iterdir())]
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"body": docs}), tmp_path / "docs.parquet")
    reference = write_dataset([texts], tmp_path / "text", tokenizer=tokenizer, seq_len=63)
    for name in ("docs.jsonl", "docs.parquet"):
        written = write_dataset([tmp_path / name], tmp_path / name.replace(".", "-"),
                                tokenizer=tokenizer, seq_len=63, text_field="body")
        assert written.num_rows == reference.num_rows
        assert np.array_equal(all_rows(tmp_path / name.replace(".", "-")),
                              all_rows(tmp_path / "text"))


def test_the_token_dtype_follows_the_vocabulary() -> None:
    assert token_dtype(50_304) == "uint16" and token_dtype(65_536) == "uint16"
    assert token_dtype(65_537) == "uint32" and token_dtype(300, "uint32") == "uint32"
    with pytest.raises(DatasetError, match="--token-dtype uint16 holds ids below 65,536; "
                                           "the vocabulary has 100,000"):
        token_dtype(100_000, "uint16")


def _bad_inputs(root: Path, tokenizer: Path) -> list[tuple[str, list[str], str]]:
    """(case, `data write` arguments, what the one line must say)."""
    root.mkdir()
    (root / "empty.txt").write_text("")
    (root / "blank.txt").write_text("   \n\n")
    (root / "latin1.txt").write_bytes("first line\nsecond: caf\xe9\n".encode("latin-1"))
    (root / "binary.txt").write_bytes(b"text\n\x00\x01\x02")
    (root / "nofield.jsonl").write_text('{"text": "ok"}\n{"body": "no text here"}\n')
    (root / "notjson.jsonl").write_text('{"text": "ok"}\nnot json\n')
    (root / "number.jsonl").write_text('{"text": 7}\n')
    pq.write_table(pa.table({"body": ["x"]}), root / "nocol.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), root / "ints.parquet")
    (root / "tokenizer.txt").write_text("this is not a tokenizer")
    from tokenizers import Tokenizer, models

    words = {f"w{i}": i for i in range(70_000)} | {EOT_TOKEN: 70_000, "[UNK]": 70_001}
    Tokenizer(models.WordLevel(words, unk_token="[UNK]")).save(str(root / "big.json"))
    good = root / "good.txt"
    good.write_text("some text " * 200)
    tok = ["--tokenizer", str(tokenizer)]
    return [
        ("empty file", [str(root / "empty.txt"), *tok], "empty.txt: empty (no text)"),
        ("blank file", [str(root / "blank.txt"), *tok], "blank.txt: empty (no text)"),
        ("not UTF-8", [str(root / "latin1.txt"), *tok],
         "latin1.txt: line 2: not UTF-8 text (byte 0xe9)"),
        ("binary", [str(root / "binary.txt"), *tok], "binary.txt: line 2: binary data"),
        ("missing field", [str(root / "nofield.jsonl"), *tok],
         "nofield.jsonl: line 2: no text field 'text'"),
        ("not JSON", [str(root / "notjson.jsonl"), *tok], "notjson.jsonl: line 2: not a JSON"),
        ("not a string", [str(root / "number.jsonl"), *tok],
         "number.jsonl: line 1: field 'text' is int, not a string"),
        ("missing column", [str(root / "nocol.parquet"), *tok],
         "nocol.parquet: no text column 'text'"),
        ("not strings", [str(root / "ints.parquet"), *tok], "ints.parquet: column 'text' is int64"),
        ("not a tokenizer", [str(good), "--tokenizer", str(root / "tokenizer.txt")],
         "tokenizer.txt: not a tokenizers tokenizer.json"),
        ("no such tokenizer", [str(good), "--tokenizer", str(root / "missing.json")],
         "missing.json: cannot be read"),
        ("no end-of-text", [str(good), *tok, "--eot-token", "<eos>"],
         "has no end-of-text token '<eos>'"),
        ("vocabulary too large for the dtype",
         [str(good), "--tokenizer", str(root / "big.json"), "--token-dtype", "uint16"],
         "--token-dtype uint16 holds ids below 65,536; the vocabulary has 70,002"),
        ("unknown dtype", [str(good), *tok, "--token-dtype", "uint8"],
         "--token-dtype 'uint8' is not one of auto, uint16, uint32"),
    ]


def test_bad_inputs_are_one_line_naming_the_file_exit_2_and_no_manifest(
        tokenizer: Path, tmp_path: Path) -> None:
    for case, args, says in _bad_inputs(tmp_path / "bad", tokenizer):
        out_dir = tmp_path / "out" / case.replace(" ", "-")
        result = memtrain("data", "write", *args, "--out", str(out_dir), "--seq-len", "15")
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (case, result.stderr[-1500:])
        assert len(lines) == 1 and says in lines[0], (case, lines)
        assert not (out_dir / "manifest.json").exists(), case


def test_tokenizer_training_refuses_bad_input(texts: Path, tmp_path: Path) -> None:
    result = memtrain("data", "tokenizer", "train", str(texts), "--vocab-size", "100",
                      "--out", str(tmp_path / "t.json"))
    assert result.returncode == 2 and "--vocab-size must be at least 257" in result.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    result = memtrain("data", "tokenizer", "train", str(tmp_path / "empty"), "--vocab-size",
                      "300", "--out", str(tmp_path / "t.json"))
    assert result.returncode == 2 and "a.txt: empty (no text)" in result.stderr
    assert not (tmp_path / "t.json").exists()


@pytest.mark.slow
def test_from_text_files_to_training_with_no_network(tmp_path: Path) -> None:
    """The README's path for your own corpus: train a tokenizer, write train and val shards,
    inspect them, train a small GPT on them; a model vocabulary smaller than the dataset's is
    refused first, naming both."""
    train_texts = make_texts(tmp_path / "text" / "train", count=16)
    val_texts = tmp_path / "text" / "val"
    val_texts.mkdir()
    (val_texts / "val.txt").write_text(stdlib_source_files()[20].read_text(encoding="utf-8"))
    tok = tmp_path / "tokenizer.json"
    result = memtrain("data", "tokenizer", "train", str(train_texts), "--vocab-size", "512",
                      "--out", str(tok))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "vocabulary 512" in result.stdout
    for split, source in (("train", train_texts), ("val", val_texts)):
        run = memtrain_subprocess if split == "train" else memtrain
        result = run("data", "write", str(source), "--tokenizer", str(tok), "--seq-len", "64",
                     "--out", str(tmp_path / "data" / split))
        assert result.returncode == 0, result.stderr[-2000:]
    shown = memtrain("data", "inspect", str(tmp_path / "data" / "train"))
    assert "tokenizer tokenizer.json" in shown.stdout and "vocabulary 512" in shown.stdout

    common = ["train", "--config", str(REPO / "configs" / "demo-cpu.yaml"), "--launcher",
              "local", "--workers", "1", "--set", f"data.path={tmp_path / 'data' / 'train'}",
              "--set", f"data.val_path={tmp_path / 'data' / 'val'}", "--set",
              f"run.dir={tmp_path / 'runs'}", "--set", "model.seq_len=64", "--set",
              "model.n_layer=2", "--set", "model.n_embd=64", "--set", "model.n_head=2",
              "--set", "train.global_batch_size=8", "--set", "train.micro_batch_size=4",
              "--set", "train.steps=4", "--set", "train.eval_every=4", "--set",
              "train.eval_batches=1", "--set", "train.checkpoint_every=0"]
    refused = memtrain(*common, "--run-name", "small-vocab")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        "memtrain: error: model.vocab_size 256 is smaller than the vocabulary of data.path "
        "(512, tokenizer.json): set model.vocab_size to at least 512")
    trained = memtrain(*common, "--set", "model.vocab_size=512", "--run-name", "tok")
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "tok" / "summary.json").read_text())
    assert summary["final_step"] == 4 and summary["final_loss"] < summary["first_loss"]


def test_a_model_directorys_own_end_of_text_token_is_used(tokenizer: Path, texts: Path,
                                                          tmp_path: Path) -> None:
    """A model directory whose ``tokenizer_config.json`` names ``eos_token`` (a string, or an
    added token's dict) needs no ``--eot-token``; one given still wins; one the tokenizer
    lacks is one line."""
    from tokenizers import AddedToken, Tokenizer

    model = tmp_path / "model"
    model.mkdir()
    raw = Tokenizer.from_file(str(tokenizer))
    raw.add_special_tokens([AddedToken("</s>", special=True)])
    raw.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</t>"}))
    with pytest.raises(DatasetError, match=r"has no end-of-text token '</t>' \(pass "
                                           r"--eot-token\)"):
        load_tokenizer(model)  # named by the directory, absent from the tokenizer
    for config in ({"eos_token": "</s>"}, {"eos_token": {"content": "</s>", "lstrip": False}}):
        (model / "tokenizer_config.json").write_text(json.dumps(config))
        _, info = load_tokenizer(model)
        assert info.eot_id == raw.token_to_id("</s>")
        assert load_tokenizer(model, EOT_TOKEN)[1].eot_id == raw.token_to_id(EOT_TOKEN)
    out = tmp_path / "data"
    write_dataset([texts / sorted(p.name for p in texts.iterdir())[0]], out, tokenizer=model)
    written = dataset_tokenizer(out)
    assert written is not None and written[1] == raw.token_to_id("</s>")
