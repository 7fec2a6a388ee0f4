"""The training layer: run a training loop from a validated config (what ``xpu train CONFIG.yaml`` does).

    from strategies.training import load_config, train
    result = train(load_config("examples/train/gpt-tiny-memferry.yaml", {"steps": 50}))
    print(result.losses[0], result.losses[-1], result.peak_device_bytes)

One module per job: :mod:`.config` (the YAML schema and its validation; the format is in its
docstring), :mod:`.checks` (the check and override helpers every config of the project uses),
:mod:`.data` (batches), :mod:`.corpora` (jsonl and token files), :mod:`.schedule` (learning rate), :mod:`.registry` (strategies by name),
:mod:`.engines` (MemFerry and the torch reference), :mod:`.checkpoints`, :mod:`.reports`
(callbacks and results), :mod:`.log_sinks` (the ``logging:`` key's CSV, TensorBoard and W&B writers), :mod:`.loop` (:func:`train`), :mod:`.cli` (``xpu train``).
"""
from .checkpoints import find_checkpoint, read_checkpoint
from .config import (TEXT_VOCAB, CheckpointConfig, DataConfig, LoggingConfig, OptimizerConfig, StrategyConfig, TrainConfig,
                     TrainConfigError, CheckpointWriteError, TrainingDivergedError, load_config, resolve_dtype)
from .data import IterableBatches, TokenWindows, make_data, make_datasets, markov_corpus
from .engines import TorchEngine
from .loop import train
from .registry import STRATEGIES, StrategySpec, TrainEngine, get_strategy, register_strategy
from .reports import CallbackList, RunInfo, StepReport, TrainCallback, TrainResult
from .schedule import lr_at

__all__ = [
    "TrainConfig", "StrategyConfig", "OptimizerConfig", "DataConfig", "CheckpointConfig", "LoggingConfig", "TrainConfigError",
    "CheckpointWriteError", "TrainingDivergedError", "read_checkpoint", "StrategySpec", "STRATEGIES", "register_strategy", "get_strategy", "TrainEngine", "TorchEngine", "TokenWindows",
    "StepReport", "RunInfo", "TrainCallback", "CallbackList", "TrainResult", "load_config", "train", "lr_at", "markov_corpus",
    "find_checkpoint", "make_data", "make_datasets", "IterableBatches", "resolve_dtype", "TEXT_VOCAB",
]
