"""Seeded workload generators: arrival processes and request sizes.

Every flow draws from its own stream, ``numpy.random.default_rng([seed, flow_index])``,
so adding a flow never changes the requests of the others, and the same seed gives the
same workload on every run. Times are in decode steps, sizes in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from .model import ClosedLoop, FlowSpec, Workload

__all__ = [
    "Phases",
    "Poisson",
    "Periodic",
    "Batch",
    "Uniform",
    "Bursts",
    "OnOff",
    "Sizes",
    "Mix",
    "FlowLoad",
    "build_workload",
    "capacity",
]


# ---------------------------------------------------------------------- arrivals
@dataclass(frozen=True)
class Phases:
    """Piecewise-constant Poisson arrivals: ``(start, end, rate)`` per phase, rate in
    requests per step, phases half-open ``[start, end)``."""

    phases: tuple[tuple[int, int, float], ...]

    def times(self, rng: np.random.Generator) -> np.ndarray:
        out = []
        for start, end, rate in self.phases:
            if end <= start or rate <= 0:
                continue
            n = int(rng.poisson(rate * (end - start)))
            out.append(np.floor(rng.uniform(start, end, size=n)).astype(np.int64))
        if not out:
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.concatenate(out), kind="stable")


def Poisson(rate: float, start: int = 0, end: int = 10_000) -> Phases:
    """Poisson arrivals at ``rate`` requests per step in ``[start, end)``."""
    return Phases(((int(start), int(end), float(rate)),))


def OnOff(rate: float, on: int, off: int, start: int = 0, end: int = 10_000) -> Phases:
    """Poisson at ``rate`` for ``on`` steps, silent for ``off`` steps, repeated."""
    phases = []
    t = int(start)
    while t < end:
        phases.append((t, min(t + on, end), float(rate)))
        t += on + off
    return Phases(tuple(phases))


@dataclass(frozen=True)
class Periodic:
    """One request every ``interval`` steps in ``[start, end)`` (a steady rate)."""

    interval: int
    start: int = 0
    end: int = 10_000

    def times(self, rng: np.random.Generator) -> np.ndarray:
        return np.arange(self.start, self.end, self.interval, dtype=np.int64)


@dataclass(frozen=True)
class Batch:
    """``count`` requests all arriving at step ``at``."""

    count: int
    at: int = 0

    def times(self, rng: np.random.Generator) -> np.ndarray:
        return np.full(self.count, self.at, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    """Exactly ``count`` requests at steps drawn uniformly from ``[start, end)``."""

    count: int
    start: int = 0
    end: int = 10_000

    def times(self, rng: np.random.Generator) -> np.ndarray:
        return np.sort(rng.integers(self.start, self.end, size=self.count)).astype(np.int64)


@dataclass(frozen=True)
class Bursts:
    """Bursts of ``size`` simultaneous requests, one every ``gap`` steps from ``start``
    (each moved later by a uniform jitter in ``[0, jitter)`` steps), before ``end``."""

    size: int
    gap: int
    start: int = 0
    end: int = 10_000
    jitter: int = 0

    def times(self, rng: np.random.Generator) -> np.ndarray:
        base = np.arange(self.start, self.end, self.gap, dtype=np.int64)
        if self.jitter > 0:
            base = base + rng.integers(0, self.jitter, size=base.size)
        base = base[base < self.end]
        return np.repeat(base, self.size)


# ---------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Sizes:
    """Prompt and output lengths uniform on the inclusive ranges (tokens); every request
    asks for ``max_tokens`` (default: the top of the output range)."""

    prompt: tuple[int, int]
    output: tuple[int, int]
    max_tokens: int | None = None

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p = rng.integers(self.prompt[0], self.prompt[1], size=n, endpoint=True)
        o = rng.integers(self.output[0], self.output[1], size=n, endpoint=True)
        m = np.full(n, self.max_tokens if self.max_tokens is not None else self.output[1], dtype=np.int64)
        return p.astype(np.int64), o.astype(np.int64), m

    def mean_prompt(self) -> float:
        return (self.prompt[0] + self.prompt[1]) / 2


@dataclass(frozen=True)
class Mix:
    """A heavy/light mixture: each request draws its :class:`Sizes` with the given
    probabilities."""

    parts: tuple[tuple[float, Sizes], ...]

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        probs = np.array([p for p, _ in self.parts], dtype=float)
        which = rng.choice(len(self.parts), size=n, p=probs / probs.sum())
        p = np.zeros(n, dtype=np.int64)
        o = np.zeros(n, dtype=np.int64)
        m = np.zeros(n, dtype=np.int64)
        for k, (_, sizes) in enumerate(self.parts):
            idx = np.flatnonzero(which == k)
            pk, ok, mk = sizes.draw(rng, idx.size)
            p[idx], o[idx], m[idx] = pk, ok, mk
        return p, o, m


class Arrivals(Protocol):
    """An arrival process: ``times(rng)`` gives the arrival steps (int64)."""

    def times(self, rng: np.random.Generator) -> np.ndarray: ...


class SizeDraw(Protocol):
    """Request sizes: ``draw(rng, n)`` gives ``(prompt, output, max_tokens)`` arrays."""

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class FlowLoad:
    """A flow and how it sends: an arrival process and a size distribution."""

    spec: FlowSpec
    arrivals: Arrivals
    sizes: SizeDraw


def build_workload(seed: int, loads: Sequence[FlowLoad], meta: dict[str, Any] | None = None,
                   closed: Sequence[ClosedLoop] = ()) -> Workload:
    """Draw every flow's requests from its own seeded stream and merge them by arrival;
    ``closed``: closed-loop clients (their requests are made during the run)."""
    cols: list[list[np.ndarray]] = [[], [], [], [], []]
    for k, load in enumerate(loads):
        rng = np.random.default_rng([int(seed), k])
        t = np.asarray(load.arrivals.times(rng), dtype=np.int64)
        p, o, m = load.sizes.draw(rng, t.size)
        for col, arr in zip(cols, (t, np.full(t.size, k, dtype=np.int64), p, o, m)):
            col.append(arr)
    arrs = [np.concatenate(c) if c else np.zeros(0, dtype=np.int64) for c in cols]
    t, f, p, o, m = arrs
    return Workload.from_arrays([ld.spec for ld in loads], t, f, p, o, m, meta=meta, closed=closed)


def capacity(kv_budget: int, sizes: Sizes) -> float:
    """Expected completions per step of one KV-bound engine saturated with ``sizes``.

    A request with prompt p and output o holds on average ``p + o/2`` tokens for ``o``
    steps, so the time-weighted mean occupancy per resident is ``E[p] + E[o^2]/(2 E[o])``
    and ``M`` tokens hold about ``M / that`` residents, each leaving after ``E[o]``
    steps. Used only to set arrival rates relative to capacity; throughput is measured.
    """
    lo, hi = sizes.output
    o = np.arange(lo, hi + 1, dtype=float)
    eo, eo2 = o.mean(), (o * o).mean()
    per_resident = sizes.mean_prompt() + eo2 / (2 * eo)
    return float(kv_budget / per_resident / eo)
