"""Chat and instruction rows as token ids with a mask of the assistant's tokens.

- **Chat** rows hold a ``messages`` list: ``{"role": "system"|"user"|"assistant", "content":
  str}`` each. **Instruction** rows hold a prompt and a response (``--prompt-field``,
  ``--response-field``), taken as a user's message and the assistant's answer.
- **Template.** A conversation is rendered with the tokenizer's chat template (the
  ``chat_template`` of the model directory's ``tokenizer_config.json``, a Jinja template, run
  sandboxed as transformers runs it), else with ``PLAIN_TEMPLATE``::

      <|user|>
      What is 2 + 2?
      <|assistant|>
      4<eos>

  (each message a role line and its content, turns separated by a line break, and each
  assistant turn ending with the end-of-text token). The rendered text is encoded as it is:
  the template's special tokens (``<|im_start|>``, the BOS) are the tokenizer's added tokens.
- **Only assistant turns are trained.** A template with ``{% generation %}`` ...
  ``{% endgeneration %}`` blocks (what TRL's assistant-only loss needs) names the assistant's
  text itself: the blocks' rendered characters, placed as transformers places them. Otherwise
  each assistant turn's text is found by rendering the conversation up to the turn (with the
  generation prompt) and through it: the characters in between are the answer.
  A template that does not render a conversation's turns as prefixes of it is refused in one
  line naming the row, since its answers cannot be found.
- **A token is trained where it overlaps an answer**, by the encoding's offsets: the token
  that begins on the space a generation prompt ends with (byte-level BPE's ``ĠSure``) is the
  answer's first word. This is transformers' ``return_assistant_tokens_mask`` rule.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from datapipe.manifest import DatasetError
from datapipe.tokenize import SPECIAL_TOKENS, special_token, tokenizer_config

if TYPE_CHECKING:
    from tokenizers import Tokenizer

PLAIN_TEMPLATE = (  # line breaks as expressions: trim_blocks drops one after a block tag
    "{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<|' + message.role + '|>\\n' + message.content }}"
    "{% if message.role == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n<|assistant|>\\n' }}{% endif %}")
ROLES = ("system", "user", "assistant", "tool")
GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")  # as transformers finds one


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with; a render that
    fails raises jinja2's ``TemplateError`` (``assistant_spans`` names the row)."""

    source: str  # "the chat template of DIR" or "memtrain's plain template"
    render: Callable[..., str]
    jinja: str  # the template itself: the dataset's manifest keeps it, and export passes it on
    # Where the template has generation blocks: the text and each block's (start, rendered
    # text), from the same keywords as ``render``.
    blocks: Callable[..., tuple[str, list[tuple[int, str]]]] | None = None

    def text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return self.render(messages=messages, add_generation_prompt=add_generation_prompt)


def chat_template(model_dir: Path | None, eos_token: str) -> ChatTemplate:
    """The model directory's chat template (``tokenizer_config.json``'s ``chat_template``, or a
    ``chat_template.jinja`` beside it), else ``PLAIN_TEMPLATE``; compiled in jinja2's sandbox."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError as err:
        raise DatasetError("--format chat needs the `jinja2` package (pip install jinja2)") \
            from err
    config, source, text = _find_template(model_dir)
    env, tracker = _environment()
    try:
        template = env.from_string(text)
    except TemplateError as err:
        raise DatasetError(f"{source}: not a Jinja template ({err})") from err
    specials = {name: special_token(config, name) or "" for name in SPECIAL_TOKENS}
    specials["eos_token"] = specials["eos_token"] or eos_token
    # transformers passes tools and documents to every render, None where there are none:
    # templates test `tools is not none` (Mistral's), which an undefined name passes.
    context = specials | {"tools": None, "documents": None}

    def render(**kwargs: Any) -> str:
        return template.render(**context, **kwargs)

    def blocks(**kwargs: Any) -> tuple[str, list[tuple[int, str]]]:
        return tracker.track(template, **context, **kwargs)

    return ChatTemplate(source, render, text,
                        blocks=blocks if GENERATION_TAG.search(text) else None)


def _find_template(model_dir: Path | None) -> tuple[dict[str, Any], str, str]:
    """The tokenizer config, and the chat template's source and text."""
    config: dict[str, Any] = {}
    source, text = "memtrain's plain template", PLAIN_TEMPLATE
    if model_dir is not None and model_dir.is_dir():
        config = tokenizer_config(model_dir)
        found = config.get("chat_template")
        if isinstance(found, list):  # named templates: the default one
            found = next((t.get("template") for t in found if t.get("name") == "default"), None)
        jinja = model_dir / "chat_template.jinja"
        if not found and jinja.is_file():
            found = jinja.read_text()
        if isinstance(found, str) and found:
            source, text = f"the chat template of {model_dir}", found
    return config, source, text


def _environment() -> tuple[Any, Any]:
    """The environment transformers renders chat templates in (the same loop controls and
    generation blocks, globals, and a tojson that does not escape HTML; Llama 3.1's template
    calls strftime_now: its rows then carry the day they were written), and its extension
    for generation blocks."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    blocks = _generation_blocks()
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[blocks, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env, env.extensions[blocks.identifier]


def _generation_blocks() -> Any:
    """jinja2's extension for ``{% generation %}`` ... ``{% endgeneration %}``, as
    transformers' ``AssistantTracker``: a block renders its body, and in a ``track``ed render
    records the body and its start, the length of the text the template has yielded so far."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            self.tracked: ContextVar[tuple[list[str], list[tuple[int, str]]] | None] = \
                ContextVar("generation_blocks", default=None)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

        def _block(self, caller: Callable[[], str]) -> str:
            body = caller()
            tracked = self.tracked.get()
            if tracked is not None:
                rendered, blocks = tracked
                blocks.append((sum(map(len, rendered)), body))
            return body

        def track(self, template: Any, **kwargs: Any) -> tuple[str, list[tuple[int, str]]]:
            rendered: list[str] = []
            blocks: list[tuple[int, str]] = []
            reset = self.tracked.set((rendered, blocks))
            try:
                for piece in template.generate(**kwargs):  # pieces one by one: see _block
                    rendered.append(piece)
            finally:
                self.tracked.reset(reset)
            return "".join(rendered), blocks

    return GenerationBlocks


def check_messages(messages: object, where: str) -> list[dict[str, Any]]:
    """A row's ``messages``: a list of ``{"role", "content"}`` with known roles and string
    contents, and at least one assistant turn; DatasetError naming the row otherwise."""
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: messages is not a list of messages")
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES or \
                not isinstance(message.get("content"), str):
            raise DatasetError(f"{where}: message {number} is not {{\"role\": one of "
                               f"{', '.join(ROLES)}, \"content\": a string}}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetError(f"{where}: no assistant message (nothing to train on)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def assistant_spans(template: ChatTemplate, messages: list[dict[str, Any]], where: str
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans of its assistant turns: the template's
    generation blocks where it has them, else each turn found by rendering prefixes.
    DatasetError naming the row (``where``) where the template fails or refuses the
    conversation (its ``raise_exception``)."""
    from jinja2.exceptions import TemplateError

    try:
        if template.blocks is not None:
            return _generation_spans(template, messages, where)
        return _prefix_spans(template, messages, where)
    except TemplateError as err:
        raise DatasetError(f"{where}: {template.source}: {err}") from err


def _prefix_spans(template: ChatTemplate, messages: list[dict[str, Any]], where: str
                  ) -> tuple[str, list[tuple[int, int]]]:
    text = template.text(messages)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.text(messages[:turn], add_generation_prompt=True)
        through = template.text(messages[:turn + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise DatasetError(f"{where}: {template.source} does not render the conversation "
                               f"up to message {turn} as a prefix of it, so its assistant "
                               "turns cannot be found")
        spans.append((len(before), len(through)))
    return text, spans


def _generation_spans(template: ChatTemplate, messages: list[dict[str, Any]], where: str
                      ) -> tuple[str, list[tuple[int, int]]]:
    assert template.blocks is not None
    text, blocks = template.blocks(messages=messages, add_generation_prompt=False)
    for start, body in blocks:
        # A block inside a macro, a set block or a filter block is not yielded where it is
        # rendered: its start is wrong (transformers then marks other tokens without a word).
        if text[start:start + len(body)] != body:
            raise DatasetError(f"{where}: {template.source} renders a generation block inside "
                               "a macro, a set block or a filter block, so its place in the "
                               "text is unknown")
    return text, [(start, start + len(body)) for start, body in blocks]


def encode_conversations(rows: Iterator[tuple[object, str]], tokenizer: Tokenizer,
                         template: ChatTemplate, dtype: str, batch: int = 256
                         ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(ids, loss_mask)`` of each conversation: ``rows`` are ``(messages, where)``; a token
    is trained where its characters overlap an assistant turn's."""
    pending: list[tuple[str, list[tuple[int, int]]]] = []

    def flush() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        # encode_batch (not _fast): the offsets are needed; it still spreads over every core
        encodings = tokenizer.encode_batch([text for text, _ in pending],
                                           add_special_tokens=False)
        for (_, spans), encoding in zip(pending, encodings, strict=True):
            offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            starts, ends = offsets[:, 0], offsets[:, 1]
            mask = np.zeros(len(starts), dtype=np.uint8)
            for first, last in spans:
                # Overlap, not "starts inside": byte-level BPE's `ĠSure` begins on the space a
                # generation prompt ends with. For ordered offsets this is the token set
                # transformers' single pass marks.
                mask |= ((starts < last) & (ends > first)).astype(np.uint8)
            yield np.asarray(encoding.ids, dtype=dtype), mask
        pending.clear()

    for messages, where in rows:
        pending.append(assistant_spans(template, check_messages(messages, where), where))
        if len(pending) >= batch:
            yield from flush()
    if pending:
        yield from flush()
