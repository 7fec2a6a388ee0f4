"""Where batches come from: byte-level text files or a seeded synthetic Markov chain, drawn as random windows.

``text`` reads a local file as bytes (token = byte, so the model's vocab must be at least 256);
a relative path is looked up next to the config file first, then in the working directory.
``synthetic`` is a seeded Markov chain over the model's vocabulary in which every token has
``branching`` possible successors, so the loss falls from about ln(vocab) towards
ln(branching) as the model learns the table. Either way each step draws ``batch`` random
windows of ``seq + 1`` tokens (inputs, then targets shifted by one) from one seeded generator,
whose state is saved in checkpoints: a resumed run sees the batches the uninterrupted run
would have seen. ``jsonl`` and ``tokens`` corpora come from :mod:`.corpora`.

With ``data.packing: false`` (jsonl) a row is one whole record instead (:class:`RecordRows`):
no row mixes records, so a completion or an assistant turn is always trained with all of what
came before it in its own record.

``data.eval_fraction`` holds out the corpus's last share: training windows lie wholly before it,
and :func:`make_datasets` draws ``eval_batches`` fixed windows (seeded) inside it. ``train(data=...)``
takes any iterable of batches instead (:class:`IterableBatches`).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from .config import TrainConfig, TrainConfigError
from .corpora import Corpus, load_corpus

__all__ = ["TokenWindows", "RecordRows", "IterableBatches", "markov_corpus", "make_data", "make_datasets"]

#: Tokens of the synthetic corpus: enough that a 32k vocabulary's table is visited ~30 times per token.
_SYNTHETIC_TOKENS = 1 << 20


def markov_corpus(vocab: int, branching: int, length: int, seed: int) -> torch.Tensor:
    """``length`` tokens of a seeded Markov chain where each token has ``branching`` possible successors.

    Generated as 256 independent chains side by side (a loop over positions, vectorised over
    chains) and concatenated; the rare window that spans two chains is noise the model shrugs off.
    """
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, branching), generator=g)
    chains = 256
    per_chain = -(-length // chains)
    state = torch.randint(0, vocab, (chains,), generator=g)
    out = torch.empty(chains, per_chain, dtype=torch.long)
    for t in range(per_chain):
        out[:, t] = state
        state = successors[state, torch.randint(0, branching, (chains,), generator=g)]
    return out.reshape(-1)[:length]


class TokenWindows:
    """Batches of random windows of ``seq + 1`` tokens from a 1-D corpus, drawn with one seeded generator.

    Args:
        corpus: 1-D integer tensor of token ids (uint8 for byte-level text keeps a file at one byte per token),
            or a 1-D numpy array (a memory-mapped token file: only the drawn windows are read).
        batch, seq: windows per batch and tokens per input row.
        seed: the generator's seed; :meth:`state_dict` / :meth:`load_state_dict` carry its position.
        trained: which tokens are targets (a bool array as long as ``corpus``); a target whose
            token is not becomes -100, which the loss ignores. None: every token.
    """

    def __init__(self, corpus: torch.Tensor | np.ndarray, batch: int, seq: int, seed: int,
                 trained: np.ndarray | None = None) -> None:
        if corpus.ndim != 1 or corpus.shape[0] < seq + 2:
            raise ValueError(f"the corpus needs at least seq + 2 = {seq + 2} tokens in one dimension, got shape {tuple(corpus.shape)}")
        if trained is not None and trained.shape != corpus.shape:
            raise ValueError(f"trained mask of shape {trained.shape} for a corpus of shape {tuple(corpus.shape)}")
        self.corpus, self.batch, self.seq, self.trained = corpus, batch, seq, trained
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each (batch, seq) int64 on the host; targets are inputs shifted by one."""
        starts = torch.randint(0, int(self.corpus.shape[0]) - self.seq, (self.batch,), generator=self.generator)
        index = starts[:, None] + self._offsets
        if isinstance(self.corpus, np.ndarray):  # numpy indexing reads just these windows of a memmap
            windows = torch.from_numpy(np.asarray(self.corpus[index.numpy()], dtype=np.int64))
        else:
            windows = self.corpus[index].long()
        targets = windows[:, 1:]
        if self.trained is not None:
            keep = torch.from_numpy(np.asarray(self.trained[index[:, 1:].numpy()]))
            targets = targets.masked_fill(~keep, -100)  # cross_entropy's (and HF's) ignore_index
        return windows[:, :-1], targets

    def state_dict(self) -> dict[str, Any]:
        """The generator's position."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position :meth:`state_dict` gave."""
        self.generator.set_state(state["generator"])


class RecordRows:
    """Batches of whole records, one per row, in epochs: every record once in a seeded random
    order, then a new order (as a shuffling sampler gives them).

    A row is a record's first ``seq + 1`` tokens (a longer record is cut there), right-padded
    with ``pad_id`` to the batch's longest row rounded up to a multiple of 8 (at most ``seq``),
    as a padding collator does; with ``fixed_width``, to ``seq`` always (a pipeline's stages
    exchange fixed shapes). Padded positions are never targets (-100), and under causal
    attention no real position sees them, so no attention mask is needed.

    Args:
        corpus: the 1-D token stream the records lie in, one after another.
        starts: where each record starts in ``corpus``, and its length last (``n + 1`` entries).
        batch, seq, seed: as :class:`TokenWindows`.
        trained: which tokens are targets, as :class:`TokenWindows`; None: every token of a record.
        pad_id: the input id of padded positions (any id the model's vocab holds).
        fixed_width: pad every batch to ``seq`` (else to its longest row).
        group_by_length: sort each epoch's order by record length (longest first) within groups of
            ``GROUP_BATCHES`` batches, so a batch's rows are of like length and carry little padding.
    """

    #: Padded widths are multiples of this (kernels' tiles), so few distinct shapes occur.
    WIDTH_STEP = 8
    #: Batches per group sorted by length under ``group_by_length`` (HF Trainer's mega-batches).
    GROUP_BATCHES = 50

    def __init__(self, corpus: np.ndarray, starts: np.ndarray, batch: int, seq: int, seed: int,
                 trained: np.ndarray | None = None, pad_id: int = 0, fixed_width: bool = False,
                 group_by_length: bool = False) -> None:
        if len(starts) < 2:
            raise ValueError("RecordRows needs at least one record")
        self.corpus, self.starts, self.batch, self.seq, self.trained = corpus, starts, batch, seq, trained
        self.pad_id, self.fixed_width, self.group_by_length = pad_id, fixed_width, group_by_length
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.zeros(0, dtype=torch.long)  # this epoch's record order; drawn when first needed
        self.cursor = 0  # records of it already given

    def _picks(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.batch:
            if self.cursor == len(self.order):
                self.order, self.cursor = self._epoch_order(), 0
            take = self.order[self.cursor:self.cursor + self.batch - len(out)].tolist()
            out += take
            self.cursor += len(take)
        return out

    def _epoch_order(self) -> torch.Tensor:
        order = torch.randperm(len(self.starts) - 1, generator=self.generator)
        if not self.group_by_length:
            return order
        lengths = torch.from_numpy(np.diff(np.asarray(self.starts, dtype=np.int64)))
        group = self.batch * self.GROUP_BATCHES
        parts = [chunk[torch.argsort(lengths[chunk], descending=True, stable=True)] for chunk in order.split(group)]
        return torch.cat(parts)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each (batch, width) int64 on the host (width: see the class);
        -100 where no token is trained on."""
        spans = [(int(self.starts[i]), min(int(self.starts[i + 1]), int(self.starts[i]) + self.seq + 1))
                 for i in self._picks()]
        width = self.seq
        if not self.fixed_width:
            longest = max(max(hi - lo - 1 for lo, hi in spans), 1)
            width = min(self.seq, -(-longest // self.WIDTH_STEP) * self.WIDTH_STEP)
        inputs = torch.full((self.batch, width), self.pad_id, dtype=torch.long)
        targets = torch.full((self.batch, width), -100, dtype=torch.long)
        for row, (lo, hi) in enumerate(spans):
            ids = torch.from_numpy(np.asarray(self.corpus[lo:hi], dtype=np.int64))
            n = ids.numel() - 1
            if n < 1:
                continue  # a one-token record predicts nothing
            inputs[row, :n] = ids[:-1]
            wanted = ids[1:]
            if self.trained is not None:
                wanted = wanted.masked_fill(~torch.from_numpy(np.asarray(self.trained[lo + 1:hi])), -100)
            targets[row, :n] = wanted
        return inputs, targets

    def state_dict(self) -> dict[str, Any]:
        """The generator's position, this epoch's order and how far into it the rows are."""
        return {"generator": self.generator.get_state(), "order": self.order.clone(), "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position :meth:`state_dict` gave."""
        self.generator.set_state(state["generator"])
        self.order, self.cursor = state["order"].clone(), int(state["cursor"])


class IterableBatches:
    """Batches from any iterable of ``(inputs, targets)`` or dicts with ``input_ids`` (and ``labels``).

    A dict without ``labels`` is a row of tokens: inputs are all but its last token, targets all
    but its first. Its position cannot be saved (:meth:`state_dict` is empty): a resumed run
    starts the iterable from its beginning.
    """

    def __init__(self, batches: Iterable[Any]) -> None:
        self.iterator = iter(batches)
        self.drawn = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(inputs, targets)`` as int64 tensors.

        Raises:
            ValueError: the iterable ran out, or an item is neither a pair nor a dict with ``input_ids``.
        """
        try:
            item = next(self.iterator)
        except StopIteration:
            raise ValueError(f"the data iterable ran out after {self.drawn} batches; give one that yields at "
                             f"least steps x accumulation_steps batches (or cycles)") from None
        self.drawn += 1
        if isinstance(item, dict):
            if "input_ids" not in item:
                raise ValueError(f"data batch {self.drawn} is a dict without 'input_ids' (keys {sorted(item)})")
            ids = torch.as_tensor(item["input_ids"])
            if "labels" in item:
                return ids.long(), torch.as_tensor(item["labels"]).long()
            return ids[..., :-1].long(), ids[..., 1:].long()
        if isinstance(item, (tuple, list)) and len(item) == 2:
            return torch.as_tensor(item[0]).long(), torch.as_tensor(item[1]).long()
        raise ValueError(f"data batch {self.drawn} is a {type(item).__name__}; yield (inputs, targets) or "
                         f"{{'input_ids': ..., 'labels': ...}}")

    def state_dict(self) -> dict[str, Any]:
        """Nothing: an iterable's position cannot be saved."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No-op (see the class docstring)."""


def _corpus(config: TrainConfig) -> Corpus:
    """The whole 1-D token stream, its description, which tokens are targets (None: all), and
    where each jsonl record starts (None for other kinds)."""
    if config.data.kind == "text":
        path = config.data_path()
        corpus = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        try:  # the short form in messages when the file is under the working directory
            shown = path.resolve().relative_to(Path.cwd())
        except ValueError:
            shown = path
        return Corpus(corpus, f"text {shown} ({corpus.numel():,} bytes)", None, None)
    if config.data.kind in ("jsonl", "tokens"):
        return load_corpus(config)
    vocab = config.vocab()
    assert vocab is not None  # validate() checked
    corpus = markov_corpus(vocab, config.data.branching, _SYNTHETIC_TOKENS, config.seed)
    floor = math.log(config.data.branching)
    return Corpus(corpus, (f"synthetic Markov chain, vocab {vocab}, {config.data.branching} successors per token "
                           f"(loss floor ~{floor:.2f})"), None, None)


def _record_rows(config: TrainConfig, corpus: np.ndarray, starts: np.ndarray, trained: np.ndarray | None,
                 desc: str, fixed_width: bool) -> tuple[RecordRows, list[tuple[torch.Tensor, torch.Tensor]], str]:
    """:func:`make_datasets` with ``data.packing: false``: whole records, the last share held out."""
    records = len(starts) - 1
    cut = int(np.count_nonzero(np.diff(starts) > config.seq + 1))
    pad = int(corpus[starts[1] - 1])  # every jsonl record ends with the EOS: a padding id the vocab holds
    desc += (f"; one record per row, {cut:,} of {records:,} longer than seq + 1 = {config.seq + 1} tokens and cut"
             if cut else "; one record per row (packing off)")
    frac = config.data.eval_fraction
    rows = config.steps * config.accumulation_steps * config.batch

    def over(part: np.ndarray, seed: int) -> RecordRows:  # the training rows and the eval rows differ in these only
        return RecordRows(corpus, part, config.batch, config.seq, seed, trained, pad, fixed_width,
                          config.data.group_by_length)

    if not frac:
        desc += f"; {rows / records:.3g} epochs in {config.steps:,} steps"
        return over(starts, config.seed), [], desc
    first_held = int(np.searchsorted(starts[:-1], int(starts[-1]) - int(starts[-1] * frac)))
    if first_held < 1 or first_held >= records:
        raise TrainConfigError(f"data.eval_fraction {frac} leaves {first_held:,} of {records:,} records for training "
                               f"and {records - first_held:,} held out; each needs one: change eval_fraction")
    evals = over(starts[first_held:], config.seed + 2)
    eval_batches = [evals.next() for _ in range(config.eval_batches)]  # drawn once: the same rows every time
    desc += (f"; last {records - first_held:,} records held out for eval; {rows / first_held:.3g} epochs over the "
             f"other {first_held:,} in {config.steps:,} steps")
    return over(starts[:first_held + 1], config.seed), eval_batches, desc


def make_datasets(config: TrainConfig, fixed_width: bool = False
                  ) -> tuple[TokenWindows | RecordRows, list[tuple[torch.Tensor, torch.Tensor]], str]:
    """The training batch source, the fixed held-out eval batches (empty without ``data.eval_fraction``), a description.
    ``fixed_width``: every batch ``seq`` tokens wide, also with ``data.packing: false`` (whose
    batches are otherwise as wide as their longest record: :class:`RecordRows`).

    Raises:
        TrainConfigError: the training or held-out part is shorter than one window (or, with
            ``data.packing: false``, holds no record).
    """
    corpus, desc, trained, starts = _corpus(config)
    if not config.data.packing:
        return _record_rows(config, corpus, starts, trained, desc, fixed_width)
    n = int(corpus.shape[0])
    held = int(n * config.data.eval_fraction)
    # synthetic keeps its historical window seed (seed + 1): the same config draws the same batches as before
    seed = config.seed + 1 if config.data.kind == "synthetic" else config.seed
    if not held:
        return TokenWindows(corpus, config.batch, config.seq, seed, trained), [], desc
    if held < config.seq + 2 or n - held < config.seq + 2:
        raise TrainConfigError(f"data.eval_fraction {config.data.eval_fraction} splits {n:,} tokens into {n - held:,} "
                               f"for training and {held:,} held out; each needs one window of seq + 2 = "
                               f"{config.seq + 2}: change eval_fraction or seq")
    train_part, eval_part = corpus[: n - held], corpus[n - held:]
    mask_train, mask_eval = (None, None) if trained is None else (trained[: n - held], trained[n - held:])
    evals = TokenWindows(eval_part, config.batch, config.seq, config.seed + 2, mask_eval)
    eval_batches = [evals.next() for _ in range(config.eval_batches)]  # drawn once: the same windows every time
    desc += f"; last {held:,} tokens held out for eval"
    return TokenWindows(train_part, config.batch, config.seq, seed, mask_train), eval_batches, desc


def make_data(config: TrainConfig, fixed_width: bool = False) -> tuple[TokenWindows | RecordRows, str]:
    """The training batch source and a one-line description of it (``fixed_width``: as :func:`make_datasets`)."""
    windows, _, desc = make_datasets(config, fixed_width)
    return windows, desc
