"""Token corpora from files: ``jsonl`` (documents tokenized with a local Hugging Face tokenizer) and ``tokens``
(a pre-tokenized 1-D ``.npy`` or raw ``.bin``), checked before anything is built.

``jsonl``: each line is a JSON object; its ``data.field`` is tokenized (no special tokens added)
and the documents are packed into one stream with the EOS id after each, so a window may span a
document boundary and sees the EOS there. With ``data.prompt_field`` each record's prompt is
tokenized on its own and put before its text, and a mask marks the tokens trained on: the
text and its EOS, not the prompt (:class:`~.data.TokenWindows` turns the rest's targets into -100).
With ``data.messages_field`` each record is a conversation, rendered with the tokenizer folder's
chat template and trained on its assistant turns alone (:mod:`.chat`).
``tokens``: ``np.load(mmap_mode="r")`` for ``.npy``, a ``np.memmap`` of ``data.dtype`` (uint16 or
uint32) for anything else; the file is never read whole.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np

from .config import TrainConfig, TrainConfigError

__all__ = ["Corpus", "check_corpus_file", "load_corpus", "load_tokenizer"]


class Corpus(NamedTuple):
    """A token corpus as :func:`load_corpus` gives it (and ``data``'s text and synthetic kinds alike)."""

    tokens: Any
    """The 1-D token stream (an int64 array; memory-mapped for ``tokens`` files; a tensor for text and synthetic)."""
    desc: str
    """One line saying what it is."""
    trained: np.ndarray | None
    """Which tokens are targets (with ``data.prompt_field`` or ``data.messages_field``); None: all."""
    starts: np.ndarray | None
    """Where each jsonl record starts in ``tokens``, and ``len(tokens)`` last; None for other kinds."""


_TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
#: EOS spellings looked for in a bare ``tokenizer.json`` (which has no notion of an EOS token).
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|end_of_text|>", "<|eos|>")


def _tokenizer_path(config: TrainConfig) -> Path:
    d = config.data
    if not d.tokenizer or not isinstance(d.tokenizer, str):
        raise TrainConfigError("data kind 'jsonl' needs 'tokenizer': a local tokenizer folder or a tokenizer.json file")
    path = config.data_path(d.tokenizer)
    if not path.exists():
        raise TrainConfigError(f"data.tokenizer {d.tokenizer!r}: no such folder or file (a local Hugging Face "
                               f"tokenizer folder or a tokenizer.json; nothing is downloaded)")
    return path


def check_corpus_file(config: TrainConfig, path: Path) -> None:
    """The cheap checks of a ``jsonl`` or ``tokens`` file (exists already): its shape, field, tokenizer, dtype.

    Raises:
        TrainConfigError: one line saying what is wrong.
    """
    d = config.data
    if d.kind == "tokens":
        if d.dtype not in _TOKEN_DTYPES:
            raise TrainConfigError(f"data.dtype {d.dtype!r} is not valid for a .bin token file; valid: {', '.join(_TOKEN_DTYPES)}")
        n = _token_count(path, d.dtype)
        if n < config.seq + 2:
            raise TrainConfigError(f"data.path {d.path!r} holds {n} tokens; a window of seq + 1 = {config.seq + 1} "
                                   f"tokens needs at least {config.seq + 2}: lower seq or use a longer file")
        return
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        record = json.loads(first)
    except json.JSONDecodeError as exc:
        raise TrainConfigError(f"data.path {d.path!r}: line 1 is not JSON ({exc.msg}); jsonl holds one object per line") from None
    fields = (((d.messages_field, "data.messages_field"),) if d.messages_field is not None
              else ((d.field, "data.field"), (d.prompt_field, "data.prompt_field")))
    for key, name in fields:
        if key is not None and (not isinstance(record, dict) or key not in record):
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise TrainConfigError(f"data.path {d.path!r}: line 1 has no field {key!r} (it has {keys}); set {name}")
    if d.eos_id is not None and (not isinstance(d.eos_id, int) or isinstance(d.eos_id, bool) or d.eos_id < 0):
        raise TrainConfigError(f"data.eos_id must be a non-negative token id, got {d.eos_id!r}")
    tokenizer = _tokenizer_path(config)
    if d.messages_field is not None:
        from .chat import check_conversation, load_chat_tokenizer

        check_conversation(record[d.messages_field], f"data.path {d.path!r}: line 1")
        load_chat_tokenizer(tokenizer, d.tokenizer)


def _token_count(path: Path, dtype: str) -> int:
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except ValueError as exc:
            raise TrainConfigError(f"data.path {str(path)!r}: not a readable .npy file ({exc})") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise TrainConfigError(f"data.path {str(path)!r} holds a {arr.dtype} array of shape {arr.shape}; "
                                   f"a token file is 1-D integers")
        return int(arr.shape[0])
    size, width = path.stat().st_size, np.dtype(_TOKEN_DTYPES[dtype]).itemsize
    if size % width:
        raise TrainConfigError(f"data.path {str(path)!r} is {size} bytes, not a whole number of {dtype} tokens; "
                               f"check data.dtype")
    return size // width


def load_tokenizer(path: Path) -> tuple[Any, int | None, int]:
    """``(encode, eos_id, vocab_size)`` for a tokenizer folder or a ``tokenizer.json``; ``encode(texts) -> list of id lists``."""
    if path.is_dir():
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TrainConfigError(f"data.tokenizer {str(path)!r}: cannot load a tokenizer there "
                                   f"({' '.join(str(exc).split())[:150]})") from None
        return (lambda texts: tok(texts, add_special_tokens=False)["input_ids"]), tok.eos_token_id, len(tok)
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception for bad files
        raise TrainConfigError(f"data.tokenizer {str(path)!r}: not a readable tokenizer.json "
                               f"({' '.join(str(exc).split())[:150]})") from None
    eos = next((tok.token_to_id(name) for name in _EOS_NAMES if tok.token_to_id(name) is not None), None)
    return (lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]), eos, tok.get_vocab_size()


def _records(config: TrainConfig, path: Path, keys: list[str]) -> Iterator[tuple[str, list[Any]]]:
    """Each non-blank line of a jsonl file: where it is (for messages) and its values of ``keys``.

    Raises:
        TrainConfigError: a line that is not a JSON object holding every key.
    """
    shown = config.data.path
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                values = [record[k] for k in keys]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise TrainConfigError(f"data.path {shown!r}: line {n} is not a JSON object with "
                                       f"{' and '.join(repr(k) for k in keys)}") from None
            yield f"data.path {shown!r}: line {n}", values


def _eos_id(config: TrainConfig, found: int | None, between: str) -> int:
    """``data.eos_id``, else the tokenizer's EOS (``found``), put between ``between``.

    Raises:
        TrainConfigError: neither names one.
    """
    d = config.data
    eos = d.eos_id if d.eos_id is not None else found
    if eos is None:
        raise TrainConfigError(f"data.tokenizer {d.tokenizer!r} names no EOS token to put between {between}; "
                               f"set data.eos_id")
    return eos


def _chat_tokens(config: TrainConfig, path: Path) -> tuple[np.ndarray, str, np.ndarray, list[int]]:
    from .chat import check_conversation, conversation_tokens, load_chat_tokenizer

    d = config.data
    tok = load_chat_tokenizer(_tokenizer_path(config), d.tokenizer)
    eos = _eos_id(config, tok.eos_token_id, "conversations")
    conversations, wheres = [], []
    for where, (messages,) in _records(config, path, [d.messages_field]):
        conversations.append(check_conversation(messages, where))
        wheres.append(where)
    ids, trained = conversation_tokens(tok, conversations, eos, wheres)
    stream = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    mask = np.concatenate(trained) if trained else np.zeros(0, dtype=bool)
    return stream, (f"jsonl {d.path} ({len(ids):,} conversations, {stream.size:,} tokens, tokenizer {d.tokenizer}'s "
                    f"chat template; loss on the {int(mask.sum()):,} assistant tokens)"), mask, [x.size for x in ids]


def _jsonl_tokens(config: TrainConfig, path: Path) -> tuple[np.ndarray, str, np.ndarray | None, list[int]]:
    """The stream, its description, which tokens are targets (None: all), each record's length."""
    d = config.data
    if d.messages_field is not None:
        return _chat_tokens(config, path)
    encode, found, _ = load_tokenizer(_tokenizer_path(config))
    eos = _eos_id(config, found, "documents")
    wanted = [k for k in (d.prompt_field, d.field) if k is not None]
    texts, prompts = [], []
    for _, values in _records(config, path, wanted):
        texts.append(str(values[-1]))
        if d.prompt_field is not None:
            prompts.append(str(values[0]))
    heads = encode(prompts) if prompts else [[] for _ in texts]
    pieces, trained, lengths = [], [], []
    for head, ids in zip(heads, encode(texts)):
        pieces += [np.asarray(head, dtype=np.int64), np.asarray(ids, dtype=np.int64), np.asarray([eos], dtype=np.int64)]
        trained += [np.zeros(len(head), dtype=bool), np.ones(len(ids) + 1, dtype=bool)]
        lengths.append(len(head) + len(ids) + 1)
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    desc = f"jsonl {d.path} ({len(texts):,} documents, {stream.size:,} tokens, tokenizer {d.tokenizer})"
    if d.prompt_field is None:
        return stream, desc, None, lengths
    mask = np.concatenate(trained) if trained else np.zeros(0, dtype=bool)
    return (stream, desc[:-1] + f"; loss on {int(mask.sum()):,} {d.field!r} tokens, not the {d.prompt_field!r} ones)",
            mask, lengths)


def load_corpus(config: TrainConfig) -> Corpus:
    """The 1-D token stream of a ``jsonl`` or ``tokens`` config (memory-mapped for ``tokens``), its description,
    which tokens are trained on (with ``data.prompt_field`` or ``data.messages_field``; else None: all) and
    where each jsonl record starts (:class:`Corpus`).

    Raises:
        TrainConfigError: token ids the model's vocab cannot hold, or too few tokens for one window.
    """
    d, path = config.data, config.data_path()
    trained = starts = None
    if d.kind == "jsonl":
        corpus, desc, trained, lengths = _jsonl_tokens(config, path)
        starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    else:
        _token_count(path, d.dtype)  # re-checked: the file may have changed since validation
        corpus = (np.load(path, mmap_mode="r") if path.suffix == ".npy"
                  else np.memmap(path, dtype=_TOKEN_DTYPES[d.dtype], mode="r"))
        desc = f"tokens {d.path} ({corpus.shape[0]:,} tokens)"
    if corpus.shape[0] < config.seq + 2:
        raise TrainConfigError(f"data.path {d.path!r} gives {corpus.shape[0]} tokens; a window of seq + 1 = "
                               f"{config.seq + 1} tokens needs at least {config.seq + 2}: lower seq or add data")
    vocab = config.vocab()
    top = int(corpus.max())
    if vocab is not None and top >= vocab:
        raise TrainConfigError(f"data.path {d.path!r} holds token id {top} but the model's vocab is {vocab}; "
                               f"raise model.vocab to at least {top + 1} or use a matching tokenizer")
    if int(corpus.min()) < 0:
        raise TrainConfigError(f"data.path {d.path!r} holds negative token ids")
    return Corpus(corpus, desc, trained, starts)
