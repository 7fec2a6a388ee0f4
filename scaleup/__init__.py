"""Multi-path host-to-device transfer: a transfer engine, path discovery, an adaptive copier, a simulator.

* :class:`TransferEngine` (``engine.py``): asynchronous, chunked host↔device copies of a tensor
  or a parameter group, over dedicated copy streams, with pinned staging for pageable memory.
* :func:`discover_routes` (``routes.py``): the direct host link and host→peer→target relays
  of a device, their expected rates and the resources they share.
* :class:`MultiPathCopier` (``multipath.py``): one host→device transfer split over routes,
  shares learnt online, failed or stalled routes dropped without losing data.
* :class:`PathSimulator` (``simulator.py``): the same policy on modelled links, for
  convergence tests and bandwidth predictions.

Benchmarks and prediction scripts built on this library live in the harness, not here.
"""
from .chunks import byte_view
from .engine import TransferEngine
from .handles import Transfer, TransferError
from .links import BackendLink, FailingLink, LinkFailure, LinkModel, StalledLink, ThrottledLink
from .multipath import MultiPathCopier
from .policy import Observation, SplitPolicy
from .pools import PoolClosed, StagingPool
from .simulator import Change, Fail, PathSimulator, SimResult
from .routes import (Hop, Route, apply_probe, discover_routes, expected_aggregate_GBps, max_min_rates,
                     resource_capacities, shared_resources)

__all__ = [
    "TransferEngine", "Transfer", "TransferError", "byte_view",
    "LinkModel", "BackendLink", "ThrottledLink", "FailingLink", "StalledLink", "LinkFailure",
    "MultiPathCopier", "SplitPolicy", "Observation", "StagingPool", "PoolClosed",
    "Hop", "Route", "discover_routes", "apply_probe", "resource_capacities", "shared_resources",
    "max_min_rates", "expected_aggregate_GBps", "PathSimulator", "SimResult", "Change", "Fail",
]
