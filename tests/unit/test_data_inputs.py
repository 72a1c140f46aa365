"""``memtrain data write`` as a user runs it, on inputs as Hugging Face tools leave them: token
ids padded to a fixed length with their attention mask, a hub snapshot's parquet of several
splits, a tokenizer.json saved with truncation and padding on, and a ``save_to_disk`` dataset of
text. Each test reads back the written dataset's tokens and loss mask."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.test_finetune_data import columns, hf_save_to_disk
from trainer.cli import main

pytestmark = pytest.mark.unit

WORDS = ["<|endoftext|>", "<pad>", *(f"w{n}" for n in range(40))]
EOT, PAD = 0, 1


def memtrain(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str]:
    """``memtrain data write ARGS``: its exit code and its stderr."""
    with pytest.raises(SystemExit) as exited:
        main(["data", "write", *map(str, args)])
    return int(exited.value.code or 0), capsys.readouterr().err.strip()


def word_tokenizer(path: Path, *, truncate_and_pad: bool = False) -> Path:
    """A word-level tokenizer.json: ``w<n>`` is id n + 2, so the expected ids are plain to
    write; with ``truncate_and_pad``, saved with truncation to 8 and padding to 16 on."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                           unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if truncate_and_pad:
        tokenizer.enable_truncation(max_length=8)
        tokenizer.enable_padding(length=16, pad_id=PAD, pad_token="<pad>")
    tokenizer.save(str(path))
    return path


def text(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


def test_a_saved_truncation_and_padding_do_not_cut_or_pad_the_text(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json", truncate_and_pad=True)
    docs = [list(range(2, 14)), list(range(20, 23))]  # 12 tokens (more than 8), then 3
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": text(ids)}) + "\n" for ids in docs))
    code, err = memtrain(capsys, source, "--out", tmp_path / "packed", "--tokenizer",
                         tokenizer, "--seq-len", 15, "--pack")
    assert code == 0, err
    packed = columns(tmp_path / "packed")
    assert packed["tokens"].tolist() == [[*docs[0], EOT, *[EOT] * 3],
                                         [*docs[1], EOT, *[EOT] * 12]]
    assert packed["loss_mask"].tolist() == [[1] * 13 + [0] * 3, [1] * 4 + [0] * 12]
    code, err = memtrain(capsys, source, "--out", tmp_path / "stream", "--tokenizer",
                         tokenizer, "--seq-len", 7)
    assert code == 0, err
    stream = [*docs[0], EOT, *docs[1], EOT]  # 17 tokens: two rows of 8
    assert columns(tmp_path / "stream")["tokens"].tolist() == [stream[:8], stream[8:16]]


def test_a_saved_dataset_of_text_is_tokenized_as_its_parquet_is(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json")
    docs = [list(range(2, 9)), list(range(10, 13)), list(range(30, 40))]
    table = pa.table({"id": [0, 1, 2], "body": [text(ids) for ids in docs]})
    saved = hf_save_to_disk(tmp_path / "saved", table)  # Arrow batches of 2 rows
    pq.write_table(table, tmp_path / "docs.parquet")
    for pack in ([], ["--pack"]):
        written = []
        for source in (saved, tmp_path / "docs.parquet"):
            out = tmp_path / f"{source.stem}{pack}"
            code, err = memtrain(capsys, source, "--out", out, "--tokenizer", tokenizer,
                                 "--text-field", "body", "--seq-len", 11, *pack)
            assert code == 0, err
            written.append(columns(out))
        assert written[0].keys() == written[1].keys()
        for name in written[0]:
            assert written[0][name].tolist() == written[1][name].tolist()
    assert written[0]["tokens"].tolist() == [[*docs[0], EOT, *docs[1], EOT],
                                             [*docs[2], EOT, EOT]]
    assert written[0]["loss_mask"].tolist() == [[1] * 12, [1] * 11 + [0]]
    code, err = memtrain(capsys, saved, "--out", tmp_path / "bad", "--tokenizer", tokenizer)
    assert code == 2
    assert err == (f"memtrain: error: {saved / 'data-00000-of-00001.arrow'}: no text column "
                   "'text' (columns: id, body; pass --text-field)")


def test_padded_token_ids_keep_only_what_their_attention_mask_marks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # padding="max_length" to 6: right padding, left padding, and a row with no pad.
    table = pa.table({"input_ids": [[5, 6, 7, PAD, PAD, PAD], [PAD, PAD, 8, 9, 10, 11],
                                    [12, 13, 14, 15, 16, 17]],
                      "attention_mask": [[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [1] * 6],
                      "labels": [[-100, 6, 7, -100, -100, -100], [-100, -100, 8, 9, 10, 11],
                                 [12, 13, 14, 15, 16, 17]]})
    pq.write_table(table, tmp_path / "padded.parquet")
    saved = hf_save_to_disk(tmp_path / "saved", table.drop_columns(["labels"]))
    code, err = memtrain(capsys, tmp_path / "padded.parquet", "--out", tmp_path / "ds",
                         "--seq-len", 8)
    assert code == 0, err
    written = columns(tmp_path / "ds")
    assert written["tokens"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 0, 0],
                                          [12, 13, 14, 15, 16, 17, 0, 0, 0]]
    assert written["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 1, 0, 0],
                                             [1, 1, 1, 1, 1, 1, 0, 0, 0]]
    assert written["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2],
                                                [0, 0, 0, 0, 0, 0, 1, 1, 1]]
    code, err = memtrain(capsys, saved, "--out", tmp_path / "saved-ds", "--seq-len", 8)
    assert code == 0, err
    assert columns(tmp_path / "saved-ds")["tokens"].tolist() == written["tokens"].tolist()


@pytest.mark.parametrize(("mask", "message"), [
    ([[1, 1, 0], [1, 1]], "row 1: 'attention_mask' has 2 values, 'input_ids' 3"),
    ([[1, 1, 0], [1, 2, 0]], "row 1: 'attention_mask' holds 2, not only 0 and 1"),
])
def test_an_attention_mask_that_does_not_fit_its_ids_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], mask: list, message: str) -> None:
    source = tmp_path / "padded.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, PAD], [7, 8, PAD]], "attention_mask": mask}),
                   source)
    code, err = memtrain(capsys, source, "--out", tmp_path / "ds", "--seq-len", 8)
    assert (code, err) == (2, f"memtrain: error: {source}: {message}")
    assert not (tmp_path / "ds" / "manifest.json").exists()


def snapshot(root: Path, layout: dict[str, list[list[int]]]) -> Path:
    """A hub snapshot's parquet files, each path in ``layout`` holding rows of ``input_ids``."""
    for name, ids in layout.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"input_ids": ids}), root / name)
    return root


@pytest.mark.parametrize(("layout", "splits"), [
    ({"data/train-00000-of-00001.parquet": [[2, 3]], "data/test-00000-of-00001.parquet": [[4]]},
     "train, test"),
    ({"train/part-0.parquet": [[2, 3]], "test/part-0.parquet": [[4]],
      "dev/part-0.parquet": [[5]]}, "train, validation, test"),
    ({"data/train.parquet": [[2, 3]], "data/valid.parquet": [[5]]}, "train, validation"),
])
def test_a_snapshot_of_several_splits_needs_split(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: dict, splits: str) -> None:
    root = snapshot(tmp_path / "snapshot", layout)
    code, err = memtrain(capsys, root, "--out", tmp_path / "ds", "--seq-len", 3)
    assert (code, err) == (2, f"memtrain: error: {root}: files of several splits ({splits}): "
                              "pass --split to choose one")
    code, err = memtrain(capsys, root, "--out", tmp_path / "train", "--seq-len", 3,
                         "--split", "train")
    assert code == 0, err
    assert columns(tmp_path / "train")["tokens"].tolist() == [[2, 3, 0, 0]]


def test_the_split_names_datasets_knows_choose_files_and_one_split_is_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = snapshot(tmp_path / "snapshot", {
        "data/train-00000-of-00002.parquet": [[2, 3]],
        "data/train-00001-of-00002.parquet": [[4, 5]],
        "data/validation-00000-of-00001.parquet": [[5, 6]], "eval/x.parquet": [[7, 8]]})
    for split, tokens in (("dev", [[5, 6, 0, 0]]), ("test", [[7, 8, 0, 0]])):
        code, err = memtrain(capsys, root, "--out", tmp_path / split, "--seq-len", 3,
                             "--split", split)
        assert code == 0, err
        assert columns(tmp_path / split)["tokens"].tolist() == tokens
    code, err = memtrain(capsys, root / "data", "--out", tmp_path / "all", "--seq-len", 3,
                         "--split", "train")
    assert code == 0, err
    assert columns(tmp_path / "all")["tokens"].tolist() == [[2, 3, 4, 5]]
    only = snapshot(tmp_path / "only", {"data/test-00000-of-00001.parquet": [[9, 10]],
                                        "data/test-00001-of-00001.parquet": [[11, 12]]})
    code, err = memtrain(capsys, only, "--out", tmp_path / "only-ds", "--seq-len", 3)
    assert code == 0, err
    assert columns(tmp_path / "only-ds")["tokens"].tolist() == [[9, 10, 11, 12]]


def test_split_takes_a_split_directory_given_or_its_files_named_one_by_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory named for a split, given itself, is that split; a file named one by one
    (a shell glob) is of the split its folder names."""
    root = snapshot(tmp_path / "snapshot", {"train/part-0.parquet": [[2, 3]],
                                            "test/part-0.parquet": [[4, 5]]})
    for name, sources in (("dir", [root / "train"]),
                          ("files", [root / "train" / "part-0.parquet",
                                     root / "test" / "part-0.parquet"])):
        code, err = memtrain(capsys, *sources, "--out", tmp_path / name, "--seq-len", 3,
                             "--split", "train")
        assert code == 0, err
        assert columns(tmp_path / name)["tokens"].tolist() == [[2, 3, 0, 0]]


def test_files_named_one_by_one_of_several_splits_need_split(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = snapshot(tmp_path / "snapshot", {"train/part-0.parquet": [[2, 3]],
                                            "test/part-0.parquet": [[4, 5]]})
    code, err = memtrain(capsys, root / "train" / "part-0.parquet",
                         root / "test" / "part-0.parquet", "--out", tmp_path / "ds",
                         "--seq-len", 3)
    assert (code, err) == (2, "memtrain: error: 2 inputs: files of several splits (train, test): "
                              "pass --split to choose one")
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_text_files_of_several_splits_need_split_and_a_code_corpus_is_read_whole(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json")
    root = tmp_path / "snapshot"
    root.mkdir()
    (root / "train.txt").write_text(text([2, 3, 4, 5]))
    (root / "test.txt").write_text(text([6, 7, 8, 9]))
    code, err = memtrain(capsys, root, "--out", tmp_path / "ds", "--tokenizer", tokenizer,
                         "--seq-len", 3)
    assert (code, err) == (2, f"memtrain: error: {root}: files of several splits (train, "
                              "test): pass --split to choose one")
    code, err = memtrain(capsys, root, "--out", tmp_path / "train", "--tokenizer", tokenizer,
                         "--seq-len", 3, "--split", "train")
    assert code == 0, err
    assert columns(tmp_path / "train")["tokens"].tolist() == [[2, 3, 4, 5]]
    corpus = tmp_path / "corpus"  # code: its file names are no splits
    corpus.mkdir()
    (corpus / "train.py").write_text(text([2, 3, 4, 5]))
    (corpus / "test_model.py").write_text(text([6, 7, 8, 9]))
    code, err = memtrain(capsys, corpus, "--out", tmp_path / "code", "--tokenizer", tokenizer,
                         "--seq-len", 3)
    assert code == 0, err
    assert columns(tmp_path / "code")["tokens"].tolist() == [[6, 7, 8, 9], [EOT, 2, 3, 4]]


@pytest.mark.parametrize("data", ["data/train-00000-of-00001.parquet", "data/train.jsonl"])
def test_a_snapshots_dataset_card_and_hidden_files_are_no_data(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], data: str) -> None:
    """As ``datasets`` resolves a directory: README.md, .gitattributes and huggingface_hub's
    .cache/ beside the data files are neither read nor a second format."""
    root = tmp_path / "snapshot"
    if data.endswith(".parquet"):
        snapshot(root, {data: [[2, 3], [4, 5]]})
    else:
        (root / "data").mkdir(parents=True)
        (root / data).write_text('{"input_ids": [2, 3]}\n{"input_ids": [4, 5]}\n')
    (root / "README.md").write_text("---\nlicense: mit\n---\n# A dataset\n")
    (root / ".gitattributes").write_text("*.parquet filter=lfs diff=lfs merge=lfs -text\n")
    cache = root / ".cache" / "huggingface" / "download" / "data"
    cache.mkdir(parents=True)
    (cache / "train-00000-of-00001.parquet.metadata").write_text("0123abcd\n")
    code, err = memtrain(capsys, root, "--out", tmp_path / "ds", "--seq-len", 3)
    assert (code, err) == (0, "")
    assert columns(tmp_path / "ds")["tokens"].tolist() == [[2, 3, 4, 5]]


def test_files_of_no_split_beside_a_splits_files_are_left_out_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As ``datasets`` resolves a directory: where some files name a split, only they are
    read."""
    root = snapshot(tmp_path / "snapshot", {"train.parquet": [[2, 3]],
                                            "extra.parquet": [[4, 5]]})
    code, err = memtrain(capsys, root, "--out", tmp_path / "ds", "--seq-len", 3)
    assert code == 0, err
    assert columns(tmp_path / "ds")["tokens"].tolist() == [[2, 3, 0, 0]]
    assert err == (f"warning: {root}: only the train split's files are read; left out (no "
                   f"split in their names): {root / 'extra.parquet'}")
