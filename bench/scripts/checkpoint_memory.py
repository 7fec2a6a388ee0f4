"""Host memory a checkpoint's save and resume take beyond the engine's own (Linux, cpu backend).

Builds a MemFerry engine over a GPT (every block prefetched: masters and moments in host
buffers), trains one step, then in this process saves a checkpoint with ``save_checkpoint``, and
in a fresh process builds the same engine and resumes from it (``read_checkpoint`` +
``load_state_dict``). Each phase's peak resident memory is read from ``VmHWM`` after resetting it
(``/proc/self/clear_refs``; a mapped checkpoint's pages count there, as page cache the kernel may
drop), and its peak anonymous memory is sampled (``RssAnon``: what the process holds itself);
both are printed against the resident memory before the phase and the state's size.

    XPU_BACKEND=cpu python3 bench/scripts/checkpoint_memory.py [--layers 12 --hidden 1024] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current resident size


def _engine(args: argparse.Namespace):
    from strategies.memferry import AdamW, MemFerry
    from strategies.models import build_model

    torch.manual_seed(0)
    model = build_model("gpt", layers=args.layers, hidden=args.hidden, heads=8, vocab=1024, seq=64)
    engine = MemFerry(model, optim=AdamW(lr=1e-4), plan="prefetch")
    x = torch.randint(0, 1024, (2, 64))
    engine.train_step(x, x)
    return engine, sum(p.numel() for p in model.parameters())


def _phase(name: str, fn, state_bytes: int) -> dict:
    """Run ``fn``; its peak resident memory (``VmHWM``: mapped file pages count) and its peak
    anonymous memory (``RssAnon`` sampled every millisecond: what the process itself holds)."""
    before, anon_before = _status("VmRSS"), _status("RssAnon")
    anon_peak, done = [anon_before], threading.Event()

    def sample() -> None:
        while not done.is_set():
            anon_peak[0] = max(anon_peak[0], _status("RssAnon"))
            time.sleep(0.001)

    watcher = threading.Thread(target=sample, daemon=True)
    _reset_peak()
    watcher.start()
    out = fn()
    done.set()
    watcher.join()
    peak = _status("VmHWM")
    return {"phase": name, "rss_before_gb": before / 1e9, "over_rss_gb": (peak - before) / 1e9,
            "over_anon_gb": (anon_peak[0] - anon_before) / 1e9, "over_anon_state": (anon_peak[0] - anon_before) / state_bytes,
            "out": out}


def _save(args: argparse.Namespace) -> dict:
    from strategies.training.checkpoints import save_checkpoint

    engine, numel = _engine(args)
    state_bytes = numel * 16  # what the checkpoint holds a parameter: fp32 weight 4, master 4, moments 8
    data = SimpleNamespace(state_dict=lambda: {})
    row = _phase("save", lambda: str(save_checkpoint(Path(args.dir), 1, engine, data, {"name": "m"}, run_id="r",
                                                     dtype_name="fp32")), state_bytes)
    row["params"] = numel
    engine.close()
    return row


def _resume(args: argparse.Namespace) -> dict:
    from strategies.training.checkpoints import find_checkpoint, read_checkpoint

    engine, numel = _engine(args)
    path = find_checkpoint(args.dir)
    row = _phase("resume", lambda: engine.load_state_dict(read_checkpoint(path)["engine"]), numel * 16)
    row["params"] = numel
    engine.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one)")
    ap.add_argument("--phase", choices=["save", "resume"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase is not None:  # a child: one phase, its row as JSON on the last line
        print(json.dumps({k: v for k, v in (_save if args.phase == "save" else _resume)(args).items() if k != "out"}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.dir or tmp
        rows = []
        for phase in ("save", "resume"):  # each in a fresh process: its own peak
            cmd = [sys.executable, __file__, "--phase", phase, "--layers", str(args.layers), "--hidden",
                   str(args.hidden), "--dir", folder]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            rows.append(json.loads(out))
    print(f"GPT {args.layers} layers, hidden {args.hidden}: {rows[0]['params'] / 1e6:.0f} M parameters, "
          f"state {rows[0]['params'] * 16 / 1e9:.2f} GB (16 B a parameter)\n")
    print("| phase | resident before GB | peak resident over it GB (file pages count) | peak anonymous over it GB | "
          "anonymous over / state |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['phase']} | {r['rss_before_gb']:.2f} | {r['over_rss_gb']:.2f} | {r['over_anon_gb']:.2f} | "
              f"{r['over_anon_state']:.2f} |")


if __name__ == "__main__":
    main()
