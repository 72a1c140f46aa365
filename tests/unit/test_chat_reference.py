"""memtrain's chat loss masks held against transformers' ``apply_chat_template(...,
return_assistant_tokens_mask=True)``: the same token ids and the same trained tokens, for the
chat formats of the model families people fine-tune, with and without ``{% generation %}``
blocks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from datapipe.chat import chat_template, encode_conversations
from datapipe.manifest import DatasetError

pytestmark = pytest.mark.unit

# Each family's format, short and as its model's template writes it, with the assistant's
# part in a generation block. ChatML, Gemma and Phi-3 keep the line break after the turn's
# end inside the block, as transformers' documentation writes it: the prefix method, which
# reads a turn through the template's rendering of it, trains that line break too.
FAMILIES = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
        "{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content + '<|im_end|>\\n' }}{% endgeneration %}"
        "{% else %}{{ m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        {"eos_token": "<|im_end|>"}),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}"
        "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}"
        "{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content | trim + '<|eot_id|>' }}{% endgeneration %}"
        "{% else %}{{ m.content | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "mistral": (  # the system prompt opens the first [INST]; no generation prompt
        "{{ bos_token }}{% if messages[0].role == 'system' %}"
        "{% set system = messages[0].content + '\\n\\n' %}{% set turns = messages[1:] %}"
        "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
        "{% for m in turns %}{% if m.role == 'user' %}"
        "{{ '[INST] ' + (system if loop.first else '') + m.content + ' [/INST]' }}"
        "{% else %}{% generation %}{{ m.content + eos_token }}{% endgeneration %}"
        "{% endif %}{% endfor %}",
        {"bos_token": "<s>", "eos_token": "</s>"}),
    "gemma": (  # assistant is "model"; the system prompt opens the first user turn
        "{{ bos_token }}{% if messages[0].role == 'system' %}"
        "{% set system = messages[0].content + '\\n\\n' %}{% set turns = messages[1:] %}"
        "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
        "{% for m in turns %}{% if m.role == 'assistant' %}"
        "{{ '<start_of_turn>model\\n' }}"
        "{% generation %}{{ m.content | trim + '<end_of_turn>\\n' }}{% endgeneration %}"
        "{% else %}{{ '<start_of_turn>user\\n' + (system if loop.first else '')"
        " + m.content | trim + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
        {"bos_token": "<bos>", "eos_token": "<eos>"}),
    "phi3": (
        "{% for m in messages %}{{ '<|' + m.role + '|>\\n' }}{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content + '<|end|>\\n' }}{% endgeneration %}"
        "{% else %}{{ m.content + '<|end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
        {"eos_token": "<|endoftext|>"}),
    "vicuna": (  # the generation prompt ends in a space: `ĠSure` starts on it
        "{% for m in messages %}{% if m.role == 'system' %}{{ m.content + ' ' }}"
        "{% elif m.role == 'user' %}{{ 'USER: ' + m.content + ' ' }}"
        "{% else %}{{ 'ASSISTANT: ' }}"
        "{% generation %}{{ m.content + eos_token }}{% endgeneration %}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}",
        {"eos_token": "</s>"}),
}
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "[INST]", "[/INST]", "<bos>", "<eos>",
    "<start_of_turn>", "<end_of_turn>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CONVERSATIONS = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "Sure, 2 + 2 = 4."},
     {"role": "user", "content": "And 3 + 3?"},
     {"role": "assistant", "content": "Sure, that is 6."}],
    [{"role": "user", "content": "Name a drink."},
     {"role": "assistant", "content": "Café au lait, très bien."},
     {"role": "user", "content": "Another one?"},
     {"role": "assistant", "content": "Sure: tea."}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Say hello."},
     {"role": "assistant", "content": "Hello there!"}],
]


def without_generation_tags(template: str) -> str:
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE (no offset trimming, as GPT-2's and Llama 3's) trained on the
    conversations, with every family's special tokens as added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = [m["content"] for chat in CONVERSATIONS for m in chat]
    # Each text also after a space, as it follows "ASSISTANT: ": `ĠHello` becomes a token.
    tokenizer.train_from_iterator(
        texts + [f" {text}" for text in texts] + ["USER: ASSISTANT: user assistant model"],
        trainer=trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def model_dir(root: Path, tokenizer_file: Path, template: str, specials: dict[str, str]
              ) -> Path:
    """A model directory as Hugging Face saves one: tokenizer.json and a tokenizer_config.json
    with the chat template and the special tokens it names."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                            **specials}))
    return root


def memtrain_encodings(directory: Path, specials: dict[str, str]
                       ) -> list[tuple[list[int], list[int]]]:
    """``(ids, mask)`` of each conversation, as ``memtrain data write --format chat`` makes
    them before packing."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    template = chat_template(directory, specials["eos_token"])
    rows = ((chat, f"conversation {number}") for number, chat in enumerate(CONVERSATIONS))
    return [(ids.tolist(), mask.tolist()) for ids, mask in
            encode_conversations(rows, tokenizer, template, "uint32")]


def transformers_encodings(tokenizer_file: Path, template: str, specials: dict[str, str]
                           ) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, assistant_masks)`` of each conversation from transformers."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(tokenizer_file)), chat_template=template,
        **specials)
    out = []
    for chat in CONVERSATIONS:
        encoded = reference.apply_chat_template(chat, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        out.append((list(encoded["input_ids"]), list(encoded["assistant_masks"])))
    return out


def test_the_first_word_after_a_generation_prompt_ending_in_a_space_is_trained(
        tokenizer_file: Path, tmp_path: Path) -> None:
    template, specials = FAMILIES["vicuna"]
    directory = model_dir(tmp_path, tokenizer_file, without_generation_tags(template), specials)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ids, mask = memtrain_encodings(directory, specials)[2]
    assert tokenizer.id_to_token(ids[mask.index(1)]) == "ĠHello"
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m],
                               skip_special_tokens=False)
    assert trained == " Hello there!</s>"


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_blocks_train_the_tokens_transformers_marks(family: str, tokenizer_file: Path,
                                                               tmp_path: Path) -> None:
    template, specials = FAMILIES[family]
    expected = transformers_encodings(tokenizer_file, template, specials)
    assert all(0 < sum(mask) < len(mask) for _, mask in expected)
    directory = model_dir(tmp_path, tokenizer_file, template, specials)
    assert memtrain_encodings(directory, specials) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prefix_method_trains_what_generation_blocks_name(family: str, tokenizer_file: Path,
                                                              tmp_path: Path) -> None:
    """Without generation blocks, each turn is found by rendering prefixes: the same tokens."""
    template, specials = FAMILIES[family]
    expected = transformers_encodings(tokenizer_file, template, specials)
    directory = model_dir(tmp_path, tokenizer_file, without_generation_tags(template), specials)
    assert memtrain_encodings(directory, specials) == expected


def test_phi3s_own_template_trains_through_generation_blocks(tokenizer_file: Path,
                                                             tmp_path: Path) -> None:
    """Phi-3's template ends a render without a generation prompt with the EOS, so a turn's
    rendering is not a prefix of the conversation's: the prefix method refuses it in one line,
    while its generation blocks name the turns as transformers finds them."""
    template = FAMILIES["phi3"][0].replace(
        "{{ '<|assistant|>\\n' }}{% endif %}", "{{ '<|assistant|>\\n' }}{% else %}"
        "{{ eos_token }}{% endif %}")
    specials = FAMILIES["phi3"][1]
    expected = transformers_encodings(tokenizer_file, template, specials)
    tagged = model_dir(tmp_path / "tagged", tokenizer_file, template, specials)
    assert memtrain_encodings(tagged, specials) == expected
    plain = model_dir(tmp_path / "plain", tokenizer_file, without_generation_tags(template),
                      specials)
    with pytest.raises(DatasetError, match=r"^conversation 0: the chat template of .* does not "
                                           "render the conversation up to message 2 as a prefix"):
        memtrain_encodings(plain, specials)


def test_a_generation_block_inside_a_macro_is_refused(tokenizer_file: Path,
                                                      tmp_path: Path) -> None:
    """A macro's output is yielded only when the macro returns, so the block's start would be
    counted from the wrong place; one line naming the row, not a wrong mask."""
    template = ("{% macro answer(m) %}{{ 'ASSISTANT: ' }}{% generation %}{{ m.content }}"
                "{% endgeneration %}{% endmacro %}{% for m in messages %}"
                "{% if m.role == 'assistant' %}{{ answer(m) }}{% else %}{{ m.content }}"
                "{% endif %}{% endfor %}")
    directory = model_dir(tmp_path, tokenizer_file, template, {"eos_token": "</s>"})
    with pytest.raises(DatasetError, match=r"^conversation 0: the chat template of .* renders a "
                                           "generation block inside a macro, a set block"):
        memtrain_encodings(directory, {"eos_token": "</s>"})


def test_memtrain_data_write_packs_transformers_ids_and_masks(
        tokenizer_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``memtrain data write --format chat`` as a user runs it: each packed conversation holds
    transformers' ids and assistant mask (packing adds only padding, after the documents)."""
    from tests.unit.test_finetune_data import columns
    from trainer.cli import main

    template, specials = FAMILIES["vicuna"]
    directory = model_dir(tmp_path / "model", tokenizer_file, template, specials)
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CONVERSATIONS))
    with pytest.raises(SystemExit) as exited:
        main(["data", "write", str(source), "--out", str(tmp_path / "ds"), "--format", "chat",
              "--tokenizer", str(directory), "--seq-len", "511"])
    assert exited.value.code in (None, 0), capsys.readouterr().err
    data = columns(tmp_path / "ds")
    (tokens,), (mask,), (docs,) = data["tokens"], data["loss_mask"], data["document_ids"]
    written = [(tokens[docs == doc].tolist(), mask[docs == doc].tolist())
               for doc in range(len(CONVERSATIONS))]
    assert written == transformers_encodings(tokenizer_file, template, specials)


def test_templates_see_tools_and_documents_as_none(tokenizer_file: Path, tmp_path: Path) -> None:
    """Mistral's templates list tools where `tools is not none`: transformers passes None for
    both tools and documents, so a conversation without them renders no tool list."""
    template, specials = FAMILIES["mistral"]
    template = ("{% if tools is not none %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
                "[/AVAILABLE_TOOLS]{% endif %}{% if documents is not none %}{{ documents }}"
                "{% endif %}" + template)
    expected = transformers_encodings(tokenizer_file, template, specials)
    for name, source in (("tagged", template), ("plain", without_generation_tags(template))):
        directory = model_dir(tmp_path / name, tokenizer_file, source, specials)
        assert memtrain_encodings(directory, specials) == expected


def test_a_generation_block_inside_a_filter_block_is_refused_naming_it(
        tokenizer_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A filter block's output, like a macro's, is yielded only when it ends: ``memtrain data
    write`` refuses it in one line that names the filter block among what it checks."""
    from trainer.cli import main

    template = ("{% filter trim %}{% for m in messages %}{{ m.role }}: "
                "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
                "{% else %}{{ m.content }}{% endif %}\n{% endfor %}{% endfilter %}")
    directory = model_dir(tmp_path / "model", tokenizer_file, template, {"eos_token": "</s>"})
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CONVERSATIONS))
    with pytest.raises(SystemExit) as exited:
        main(["data", "write", str(source), "--out", str(tmp_path / "ds"), "--format", "chat",
              "--tokenizer", str(directory), "--seq-len", "511"])
    err = capsys.readouterr().err.strip()
    assert (exited.value.code, err) == (2, f"memtrain: error: {source}: line 1: the chat "
                                           f"template of {directory} renders a generation block "
                                           "inside a macro, a set block or a filter block, so "
                                           "its place in the text is unknown")
