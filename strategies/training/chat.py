"""Conversations as training tokens: each jsonl record's list of ``{"role", "content"}`` messages
rendered with the tokenizer's own chat template, and a mask that trains on the assistant's turns only.

Which tokens are the assistant's is read off the template itself, with no markers it must carry:
a conversation rendered up to before an assistant turn, with the generation prompt, and rendered
through that turn, bound the turn's characters (its content and the end-of-turn text the template
puts after it, which teaches the model to stop). The whole conversation is tokenized once, and a
token is trained on where its first character lies in such a span. This asks one thing of the
template: that a conversation's rendering begins with the rendering of each of its beginnings.
Templates that rewrite earlier turns once later ones follow (some drop an earlier assistant
turn's reasoning) do not, and are refused with the line that showed it, rather than trained on
tokens guessed.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from .config import TrainConfigError

__all__ = ["load_chat_tokenizer", "check_conversation", "conversation_tokens"]


@functools.lru_cache(maxsize=2)
def _loaded(path: str, stamp: int) -> Any:
    """The folder's tokenizer, loaded once per folder and contents (``stamp``: its newest file's
    time): the config checks and the data both ask for it, and a large vocabulary takes seconds."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_chat_tokenizer(path: Path, name: str) -> Any:
    """The fast Hugging Face tokenizer in the folder ``path`` (``name``: as the config spells it,
    for messages), which must have a chat template.

    Raises:
        TrainConfigError: not a folder, no loadable fast tokenizer there, or no chat template.
    """
    if not path.is_dir():
        raise TrainConfigError(f"data.tokenizer {name!r} is a file; data.messages_field needs a tokenizer folder "
                               f"(save_pretrained's) whose chat template renders the conversations")
    try:
        tok = _loaded(str(path.resolve()), max((f.stat().st_mtime_ns for f in path.iterdir()), default=0))
    except (OSError, ValueError) as exc:
        raise TrainConfigError(f"data.tokenizer {name!r}: cannot load a tokenizer there "
                               f"({' '.join(str(exc).split())[:150]})") from None
    if not getattr(tok, "chat_template", None):
        raise TrainConfigError(f"data.tokenizer {name!r} has no chat template; put one in the folder "
                               f"(chat_template.jinja, or tokenizer.chat_template before save_pretrained)")
    if not getattr(tok, "is_fast", False):
        raise TrainConfigError(f"data.tokenizer {name!r} is a slow (Python) tokenizer; data.messages_field needs a "
                               f"fast one (a tokenizer.json in the folder) to map tokens to characters")
    return tok


def check_conversation(messages: Any, where: str) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role": str, "content": str}`` with at least one assistant turn.

    Raises:
        TrainConfigError: ``where`` (e.g. ``"data.path 'x.jsonl': line 3"``) and what is wrong.
    """
    if not isinstance(messages, list) or not messages:
        raise TrainConfigError(f"{where}: the conversation is a {type(messages).__name__}, not a non-empty list of "
                               f"{{'role': ..., 'content': ...}} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TrainConfigError(f"{where}: message {i} is not {{'role': str, 'content': str}} (got {str(m)[:60]})")
    if not any(m["role"] == "assistant" for m in messages):
        raise TrainConfigError(f"{where}: no 'assistant' message, so nothing to train on; give each conversation "
                               f"at least one assistant turn")
    return messages


def _render(tok: Any, messages: list[dict[str, str]], where: str, generation_prompt: bool = False) -> str:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja's TemplateError (a template's raise_exception), or a template bug
        raise TrainConfigError(f"{where}: the tokenizer's chat template refused the conversation's first "
                               f"{len(messages)} messages ({' '.join(str(exc).split())[:150]})") from None


def _opening(tok: Any, through: str, where: str) -> str:
    """What comes before the assistant's words in ``through``, a conversation's rendering that opens
    with them (transformers renders no empty conversation): up to the end of the generation prompt,
    read off a one-message conversation with and without it; nothing where it is not found."""
    probe = [{"role": "user", "content": "?"}]
    plain, prompted = _render(tok, probe, where), _render(tok, probe, where, generation_prompt=True)
    prompt = prompted[len(plain):] if prompted.startswith(plain) else ""
    at = through.find(prompt) if prompt else -1
    return through[: at + len(prompt)] if at >= 0 else ""


def _assistant_spans(tok: Any, messages: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    text = _render(tok, messages, where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        through = _render(tok, messages[: i + 1], where)
        before = _render(tok, messages[:i], where, generation_prompt=True) if i else _opening(tok, through, where)
        if not (through.startswith(before) and text.startswith(through)):
            raise TrainConfigError(f"{where}: the tokenizer's chat template renders the conversation up to message {i} "
                                   f"differently once later messages follow, so its assistant turns cannot be told "
                                   f"apart; use a template whose rendering of a conversation begins with that of each "
                                   f"of its beginnings")
        spans.append((len(before), len(through)))
    return text, spans


def conversation_tokens(tok: Any, conversations: list[list[dict[str, str]]], eos: int,
                        wheres: list[str]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each conversation's token ids (the EOS after it, where its rendering does not end with one)
    and which of them are trained on (the assistant turns' tokens; never the EOS put between
    conversations). ``wheres``: each conversation's place, for messages.

    Raises:
        TrainConfigError: a template whose renderings are not prefixes of each other (see the module).
    """
    rendered = [_assistant_spans(tok, c, w) for c, w in zip(conversations, wheres)]
    encoded = tok([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    ids_out, masks = [], []
    for (_, spans), ids, offsets in zip(rendered, encoded["input_ids"], encoded["offset_mapping"]):
        starts = np.asarray([s for s, _ in offsets], dtype=np.int64)
        trained = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            trained |= (starts >= lo) & (starts < hi)
        ids = np.asarray(ids, dtype=np.int64)
        if not ids.size or ids[-1] != eos:
            ids, trained = np.append(ids, eos), np.append(trained, False)
        ids_out.append(ids)
        masks.append(trained)
    return ids_out, masks
