"""After a bench run of an ``hf`` model: export it as a Hugging Face folder and check that it reloads.

:func:`export_and_reload` writes the engine's trained weights with the training layer's own
:func:`strategies.training.export.export_hf` (LoRA adapters merged into the base weights), loads
the folder back with ``AutoModelForCausalLM.from_pretrained`` (fp32, on the host: no device
memory, so the device cap is untouched) and compares the reloaded model's loss on a slice of
the first micro-batch with the engine's own loss on that slice. The answer is one sentence
for the row's notes.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["export_and_reload", "SLICE_TOKENS"]

#: Tokens of the first micro-batch's first row used for the comparison (a host forward of the
#: whole 1.5 B model over more would take long on the CPU).
SLICE_TOKENS = 256


def _reloaded_loss(folder: str, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, use_safetensors=True,
                                                 dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return float(loss), sum(p.numel() for p in model.parameters())


def export_and_reload(engine: Any, ctx: Any, inputs: torch.Tensor, targets: torch.Tensor) -> str:
    """Export ``engine``'s model (an ``hf`` family model of ``ctx``), reload it, compare losses.

    Args:
        engine: a :class:`~strategies.memferry.MemFerry` engine after training.
        ctx: the system's :class:`~bench.systems.base.SystemContext` (model section in ``dims``).
        inputs, targets: the first micro-batch (its first row's first :data:`SLICE_TOKENS` are used).

    Returns:
        ``"export reloads (from_pretrained, N params): loss A vs engine B on 1x256 tokens"``, or
        ``"export failed: <error>"`` (a failure here must not fail the row's training figures).
    """
    from strategies.training.export import export_hf

    n = min(SLICE_TOKENS, inputs.shape[1])
    x = inputs[:1, :n].detach().to("cpu")
    y = targets[:1, :n].detach().to("cpu")
    out = tempfile.mkdtemp(prefix="xpu-bench-export-", dir=os.environ.get("XPU_BENCH_EXPORT_DIR"))
    try:
        engine_loss = engine.eval_loss(x, y)
        engine.synchronize()
        state = engine.shadow.state_dict()  # the weights only: no optimizer-state copy
        if ctx.dtype != torch.float32:  # shipped in the compute dtype, as the device trained with it
            state = {k: v.to(ctx.dtype) if v.is_floating_point() else v for k, v in state.items()}
        section = {"family": "hf", **{k: v for k, v in ctx.dims.items() if k != "seq"}}
        export_hf(state, {"model": section, "seq": ctx.seq}, out)
        del state
        loss, params = _reloaded_loss(out, x, y)
        return (f"export reloads (from_pretrained, {params / 1e6:.1f} M params"
                f"{', LoRA merged' if ctx.dims.get('lora') is not None else ''}): loss {loss:.5f} vs engine "
                f"{engine_loss:.5f} on 1x{n} tokens")
    except Exception as exc:  # noqa: BLE001 - reported in the notes
        return f"export failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    finally:
        shutil.rmtree(out, ignore_errors=True)
