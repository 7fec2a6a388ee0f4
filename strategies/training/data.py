"""Where batches come from: byte-level text files or a seeded synthetic Markov chain, drawn as random windows.

``text`` reads a local file as bytes (token = byte, so the model's vocab must be at least 256);
a relative path is looked up next to the config file first, then in the working directory.
``synthetic`` is a seeded Markov chain over the model's vocabulary in which every token has
``branching`` possible successors, so the loss falls from about ln(vocab) towards
ln(branching) as the model learns the table. Either way each step draws ``batch`` random
windows of ``seq + 1`` tokens (inputs, then targets shifted by one) from one seeded generator,
whose state is saved in checkpoints: a resumed run sees the batches the uninterrupted run
would have seen.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig

__all__ = ["TokenWindows", "markov_corpus", "make_data"]

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
        corpus: 1-D integer tensor of token ids (uint8 for byte-level text keeps a file at one byte per token).
        batch, seq: windows per batch and tokens per input row.
        seed: the generator's seed; :meth:`state_dict` / :meth:`load_state_dict` carry its position.
    """

    def __init__(self, corpus: torch.Tensor, batch: int, seq: int, seed: int) -> None:
        if corpus.dim() != 1 or corpus.numel() < seq + 2:
            raise ValueError(f"the corpus needs at least seq + 2 = {seq + 2} tokens in one dimension, got shape {tuple(corpus.shape)}")
        self.corpus, self.batch, self.seq = corpus, batch, seq
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each (batch, seq) int64 on the host; targets are inputs shifted by one."""
        starts = torch.randint(0, self.corpus.numel() - self.seq, (self.batch,), generator=self.generator)
        windows = self.corpus[starts[:, None] + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        """The generator's position."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position :meth:`state_dict` gave."""
        self.generator.set_state(state["generator"])


def make_data(config: TrainConfig) -> tuple[TokenWindows, str]:
    """The batch source and a one-line description of it."""
    if config.data.kind == "text":
        path = config.data_path()
        corpus = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        try:  # the short form in messages when the file is under the working directory
            shown = path.resolve().relative_to(Path.cwd())
        except ValueError:
            shown = path
        return TokenWindows(corpus, config.batch, config.seq, config.seed), f"text {shown} ({corpus.numel():,} bytes)"
    vocab = config.vocab()
    assert vocab is not None  # validate() checked
    corpus = markov_corpus(vocab, config.data.branching, _SYNTHETIC_TOKENS, config.seed)
    floor = math.log(config.data.branching)
    return (TokenWindows(corpus, config.batch, config.seq, config.seed + 1),
            f"synthetic Markov chain, vocab {vocab}, {config.data.branching} successors per token (loss floor ~{floor:.2f})")
