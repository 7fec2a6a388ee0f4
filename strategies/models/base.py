"""What every model shares: initialisation in each leaf's own ``reset_parameters``, RMSNorm, and
:class:`CausalLM` (blocks, optional per-block recomputation, the fp32 loss over token slices).

Weights are initialised inside each leaf module's own ``reset_parameters`` (normal, std 0.02;
biases zero), never by a pass over the finished model: under ``deepspeed.zero.Init`` a leaf's
parameters are partitioned as soon as its ``__init__`` returns, so a later pass would see
empty tensors and every ZeRO-3 row would start from a different model than the others.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .sliced_loss import sliced_loss_sum, summed_slices

__all__ = ["CausalLM", "RMSNorm", "Linear", "Embedding", "INIT_STD", "token_mean_loss"]

INIT_STD = 0.02
IGNORE = -100  # cross_entropy's ignore_index: a target the loss leaves out (a prompt token, padding)


def token_mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32, the mean over the targets that count (not -100).

    ``cross_entropy``'s own mean, except that a batch with no counted target gives 0 and zero
    gradients rather than NaN (a window of prompt tokens only, under ``data.prompt_field``).
    """
    t = targets.reshape(-1)
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), t, ignore_index=IGNORE, reduction="sum")
    return total / (t != IGNORE).sum().clamp(min=1)


class Linear(nn.Linear):
    """``nn.Linear`` whose own init is N(0, 0.02) with zero bias (see the module docstring for why here)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` initialised N(0, 0.02) in its own ``__init__``."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (statistics in fp32, output in the input dtype)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


class CausalLM(nn.Module):
    """Base of the benchmark models: blocks, optional per-block recomputation, fp32 loss."""

    blocks: nn.ModuleList

    def __init__(self) -> None:
        super().__init__()
        #: Recompute each block in backward instead of keeping its activations.
        self.recompute = False
        #: Compute the loss over this many slices of the tokens, each slice's logits
        #: recomputed in backward instead of kept: the fp32 logits, their log-softmax and
        #: gradient (3 x 1 GB at batch 8 x 1024, vocab 32000) then exist one slice at a time.
        #: Same loss up to summation order. 1: off (logits computed whole, as the anchors).
        self.loss_chunks = 1
        #: With ``loss_chunks`` above 1 in training: each slice's gradients made in forward, so
        #: the head runs once per slice instead of again in backward (:mod:`.sliced_loss`;
        #: bit-equal when the loss's gradient scale is 1/N with N a power of two). False:
        #: recompute each slice in backward (needed to backward twice through one forward).
        self.loss_grad_in_forward = True

    def _run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.recompute and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for token ids ``idx`` (batch, seq)."""
        return self.head(self.features(idx))

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        """The final normalised hidden states (batch, seq, hidden), which ``head`` maps to logits."""
        raise NotImplementedError

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits if ``targets`` is None, else the mean cross-entropy computed in fp32
        (over :attr:`loss_chunks` slices when that is above 1)."""
        if targets is None:
            return self.logits(idx)
        if self.loss_chunks > 1:
            return self._chunked_loss(self.features(idx), targets)
        return token_mean_loss(self.logits(idx), targets)

    def _slice_loss_sum(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(h).float(), t, reduction="sum")

    def _chunked_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        count = (t != IGNORE).sum().clamp(min=1)  # mean over counted targets, as token_mean_loss
        if not (self.training and torch.is_grad_enabled()):
            return summed_slices(self._slice_loss_sum, h, t, self.loss_chunks) / count
        if self.loss_grad_in_forward:
            return sliced_loss_sum(self._slice_loss_sum, self.head, h, t, self.loss_chunks, count) / count
        return summed_slices(lambda hc, tc: checkpoint(self._slice_loss_sum, hc, tc, use_reentrant=False),
                             h, t, self.loss_chunks) / count

