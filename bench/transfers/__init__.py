"""Transfer benchmarks and predictions for :mod:`scaleup`: measured copies beside the path simulator.

    python -m bench.transfers.engine --out bench/results             # TransferEngine vs raw copies
    python -m bench.transfers.multipath --preset dgx-h200 --out DIR  # MultiPathCopier vs the direct route
    python -m bench.transfers.predict --out bench/results            # simulated GB/s for 1..8 devices

Modules: :mod:`bench.transfers.engine` (one route, engine vs raw ``backend.copy``),
:mod:`bench.transfers.multipath` (the multi-path run and its command line), with
:mod:`bench.transfers.multipath_measure` (byte patterns, checks, timing, solo links) and
:mod:`bench.transfers.multipath_report` (the simulator's predictions beside the figures, the
table, the plot), and :mod:`bench.transfers.predict` (the published prediction and its plot).
Nothing is imported here, so each command loads only what it uses.
"""
