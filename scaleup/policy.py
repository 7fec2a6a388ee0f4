"""The splitting policy: which route gets the next chunk, and how route rates are learnt.

One object, used unchanged by the real copier (:mod:`scaleup.multipath`) and the path
simulator (:mod:`scaleup.simulator`), so what the simulator predicts is what the copier does.

* Each live route has a rate estimate, seeded from ``xpu probe`` figures (or nominal rates)
  and updated from every finished chunk by exponential smoothing:
  ``est = (1 - a) * est + a * (chunk bytes / chunk time)``. A route that slows to a tenth of
  its rate falls below a third of its old estimate after two chunks with ``a = 0.5``.
* Shares are estimates normalised over live routes.
* Dispatch is earliest-finish-time with a tail rule: a route with a free slot may take the
  next chunk only if, counting what it already has in flight, it would finish it no later than
  the whole transfer is expected to end (remaining plus in-flight bytes over the summed
  rates). Early in a transfer every route qualifies and each runs at its own pace, so bytes
  split in proportion to rates; near the end slow routes stop taking chunks, so they do not
  hold the transfer's tail.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Mapping

__all__ = ["SplitPolicy", "Observation"]


@dataclass(frozen=True)
class Observation:
    """One finished chunk as the policy saw it.

    Attributes:
        route: route name.
        nbytes: chunk size.
        seconds: measured chunk time (the slowest hop's time).
        sample_GBps: ``nbytes / seconds`` in GB/s.
        estimate_GBps: the route's estimate after this observation.
        share: the route's share after this observation.
    """

    route: str
    nbytes: int
    seconds: float
    sample_GBps: float
    estimate_GBps: float
    share: float


class SplitPolicy:
    """Rate estimates, shares and chunk dispatch for a set of routes.

    Args:
        rates_GBps: initial rate estimate per route name (GB/s), e.g. from ``xpu probe``.
        smoothing: weight of a new sample in the estimate, in (0, 1].
        tail_slack: how much later than the expected end (as a fraction) a route may finish
            a chunk and still take it.

    Raises:
        ValueError: no routes, a non-positive rate, or ``smoothing`` outside (0, 1].
    """

    def __init__(self, rates_GBps: Mapping[str, float], *, smoothing: float = 0.5, tail_slack: float = 0.1) -> None:
        if not rates_GBps:
            raise ValueError("SplitPolicy needs at least one route")
        bad = {k: v for k, v in rates_GBps.items() if not v > 0}
        if bad:
            raise ValueError(f"initial route rates must be positive GB/s, got {bad}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if tail_slack < 0:
            raise ValueError(f"tail_slack must be >= 0, got {tail_slack}")
        self.smoothing, self.tail_slack = smoothing, tail_slack
        self._est = {k: float(v) for k, v in rates_GBps.items()}
        self._initial = dict(self._est)
        self._dropped: dict[str, str] = {}
        self.history: list[Observation] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ state
    @property
    def live(self) -> list[str]:
        """Names of routes not dropped, in the order given."""
        return [k for k in self._est if k not in self._dropped]

    @property
    def dropped(self) -> dict[str, str]:
        """Dropped route names and why."""
        return dict(self._dropped)

    def estimate(self, route: str) -> float:
        """Current rate estimate of ``route`` in GB/s."""
        return self._est[route]

    def estimates(self) -> dict[str, float]:
        """Rate estimates of live routes in GB/s."""
        return {k: self._est[k] for k in self.live}

    def shares(self) -> dict[str, float]:
        """Each live route's fraction of the expected aggregate rate (sums to 1)."""
        est = self.estimates()
        total = sum(est.values())
        return {k: v / total for k, v in est.items()} if total > 0 else {}

    # ------------------------------------------------------------------ updates
    def observe(self, route: str, nbytes: int, seconds: float) -> Observation:
        """Fold one finished chunk into ``route``'s estimate and return what was recorded."""
        if route not in self._est:
            raise KeyError(f"unknown route {route!r}; known: {list(self._est)}")
        seconds = max(float(seconds), 1e-9)  # a timer can read 0 for a tiny chunk
        sample = nbytes / seconds / 1e9
        with self._lock:
            a = self.smoothing
            self._est[route] = (1 - a) * self._est[route] + a * sample
            share = self.shares().get(route, 0.0)
            obs = Observation(route, int(nbytes), seconds, sample, self._est[route], share)
            self.history.append(obs)
        return obs

    def drop(self, route: str, reason: str) -> None:
        """Stop giving chunks to ``route`` (it failed or stalled)."""
        if route not in self._est:
            raise KeyError(f"unknown route {route!r}; known: {list(self._est)}")
        with self._lock:
            self._dropped.setdefault(route, reason)

    def revive(self, route: str) -> None:
        """Give a dropped route another chance, from its initial estimate."""
        with self._lock:
            if self._dropped.pop(route, None) is not None:
                self._est[route] = self._initial[route]

    # ------------------------------------------------------------------ dispatch
    def pick(self, free: Iterable[str], backlog: Mapping[str, int], remaining: int, chunk: int) -> str | None:
        """The route that should take the next chunk now, or None to wait for a completion.

        Args:
            free: live routes with a free in-flight slot.
            backlog: bytes each live route has in flight (assigned, not finished).
            remaining: bytes not yet assigned to any route, including this chunk.
            chunk: size of the next chunk.
        """
        live = self.live
        if not live:
            return None
        est = {k: self._est[k] * 1e9 for k in live}
        finish = {k: (backlog.get(k, 0) + chunk) / est[k] for k in live}
        expected_end = (remaining + sum(backlog.get(k, 0) for k in live)) / sum(est.values())
        # The route that would finish this chunk first is always allowed, so someone can take it.
        bound = max(expected_end, min(finish.values())) * (1 + self.tail_slack)
        candidates = [k for k in free if k in finish and finish[k] <= bound]
        return min(candidates, key=lambda k: finish[k]) if candidates else None
