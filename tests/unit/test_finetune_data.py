"""Fine-tuning data: chat and instruction rows through a chat template with assistant-only loss
masks, packing with document boundaries, Hugging Face datasets (save_to_disk directories and a
snapshot's parquet, read with pyarrow) and ragged token columns; bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datapipe.convert import PackOptions, write_dataset
from datapipe.manifest import DatasetError, read_manifest
from datapipe.pack import Packing, pack
from tests.conftest import arithmetic_chats, write_chat_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = [m["content"] for row in arithmetic_chats(200) for m in row["messages"]]
    return write_chat_tokenizer(tmp_path_factory.mktemp("chat") / "model", texts)


def columns(directory: Path) -> dict[str, np.ndarray]:
    """Every row of a written dataset, column by column."""
    manifest = read_manifest(directory)
    tables = [pa.ipc.open_file(str(directory / s.path)).read_all() for s in manifest.shards]
    return {c.name: np.concatenate([np.stack(t.column(c.name).to_pylist()) for t in tables])
            for c in manifest.columns}


def decode(model_dir: Path, ids: np.ndarray) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(
        ids.tolist(), skip_special_tokens=False)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_chat_rows_train_only_the_assistants_turns(model_dir: Path, tmp_path: Path) -> None:
    chats = arithmetic_chats(40)
    source = write_jsonl(tmp_path / "chat.jsonl", chats)
    packing = PackOptions()
    manifest = write_dataset([source], tmp_path / "ds", "chat", seq_len=127,
                             tokenizer=model_dir, packing=packing)
    assert [c.name for c in manifest.columns] == ["tokens", "loss_mask", "document_ids"]
    meta = manifest.metadata
    assert meta["packed"] == "true" and meta["chat_template_source"].startswith("the chat template")
    data = columns(tmp_path / "ds")
    assert packing.stats.packed == 40 and manifest.num_rows == packing.stats.rows < 40
    answers, prompts = [], []
    for tokens, mask, docs in zip(data["tokens"], data["loss_mask"], data["document_ids"],
                                  strict=True):
        for doc in np.unique(docs):
            where = docs == doc
            if not mask[where].any():
                continue  # padding
            answers.append(decode(model_dir, tokens[where & (mask == 1)]))
            prompts.append(decode(model_dir, tokens[where & (mask == 0)]))
    expected = [row["messages"][2]["content"] for row in chats]
    assert answers == [f"{answer}<|im_end|>\n" for answer in expected]
    assert prompts[0] == ("<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\n"
                          f"{chats[0]['messages'][1]['content']}<|im_end|>\n"
                          "<|im_start|>assistant\n")
    trained = int(data["loss_mask"].sum())
    assert int(meta["trained_tokens"]) == trained
    pad = data["document_ids"] == data["document_ids"].max(axis=1, keepdims=True)
    assert float(meta["padding_share"]) == pytest.approx(
        (pad & (data["loss_mask"] == 0)).sum() / data["tokens"].size, abs=0.02)


def test_instruction_rows_and_the_plain_template(model_dir: Path, tmp_path: Path) -> None:
    plain = write_chat_tokenizer(tmp_path / "plain", ["What is 1 + 2? 1 + 2 = 3."],
                                 template=None)
    rows = [{"question": "What is 1 + 2?", "answer": "1 + 2 = 3."}]
    source = write_jsonl(tmp_path / "inst.jsonl", rows)
    packing = PackOptions(prompt_field="question", response_field="answer")
    manifest = write_dataset([source], tmp_path / "ds", "instruction", seq_len=63,
                             tokenizer=plain, packing=packing)
    assert manifest.metadata["chat_template_source"] == "memtrain's plain template"
    data = columns(tmp_path / "ds")
    mask, tokens = data["loss_mask"][0] == 1, data["tokens"][0]
    used = data["document_ids"][0] == 0
    assert decode(plain, tokens[used]) == "<|user|>\nWhat is 1 + 2?\n<|assistant|>\n1 + 2 = 3." \
        "<|im_end|>"
    assert decode(plain, tokens[mask]) == "1 + 2 = 3.<|im_end|>"


def test_packing_cuts_or_drops_long_documents_and_counts_them() -> None:
    docs = [(np.arange(1, n + 1, dtype=np.uint16), np.ones(n, dtype=np.uint8))
            for n in (3, 4, 12, 2)]
    docs.append((np.array([7, 8], dtype=np.uint16), np.zeros(2, dtype=np.uint8)))
    stats = Packing()
    block = next(pack(iter(docs), 8, 0, "uint16", "cut", stats))
    assert block["tokens"].tolist() == [[1, 2, 3, 1, 2, 3, 4, 0],
                                        [1, 2, 3, 4, 5, 6, 7, 8],
                                        [1, 2, 0, 0, 0, 0, 0, 0]]
    assert block["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2],
                                              [0] * 8, [0, 0, 1, 1, 1, 1, 1, 1]]
    assert (stats.cut, stats.dropped_untrained, stats.packed, stats.rows) == (1, 1, 4, 3)
    assert stats.padding == 1 + 6 and stats.trained == 2 + 3 + 7 + 1
    dropped = Packing()
    block = next(pack(iter(docs), 8, 0, "uint16", "drop", dropped))
    assert dropped.dropped_too_long == 1 and len(block["tokens"]) == 2


def hf_save_to_disk(directory: Path, table: pa.Table) -> Path:
    """A split as ``datasets``' ``save_to_disk`` lays it out (checked against datasets 5.2):
    an Arrow stream file, and state.json listing it beside dataset_info.json."""
    directory.mkdir(parents=True)
    with pa.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    (directory / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "0",
        "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
        "_output_all_columns": False, "_split": None}))
    (directory / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return directory


def test_a_saved_dataset_dict_of_chats_is_read_by_split(model_dir: Path, tmp_path: Path) -> None:
    chats = arithmetic_chats(12)
    root = tmp_path / "hf"
    hf_save_to_disk(root / "train", pa.Table.from_pylist(chats[:9]))
    hf_save_to_disk(root / "test", pa.Table.from_pylist(chats[9:]))
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    for split, count in ((None, 9), ("test", 3)):
        packing = PackOptions(split=split)
        write_dataset([root], tmp_path / f"ds-{split}", "chat", seq_len=255,
                      tokenizer=model_dir, packing=packing)
        assert packing.stats.packed == count
    with pytest.raises(DatasetError, match=r"no split 'dev' \(splits: train, test; pass --split"):
        write_dataset([root], tmp_path / "bad", "chat", seq_len=255, tokenizer=model_dir,
                      packing=PackOptions(split="dev"))


def test_ragged_input_ids_with_labels_are_packed_from_either_source(tmp_path: Path) -> None:
    table = pa.Table.from_pydict({"input_ids": [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 40],
                                  "labels": [[-100, 2, 3], [-100, -100, 6, 7, 8], [9] * 40],
                                  "text": ["a", "b", "c"]})
    saved = hf_save_to_disk(tmp_path / "saved", table)
    snapshot = tmp_path / "snapshot" / "data"
    snapshot.mkdir(parents=True)
    pq.write_table(table, snapshot / "train-00000-of-00001.parquet")
    pq.write_table(table.slice(0, 1), snapshot / "test-00000-of-00001.parquet")
    results = []
    for source in (saved, tmp_path / "snapshot"):
        packing = PackOptions(split="train" if source != saved else None)
        manifest = write_dataset([source], tmp_path / f"out-{source.name}", seq_len=15,
                                 packing=packing)
        assert packing.stats.cut == 1 and manifest.metadata["vocab_size"] == "10"
        results.append(columns(tmp_path / f"out-{source.name}"))
    for name in ("tokens", "loss_mask", "document_ids"):
        np.testing.assert_array_equal(results[0][name], results[1][name])
    assert results[0]["tokens"][0].tolist()[:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert results[0]["loss_mask"][0].tolist()[:8] == [0, 1, 1, 0, 0, 1, 1, 1]


def bad_inputs(root: Path, model_dir: Path) -> list[tuple[dict, str]]:
    chat = write_jsonl(root / "chat.jsonl", arithmetic_chats(2))
    no_answer = write_jsonl(root / "q.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    bad_role = write_jsonl(root / "r.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}])
    missing = write_jsonl(root / "m.jsonl", [{"prompt": "a"}])
    return [
        ({"sources": [chat], "fmt": "chat"}, "--format chat needs --tokenizer"),
        ({"sources": [no_answer], "fmt": "chat", "tokenizer": model_dir},
         "q.jsonl: line 1: no assistant message"),
        ({"sources": [bad_role], "fmt": "chat", "tokenizer": model_dir},
         "r.jsonl: line 1: message 0 is not"),
        ({"sources": [missing], "fmt": "instruction", "tokenizer": model_dir},
         "m.jsonl: line 1: no field 'response'"),
        ({"sources": [chat], "fmt": "chat", "tokenizer": model_dir,
          "packing": PackOptions(split="dev")}, "--split dev: no input file is of that split"),
    ]


def test_bad_fine_tuning_inputs_are_one_line_and_write_nothing(model_dir: Path,
                                                               tmp_path: Path) -> None:
    for number, (kwargs, message) in enumerate(bad_inputs(tmp_path, model_dir)):
        sources, fmt = kwargs.pop("sources"), kwargs.pop("fmt")
        out = tmp_path / f"out-{number}"
        with pytest.raises(DatasetError, match=message):
            write_dataset(sources, out, fmt, seq_len=63, **kwargs)
        assert not (out / "manifest.json").exists()


@pytest.mark.parametrize("answer", ["{{ m.content }}",
                                    "{% generation %}{{ m.content }}{% endgeneration %}"])
def test_a_template_that_refuses_a_conversation_names_the_row(answer: str, tmp_path: Path
                                                              ) -> None:
    """Mistral's templates call raise_exception for a conversation they refuse: the one line
    names the row, as every other refusal of a chat row does."""
    template = ("{% for m in messages %}{% if m.role == 'system' %}"
                "{{ raise_exception('System messages are not supported') }}{% endif %}"
                "{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
                "{% else %}" + answer + "{{ eos_token }}{% endif %}{% endfor %}")
    chats = [{"messages": row["messages"][1:]} for row in arithmetic_chats(3)]  # no system
    model_dir = write_chat_tokenizer(tmp_path / "model", [m["content"] for row in chats
                                                          for m in row["messages"]],
                                     template=template)
    chats[1]["messages"].insert(0, {"role": "system", "content": "You add numbers."})
    source = write_jsonl(tmp_path / "chat.jsonl", chats)
    with pytest.raises(DatasetError, match=rf"^{source}: line 2: the chat template of "
                                           rf"{model_dir}: System messages are not supported$"):
        write_dataset([source], tmp_path / "ds", "chat", seq_len=63, tokenizer=model_dir)
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_a_loss_mask_of_another_shape_than_the_tokens_is_refused(corpus_dir: Path,
                                                                 tmp_path: Path) -> None:
    from datapipe.manifest import ColumnSpec
    from datapipe.writer import write_rows
    from tests.conftest import SEQ_LEN, tiny_config
    from trainer.config import ConfigError
    from trainer.launch.prepare import prepare_run

    rows = 64
    write_rows(tmp_path / "data", [ColumnSpec("tokens", "uint16", (SEQ_LEN + 1,)),
                                   ColumnSpec("loss_mask", "uint8", (SEQ_LEN,))],
               [{"tokens": np.ones((rows, SEQ_LEN + 1), dtype=np.uint16),
                 "loss_mask": np.ones((rows, SEQ_LEN), dtype=np.uint8)}], rows_per_shard=rows)
    with pytest.raises(ConfigError, match=rf"^data.path: column 'loss_mask' has rows of shape "
                                          rf"\[{SEQ_LEN}\], its tokens \[{SEQ_LEN + 1}\]"):
        prepare_run(tiny_config(corpus_dir, tmp_path, f"data.path={tmp_path / 'data'}",
                                "parallel.launcher=local", "parallel.workers=1"))


def test_templates_render_as_transformers_renders_them(tmp_path: Path) -> None:
    """A Llama 3-style template: the BOS from the config, a loop control, strftime_now and a
    tojson that leaves HTML alone, as transformers' environment has them; the answer's span
    is its text and the turn's end."""
    from datapipe.chat import assistant_spans, chat_template

    template = (
        "{{- bos_token }}{%- for m in messages %}{%- if m.role == 'system' %}{% continue %}"
        "{% endif %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content"
        " + '<|eot_id|>' }}{%- endfor %}{{ {'tag': '<b>'} | tojson }}"
        "{%- if strftime_now('%Y') and add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
    rendered = chat_template(tmp_path, "<|eot_id|>")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}]
    with pytest.raises(DatasetError, match="does not render the conversation up to message 2"):
        assistant_spans(rendered, messages, "row 0")  # the JSON tail follows every render
    plain = template.replace("{{ {'tag': '<b>'} | tojson }}", "")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": plain, "bos_token": "<|begin_of_text|>"}))
    text, [(first, last)] = assistant_spans(chat_template(tmp_path, "<|eot_id|>"), messages,
                                            "row 0")
    assert text.startswith("<|begin_of_text|><|start_header_id|>user")
    assert text[first:last] == "yo<|eot_id|>"
    assert '{"tag": "<b>"}' in rendered.text(messages)
