"""``xpu export CHECKPOINT_OR_RUN_DIR --hf OUT_DIR [--adapter] [--dtype D]``: an ``xpu train`` checkpoint as a Hugging Face folder.

    xpu export runs/llama-ft --hf out/llama-ft             # the run's latest step-*.pt, LoRA merged
    xpu export runs/llama-ft/step-200.pt --hf out/adapter --adapter   # the LoRA adapter alone
    xpu export runs/llama-ft --hf out/llama-ft-fp32 --dtype float32   # the fp32 master weights

Weights are written in the base model's saved dtype unless ``--dtype`` says otherwise.

A bad checkpoint, a model that is not of family ``hf`` or ``--adapter`` without LoRA is a one-line
error (exit status 2). Heavy imports happen in :func:`run`.
"""
from __future__ import annotations

import argparse

from xpu.cli import register_command

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``xpu export``."""
    parser.add_argument("checkpoint", help="a step-N.pt written by xpu train, or a run folder (its latest step-*.pt)")
    parser.add_argument("--hf", required=True, metavar="OUT_DIR",
                        help="write a Hugging Face folder (config.json, model.safetensors, tokenizer files) here")
    parser.add_argument("--adapter", action="store_true",
                        help="LoRA runs: write the adapter alone (adapter_config.json + adapter_model.safetensors), "
                             "not the merged weights")
    # Checked by export_hf (its EXPORT_DTYPES; a one-line error names them): no torch import here.
    parser.add_argument("--dtype", default="auto",
                        help="dtype of the written weights: auto (default: the dtype the base model's folder was "
                             "saved in; a LoRA adapter alone: as trained), float32, bfloat16 or float16")


def _strip_resume(exc: Exception) -> str:
    msg = str(exc)
    return msg[len("resume: "):] if msg.startswith("resume: ") else msg  # the readers word their errors for resume


def run(args: argparse.Namespace) -> int:
    """Read the checkpoint, write the Hugging Face folder, print where."""
    from strategies.training.checkpoints import find_checkpoint, read_checkpoint
    from strategies.training.config import TrainConfigError
    from strategies.training.export import export_hf, recorded_dtype

    try:
        path = find_checkpoint(args.checkpoint)
        ckpt = read_checkpoint(path)
    except TrainConfigError as exc:
        raise TrainConfigError(_strip_resume(exc)) from None
    config = ckpt["config"]
    engine = ckpt.get("engine")
    if not isinstance(engine, dict) or not isinstance(engine.get("model"), dict):
        raise TrainConfigError(f"{path} holds no model weights (engine state without 'model')")
    model = config.get("model") if isinstance(config, dict) else None
    if args.adapter and not (isinstance(model, dict) and model.get("lora") is not None):
        raise TrainConfigError(f"--adapter needs a LoRA run (model.lora); {path} trained all weights: drop --adapter")
    out = export_hf(engine["model"], config, args.hf, merge_lora=not args.adapter, dtype=args.dtype)
    what = "LoRA adapter" if args.adapter else ("merged LoRA weights" if model and model.get("lora") else "weights")
    print(f"xpu export: wrote {what} of {path} (step {ckpt.get('step')}) to {out}"
          + (f" ({written})" if (written := recorded_dtype(out)) else ""))
    return 0


# `xpu export`: registered through the `xpu.commands` entry point in pyproject.toml.
register_command("export", "strategies.training.export_cli", "write a training checkpoint as a Hugging Face model folder",
                 order=9)
