"""Profile one training step on the real backend, for MemFerry's cost model and scheduler.

The model's weights need not fit on the device: blocks are profiled one at a time (a copy of
the block on the device, fed a representative input: the real input of block 0, captured
by running only the part of the model before the blocks, on the host), and the ``rest``
unit (embeddings, head, loss) is profiled with the blocks replaced by pass-throughs. Blocks
with the same class and parameter shapes are measured once and the figures reused.

What is measured, per block: forward, backward and recomputation time (backend timing events,
median of ``repeats`` after a warm-up; see "How passes are timed"), activation bytes kept for
backward (saved-tensor hooks, counting each storage once and leaving parameters out; with
recompute only the block's inputs stay; with selective recompute the inputs and the matmuls'
and attention's outputs, and forward's and backward's times under it), parameter count and
bytes. For ``rest``:
forward + loss and backward time and the peak memory the loss takes (logits in fp32 and
their gradient), from ``backend.memory_stats``. And the AdamW rates, seconds per parameter, of
the same kernels the host and device optimizers run, with their dtype conversions
(``adamw_rates.py``).

How passes are timed (alone, or issued ahead as autograd issues them in a step), and why the
first distinct block is timed twice: ``pass_timing.py``. On the H200 the §3 block's forward took
1.49-2.14 ms alone and 1.33 ms (±0.3 %) issued ahead, its backward 3.15-3.26 and 2.90; pricing
recomputation at the alone figure over-priced an 8-micro-batch step of 24 recomputed blocks by
about 50 ms (bench/results/2026-12-03-h200-session20/).
"""
from __future__ import annotations

import copy
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from xpu import Backend

from ..selective_recompute import kept_output_bytes, selective_checkpoint
from .adamw_rates import device_adamw_rate, host_adamw_rate, host_adamw_rates
from .backward_memory import backward_extra, recomputed_backward_extra
from .compiled_blocks import compile_forward
from .config import OFFLOAD_MIN_BYTES
from .cost import loss_peak_estimate
from .hf_models import head_shape, model_loss
from .host_budget import update_bytes
from .pass_timing import lesser_times, timed, timed_passes
from .sequence_scaling import (block_on_device, capture_block_input, half_sequence_bytes, padded, sample_shape,
                               saved_bytes)
from .units import Unit

__all__ = ["BlockProfile", "StepProfile", "profile_step", "host_adamw_rate", "host_adamw_rates", "device_adamw_rate"]  # rates: adamw_rates.py


@dataclass
class BlockProfile:
    """Measured figures of one block.

    Attributes:
        numel: trainable parameters (what has gradients and optimizer state).
        param_bytes: bytes of all its compute-dtype weights, frozen ones included (what a load
            moves and a resident block holds).
        fwd_s: forward time on the device, timed alone (as the training thread issues it).
        bwd_s: backward time on the device (without recompute), issued ahead as autograd runs it.
        recompute_s: forward time issued ahead, as recomputation runs inside backward; 0 in
            profiles written before it was measured (then ``fwd_s``: :attr:`recompute_time`).
        act_bytes: activation bytes kept from forward to backward without recompute.
        act_bytes_recompute: bytes kept with recompute (the block's inputs).
        act_bytes_offload_kept: bytes activation offload leaves on the device (saved tensors
            below :data:`~.config.OFFLOAD_MIN_BYTES`); 0 in profiles written before it was measured.
        act_bytes_selective: bytes kept with selective recompute (the inputs and the outputs of
            the matmuls and attention kernels, :mod:`strategies.selective_recompute`); 0 where
            not measured (older profiles), which leaves selective recompute out of the plans.
        bwd_selective_s: backward time with selective recompute (the recomputed ops included;
            never below ``bwd_s``).
        fwd_selective_s: forward time under selective recompute (its dispatch mode sees every
            op, which costs time in eager mode; never below ``fwd_s``); 0 in profiles written
            before it was measured (then ``fwd_s``).
        act_bytes_half_seq: ``act_bytes`` with the rows cut to half their length, which tells the
            part growing with the sequence's square (``sequence_scaling.py``); 0: not measured.
        bwd_extra_bytes: the most device memory the block's backward holds beyond its saved
            activations: its output's gradient, intermediate gradients and its weights'
            gradients, less the saved tensors it has freed by then; 0: not measured (then its
            weights' gradients alone).
        bwd_recompute_bytes: the same for the block's backward with full recompute, over what
            it holds then (its input): the rebuilt activations, freed as backward goes, and what
            ``bwd_extra_bytes`` counts; 0: not measured (then ``act_bytes`` plus that).
        bwd_selective_bytes: the same with selective recompute, over the bytes it keeps.
    """

    numel: int
    param_bytes: int
    fwd_s: float
    bwd_s: float
    act_bytes: int
    act_bytes_recompute: int
    act_bytes_offload_kept: int = 0
    act_bytes_selective: int = 0
    bwd_selective_s: float = 0.0
    fwd_selective_s: float = 0.0
    recompute_s: float = 0.0
    act_bytes_half_seq: int = 0
    bwd_extra_bytes: int = 0
    bwd_recompute_bytes: int = 0
    bwd_selective_bytes: int = 0

    @property
    def recompute_time(self) -> float:
        """Seconds a recomputation of the block's forward adds to its backward."""
        return self.recompute_s or self.fwd_s


@dataclass
class StepProfile:
    """One step's figures; serialises to JSON (:meth:`to_json`, :meth:`from_json`).

    Attributes:
        blocks: one :class:`BlockProfile` per block, in forward order.
        rest_numel: trainable parameters of the ``rest`` unit.
        rest_param_bytes: bytes of all its compute-dtype weights, frozen ones included.
        rest_fwd_s: its forward time, loss included (timed alone).
        rest_bwd_s: its backward time (issued ahead).
        loss_peak_bytes: device memory the rest's forward and backward add at their peak
            (measured with the model's ``loss_chunks`` as it was; estimated by
            :func:`~.cost.loss_peak_estimate` where the blocks cannot be passed through).
        input_bytes: bytes of the step's inputs and targets on the device.
        dtype_bytes: bytes per element of the compute dtype.
        tokens: rows of the blocks' matmuls (batch x sequence), for the DHA penalty.
        host_adamw_s_per_param: host AdamW seconds per parameter (conversions included), with
            no copies beside it where ``host_adamw_bytes_per_param`` is set; in profiles
            written before that field, the rate under 35 % copy duty, which the cost model
            then takes as the in-step rate.
        device_adamw_s_per_param: device AdamW seconds per parameter (gradient upcast and
            weight write-back included).
        backend: backend name; device: what was measured.
        notes: how figures were obtained, where not plainly measured.
        vocab, hidden: the output head's shape (0: no head found).
        loss_chunks: the token slices the loss was profiled with (``model.loss_chunks``; 1: whole logits).
        accumulation_steps: micro-batches per optimizer step of the run being planned (a
            setting, not a measurement: ``plan_for`` sets it). Above 1, the fp32 gradient
            buffer of every device-homed unit lives from the step's first micro-batch to its
            update (``cost.grads_persist``): 4 bytes per parameter held through every forward
            and backward, which a profile of one micro-batch never sees.
        clipping: whether the run clips gradients by their global norm (a setting, set by
            ``plan_for``). The ``DeviceOptimizer`` then holds every device-homed unit's
            gradient from its backward to ``step()`` (the coefficient needs all of them), which
            a profile without clipping never sees (``memory_terms.held_grad_bytes``).
        data_parallel: whether the run is data parallel (a setting, set by ``plan_for``):
            clipped device-homed gradients are then held as the fp32 sums the ranks average.
        host_adamw_copies_s_per_param: the same update while host->device and device->host
            copies run back to back beside it (0: not measured: virtual devices or no
            asynchronous copies).
        host_copies_GBps: what those copies moved meanwhile, both directions (0: none).
        host_adamw_bytes_per_param: host-memory bytes the measured update moves per parameter
            (``host_budget.update_bytes``: 28 in bf16 and in fp32); 0 in profiles written
            before host memory was modelled.
        clip_mode: a setting (``plan_for`` sets it): ``AdamW.clip_mode``, which matters with
            ``clipping``: speculative clipping's backups and the gradient-norm read are
            host-memory bytes too (``host_budget``).
        host_order: a setting (``plan_for`` sets it): ``AdamW.host_order``, the order of host
            updates the cost model prices (``"landing"`` under data parallelism).
        host_update_scale, host_earlier_scale: the rehearsal's calibration
            (``host_calibration.calibrated``): what the host's work once a step's last gradient
            has landed, and its sums of the step's earlier micro-batches, took in real steps over
            what the cost model priced them at (1: not calibrated).
        earlier_send_s: the rehearsal's calibration too: the issuing thread's seconds per send
            of a block's gradients home in a micro-batch before a step's last (0: not measured).
            The cost model puts it in series with that block's backward where the block sums on
            the host: on the H200 host-summing plans ran over their predictions by 7/8 of the
            thread's send time, the sends of those micro-batches (bench/results/2026-12-04-h200-session24/).
        host_gap_s: the rehearsal's calibration too (``host_calibration.with_gap``): seconds a
            step bound by the host (its work and waits, or its memory's bandwidth) ran beyond
            its host work in the rehearsal, over what the cost model priced for that (0: not
            measured, or priced in full). The cost model adds it to both host terms of the step.
        clip_fire_rate: a setting (``plan_for`` sets it): ``AdamW.clip_fire_rate``, the share of
            steps expected to clip, which the scheduler weighs plans by (``clip_plan.py``).
        flat_sends: a setting (``plan_for`` sets it): ``AdamW.flat_sends``, a host-homed unit's
            gradients gathered into one more device buffer for their copy home (the block's
            backward transient holds them twice).
        split_update: a setting (``plan_for`` sets it): ``AdamW.split_update``, host updates under
            accumulation in two passes, the second priced with the earlier micro-batches' sums
            (``host_budget.update_bytes``).
        seq: the sample's sequence length (its rows: ``tokens / seq``); 0: not known, then a
            profile is scaled to other batches by tokens alone (``batch_growth.scaled_profile``).
        padded: the sample carried padding (an ``attention_mask`` with zeros), so the masked
            forward is what was measured (``batch_growth.watch_unplanned_padding``).
        host_adamw_numel: the length of the flat buffers the host rates were measured on (0: not
            recorded); the rehearsal times the kernel alone on buffers as long
            (``host_calibration.alone_slowdown``).
        compiled_blocks: the blocks were timed and measured through ``torch.compile``
            (``compiled_blocks.py``), as an engine with ``compile_blocks`` runs them.
        eager_blocks: with ``compiled_blocks``, each block's figures run eagerly too, which a block
            that stays eager (read over the link, or offloading) is priced at; else empty.
        compute_scale: the rehearsal's calibration of the device's compute
            (``compute_calibration.scaled``): the times above are the profiled ones times this
            (1: as profiled).
    """

    blocks: list[BlockProfile]
    rest_numel: int
    rest_param_bytes: int
    rest_fwd_s: float
    rest_bwd_s: float
    loss_peak_bytes: int
    input_bytes: int
    dtype_bytes: int
    tokens: int
    host_adamw_s_per_param: float
    device_adamw_s_per_param: float
    backend: str = ""
    device: str = ""
    notes: list[str] = field(default_factory=list)
    vocab: int = 0
    hidden: int = 0
    loss_chunks: int = 1
    accumulation_steps: int = 1
    clipping: bool = False
    host_adamw_copies_s_per_param: float = 0.0
    host_copies_GBps: float = 0.0
    host_adamw_bytes_per_param: int = 0
    clip_mode: str = "speculative"
    data_parallel: bool = False
    host_order: str = "landing"
    host_update_scale: float = 1.0
    host_earlier_scale: float = 1.0
    earlier_send_s: float = 0.0
    host_gap_s: float = 0.0
    clip_fire_rate: float = 0.0
    flat_sends: bool = False
    split_update: bool = False
    seq: int = 0
    padded: bool = False
    host_adamw_numel: int = 0
    compiled_blocks: bool = False
    eager_blocks: list[BlockProfile] = field(default_factory=list)
    compute_scale: float = 1.0

    def to_json(self, indent: int | None = 1) -> str:
        """The profile as a JSON string (``indent=None``: on one line)."""
        return json.dumps(asdict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "StepProfile":
        """A profile from :meth:`to_json` output."""
        data = json.loads(text)
        for key in ("blocks", "eager_blocks"):
            data[key] = [BlockProfile(**b) for b in data.get(key, [])]
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path``."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "StepProfile":
        """Read a profile written by :meth:`save`."""
        return cls.from_json(Path(path).read_text())


class _PassThrough(nn.Module):
    """Stands in for a block when profiling ``rest``: returns its first input in the structure of
    the block's output ``template`` (Falcon's and Bloom's models read ``block(...)[0]``)."""

    def __init__(self, template: Any = None) -> None:
        super().__init__()
        leaves, self._spec = torch.utils._pytree.tree_flatten(template)
        self._first = next((i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)), None)
        self._leaves = [None if i == self._first else t for i, t in enumerate(leaves)]

    def __deepcopy__(self, memo: dict) -> "_PassThrough":
        return self  # nothing to copy (no parameters), and a TreeSpec warns when copied

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Return ``x`` unchanged, in the block's output structure."""
        if self._first is None:
            return x
        leaves = self._leaves[:self._first] + [x] + self._leaves[self._first + 1:]
        return torch.utils._pytree.tree_unflatten(leaves, self._spec)


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return torch.utils._pytree.tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, obj)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _block_signature(block: nn.Module) -> tuple:
    return (type(block).__name__, tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()))


def _profile_block(block: nn.Module, args: tuple, kwargs: dict, backend: Backend, device: int,
                   repeats: int, compiled: bool = False) -> tuple[BlockProfile, Any]:
    """Figures of one block on the device (``compiled``: run through ``torch.compile``, compiled
    in the warm-up of the first figure), and its output (the next block's input)."""
    numel = sum(p.numel() for p in block.parameters() if p.requires_grad)
    # Every weight, frozen ones too (a LoRA base): a load moves them all and a resident block holds them.
    param_bytes = sum(_nbytes(p) for p in block.parameters())
    blk, x_args, x_kwargs = block_on_device(block, args, kwargs, backend, device)
    if compiled:  # the copy's own (blocks are profiled before the executor compiles them)
        compile_forward(blk)

    def run_forward() -> Any:
        return blk(*x_args, **x_kwargs)

    # Activation bytes: every tensor autograd saves, each storage once, parameters left out;
    # and what activation offload would leave on the device (the swapper's rule).
    act_bytes, small_bytes, out = saved_bytes(blk, run_forward, OFFLOAD_MIN_BYTES)
    out_tensors = [t for t in _tensors(out) if t.requires_grad]
    if not out_tensors:
        raise ValueError(f"block {type(block).__name__} returned no tensor that needs a gradient")
    bwd_extra, grads = backward_extra(backend, device, out_tensors)
    bwd_recompute = recomputed_backward_extra(backend, device, blk, lambda: checkpoint(run_forward, use_reentrant=False))
    bwd_selective = recomputed_backward_extra(backend, device, blk, lambda: selective_checkpoint(run_forward))
    fwd_s, bwd_s, recompute_s = timed_passes(backend, device, blk, run_forward, grads, repeats)
    recompute_bytes = sum(_nbytes(t) for t in _tensors((x_args, x_kwargs)))
    selective_bytes = recompute_bytes + kept_output_bytes(run_forward)
    # a selectively checkpointed forward, and its backward with the recompute in it
    fwd_sel, bwd_sel, _ = timed_passes(backend, device, blk, lambda: selective_checkpoint(run_forward), grads,
                                       repeats)
    result = BlockProfile(numel, param_bytes, fwd_s, bwd_s, act_bytes, recompute_bytes, small_bytes,
                          selective_bytes, max(bwd_s, bwd_sel), max(fwd_s, fwd_sel), recompute_s,
                          bwd_extra_bytes=bwd_extra, bwd_recompute_bytes=bwd_recompute,
                          bwd_selective_bytes=bwd_selective)
    with torch.no_grad():
        nxt = _map_tensors(out, lambda t: t.detach())
    return result, nxt


def _profile_rest(model: nn.Module, blocks: nn.ModuleList, rest: Unit, inputs: Any, targets: Any,
                  loss_fn: Callable | None, backend: Backend, device: int, repeats: int,
                  block_output: Any = None) -> tuple[float, float, int, list[str]]:
    """Forward + loss and backward time of everything but the blocks (pass-throughs returning
    ``block_output``'s structure), and the loss's peak bytes."""
    originals = list(blocks)
    try:
        for i in range(len(blocks)):
            blocks[i] = _PassThrough(block_output)
        shell = copy.deepcopy(model)  # without the blocks: small
    finally:
        for i, blk in enumerate(originals):
            blocks[i] = blk
    shell = shell.to(backend.device(device))
    x = _map_tensors(inputs, lambda t: backend.to_device(t, device))
    y = _map_tensors(targets, lambda t: backend.to_device(t, device)) if targets is not None else None

    def loss_of() -> torch.Tensor:
        if loss_fn is not None:
            return loss_fn(shell(x), y)
        return model_loss(shell, x, y) if y is not None else shell(x)

    fwd, bwd, peak = [], [], 0
    host_b = 0.0
    for i in range(repeats + 1):
        for p in shell.parameters():
            p.grad = None
        backend.synchronize(device)
        base = backend.memory_stats(device).allocated
        backend.reset_peak_memory(device)
        holder: list[torch.Tensor] = []
        f, _ = timed(backend, device, lambda: holder.append(loss_of()))
        # A shell with nothing to train (LoRA: embedding and tied head frozen) has no backward.
        b, host_b = timed(backend, device, lambda: holder[0].backward() if holder[0].requires_grad else None,
                          host_b if i else None)
        peak = max(peak, backend.memory_stats(device).peak_allocated - base)
        if i:
            fwd.append(f)
            bwd.append(b)
    notes = ["rest: blocks replaced by pass-throughs; loss peak from backend.memory_stats"]
    return statistics.median(fwd), statistics.median(bwd), peak, notes


def profile_step(model: nn.Module, units: list[Unit], backend: Backend, device: int | None, inputs: Any,
                 targets: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 blocks: nn.ModuleList | None = None, repeats: int = 3, adamw_numel: int | None = None,
                 reuse_identical: bool = True, host_kernel: str = "auto",
                 compile_blocks: bool = False) -> StepProfile:
    """Measure one step of ``model`` on ``backend`` (see the module docstring).

    Args:
        model: the model on the host (it is not changed; blocks are copied to the device one
            at a time).
        units: from :func:`~strategies.memferry.units.split_units` (blocks, then ``rest``).
        backend: the backend to measure on; device: its device index (None: current).
        inputs, targets: one representative batch (host tensors).
        loss_fn: as ``MemFerry``'s; None when ``model(inputs, targets)`` returns the loss.
        blocks: the block list if ``units`` were split with an explicit one.
        repeats: timed repeats per figure (median), after one warm-up.
        adamw_numel: size of the flat buffer the AdamW rates are measured on.
            Default: the largest unit's size, within 1 M..64 M elements. A buffer that fits in
            the CPU's cache measures a rate training never sees: on the H200 machine a 4 M-element
            buffer predicted 0.17 s for work that took about 0.29 s inside real steps.
        reuse_identical: measure each distinct block (class and parameter shapes) once.
        host_kernel: the host AdamW kernel training will use (``AdamW.host_kernel``); its
            rate is measured alone and beside host<->device copies in both directions at
            full rate (:func:`host_adamw_rates`): the cost model prices a plan's own copies
            from the two (``host_budget``).
        compile_blocks: time and measure each block as ``torch.compile`` runs it
            (``compiled_blocks.py``; its activations at half the sequence are measured eagerly),
            and each distinct block eagerly as well (``StepProfile.eager_blocks``).

    Raises:
        ValueError: the model never reaches its first block, or a block's output has no
            gradient path.
    """
    index = backend.index_of(device)
    block_units = [u for u in units if u.is_block]
    rest = units[-1]
    if blocks is None:
        from .units import find_blocks

        blocks = find_blocks(model)[1]
    dtype = block_units[0].params[0][1].dtype
    notes: list[str] = []
    args, kwargs = capture_block_input(model, block_units[0].module, inputs, targets, loss_fn)
    tokens = max((t.numel() // t.shape[-1] for t in _tensors(args) if t.dim() >= 2), default=1)
    vocab, hidden = head_shape(model)
    chunks = int(getattr(model, "loss_chunks", 1) or 1)
    profiles: list[BlockProfile] = []
    eager: list[BlockProfile] = []  # with compile_blocks: the same blocks run eagerly
    cache: dict[tuple, tuple[BlockProfile, BlockProfile | None]] = {}
    pass_through_ok = True
    first_input = (args, kwargs)
    sigs = [_block_signature(u.module) for u in block_units]
    with backend.device_scope(index):
        for u, sig in zip(block_units, sigs):
            if reuse_identical and sig in cache:
                profiles.append(copy.copy(cache[sig][0]))
                eager += [copy.copy(cache[sig][1])] if compile_blocks else []
                continue
            as_eager = _profile_block(u.module, args, kwargs, backend, index, repeats)[0] if compile_blocks else None
            prof, out = _profile_block(u.module, args, kwargs, backend, index, repeats, compile_blocks)
            first_in = _tensors(args)[0]
            out_t = _tensors(out)
            pass_through_ok &= bool(out_t) and out_t[0].shape == first_in.shape
            if out_t and out_t[0].shape == first_in.shape:
                args = (_map_tensors(out_t[0], lambda t: t.to("cpu")),) + tuple(args[1:])
            cache[sig] = (prof, as_eager)
            profiles.append(prof)
            eager += [as_eager] if as_eager else []
        if pass_through_ok:
            rest_fwd, rest_bwd, loss_peak, rest_notes = _profile_rest(model, blocks, rest, inputs, targets, loss_fn,
                                                                      backend, index, repeats, out)
            notes += rest_notes
        else:  # a block changes the hidden shape: no pass-through; scale from the blocks by parameters
            per_param = sum(p.fwd_s for p in profiles) / max(1, sum(p.numel for p in profiles))
            rest_fwd = rest.numel * per_param
            rest_bwd = 2 * rest_fwd
            loss_peak = loss_peak_estimate(int(tokens), vocab, hidden, chunks, dtype.itemsize) if vocab else 0
            notes.append("rest: blocks change the hidden shape; rest times scaled from blocks by parameter count, "
                         + ("loss peak estimated from the head's shape" if vocab else "loss peak unknown (0)"))
        if block_units and not backend.caps.virtual_devices:  # a cold device's first figures, again (pass_timing.py)
            again, _ = _profile_block(block_units[0].module, *first_input, backend, index, repeats, compile_blocks)
            for sig, prof in zip(sigs, profiles):
                if sig == sigs[0]:
                    lesser_times(prof, again)
            if pass_through_ok:
                f2, b2, _, _ = _profile_rest(model, blocks, rest, inputs, targets, loss_fn, backend, index, repeats,
                                             out)
                rest_fwd, rest_bwd = min(rest_fwd, f2), min(rest_bwd, b2)
        halves = half_sequence_bytes(model, [u.module for u in block_units], _block_signature, inputs, targets,
                                     loss_fn, backend, index)
        for i, u in enumerate(block_units):
            for prof in (profiles[i], *eager[i:i + 1]):
                prof.act_bytes_half_seq = halves.get(_block_signature(u.module), 0)
        numel_for_rates = adamw_numel or min(64 << 20, max(1 << 20, max(u.numel for u in units)))
        # The device measurement's buffers (fp32 master, gradient, moments; two compute-dtype
        # copies) take at most half of what the device (its cap) has free: a rate per
        # parameter needs no full-size unit, and a tight budget must not fail here.
        per_elem = 16 + 2 * dtype.itemsize
        dev_numel = max(1 << 16, min(numel_for_rates, backend.mem_info(index)[0] // (2 * per_elem)))
        dev_rate = device_adamw_rate(backend, index, dev_numel, dtype, repeats)
    (host_rate, _), (copies_rate, copies_GBps) = host_adamw_rates(numel_for_rates, dtype, repeats, backend, host_kernel,
                                                                  index, (0.0, 1.0))
    input_bytes = sum(_nbytes(t) for t in _tensors((inputs, targets)))
    name = backend.topology().devices[index].name if backend.topology().devices else backend.name
    return StepProfile(profiles, rest.train_numel, sum(_nbytes(p) for _, p in rest.params), rest_fwd, rest_bwd, int(loss_peak),
                       input_bytes, torch.empty((), dtype=dtype).element_size(), int(tokens), host_rate, dev_rate,
                       backend.name, str(name), notes, vocab, hidden, chunks,
                       host_adamw_copies_s_per_param=copies_rate if copies_GBps else 0.0, host_copies_GBps=copies_GBps,
                       host_adamw_bytes_per_param=update_bytes(dtype.itemsize).kernel,
                       seq=sample_shape(inputs)[1] if halves else 0, padded=padded(inputs),
                       host_adamw_numel=numel_for_rates, compiled_blocks=compile_blocks, eager_blocks=eager)
