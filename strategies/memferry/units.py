"""Split a model into units: one per repeated block, plus one for everything else.

A unit is what MemFerry moves and updates as one piece: its parameters share one flat host
buffer per kind (working copy, master, Adam moments, gradient) and one flat device buffer, so
a unit crosses the host link in one copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

__all__ = ["Unit", "find_blocks", "split_units"]


@dataclass
class Unit:
    """A group of parameters moved and updated together.

    Attributes:
        index: position in :func:`split_units` order (blocks first, in forward order).
        name: the block's qualified name (``"blocks.3"``) or ``"rest"``.
        module: the block module whose calls mark the unit's use; None for ``rest``, which is
            used at several places (embeddings before the blocks, head after) and so stays on
            the device.
        params: ``(qualified name, parameter)`` pairs, each parameter once, ordered
            ``[trainable with weight decay..., trainable without..., frozen...]`` so the
            optimizer's buffers (master, moments, gradient) cover a prefix of the flat unit.
        n_trainable: how many of ``params`` train (None: all).
        n_decay: how many of those get weight decay (None: all trainable).
    """

    index: int
    name: str
    module: nn.Module | None
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    n_trainable: int | None = None
    n_decay: int | None = None

    @property
    def numel(self) -> int:
        """Elements over all parameters."""
        return sum(p.numel() for _, p in self.params)

    @property
    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters the optimizer updates (a prefix of ``params``)."""
        return self.params if self.n_trainable is None else self.params[: self.n_trainable]

    @property
    def train_numel(self) -> int:
        """Elements of the trainable parameters (the optimizer state's length)."""
        return sum(p.numel() for _, p in self.trainable)

    @property
    def decay_numel(self) -> int:
        """Elements of the trainable parameters with weight decay (a prefix of the trainable ones)."""
        decay = self.trainable if self.n_decay is None else self.trainable[: self.n_decay]
        return sum(p.numel() for _, p in decay)

    @property
    def is_block(self) -> bool:
        """Whether the unit is a repeated block (not ``rest``)."""
        return self.module is not None


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: the largest ``ModuleList`` whose children share one class.

    Raises:
        ValueError: the model has no such list; pass ``blocks=`` to say which modules repeat.
    """
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    if best is None:
        raise ValueError(
            f"found no repeated blocks in {type(model).__name__}: MemFerry looks for an nn.ModuleList of at least "
            f"two modules of one class; pass blocks=model.<your list> to name them"
        )
    return best


def _order(unit: Unit, no_decay: set[str]) -> Unit:
    """Reorder ``unit.params`` as ``[decay..., no_decay..., frozen...]`` and count the groups."""
    decay = [(n, p) for n, p in unit.params if p.requires_grad and n not in no_decay]
    plain = [(n, p) for n, p in unit.params if p.requires_grad and n in no_decay]
    frozen = [(n, p) for n, p in unit.params if not p.requires_grad]
    unit.params = decay + plain + frozen
    unit.n_trainable, unit.n_decay = len(decay) + len(plain), len(decay)
    return unit


def split_units(model: nn.Module, blocks: nn.ModuleList | None = None, no_decay: set[str] | None = None) -> list[Unit]:
    """Units for each block (in list order) and a final ``rest`` unit with all other parameters.

    Frozen parameters (``requires_grad=False``) belong to units too (moved with them, never
    updated); names in ``no_decay`` train without weight decay (see :class:`Unit` for the order).

    A parameter reachable from more than one unit (a weight tied between two blocks, or between
    a block and the embeddings or head) goes to ``rest``, which stays on the device: a block's
    unit is offloaded after its use, and another unit's use of the same tensor must not find it
    gone. Each parameter appears once, under the first name that reaches it.
    """
    if blocks is None:
        prefix, blocks = find_blocks(model)
    else:
        prefix = next((n for n, m in model.named_modules() if m is blocks), None)
        if prefix is None:
            raise ValueError("blocks= must be a module inside the model")
    names = [f"{prefix}.{i}" if prefix else str(i) for i in range(len(blocks))]
    owners: dict[int, set[int | str]] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            owners.setdefault(id(p), set()).add(i)
    # By module identity, not by name: a model may also reach its block list under a second name.
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    for module in model.modules():
        if id(module) not in in_blocks:
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), set()).add("rest")
    seen: set[int] = set()
    units = []
    for i, block in enumerate(blocks):
        unit = Unit(i, names[i], block)
        for name, p in block.named_parameters(prefix=unit.name):
            if id(p) not in seen and owners[id(p)] == {i}:
                seen.add(id(p))
                unit.params.append((name, p))
        units.append(_order(unit, no_decay or set()))
    rest = Unit(len(units), "rest", None)
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            rest.params.append((name, p))
    units.append(_order(rest, no_decay or set()))
    dtypes = {p.dtype for u in units for _, p in u.params}
    if len(dtypes) > 1:
        raise ValueError(f"all parameters (trainable and frozen) must share one dtype, found {sorted(map(str, dtypes))}; "
                         f"cast the model first, or give compute_dtype=")
    return units
