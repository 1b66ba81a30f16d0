"""The simulator's data: flows, requests, workloads and the JSONL trace format.

Units
-----
* time is in **decode steps** (one iteration of a continuous-batching engine);
* sizes are in **tokens** (prompt tokens, output tokens, ``max_tokens``);
* service is in **weighted tokens**: ``w_p * prompt + w_q * generated`` (docs/simulator.md §1).

A :class:`Workload` is immutable input: every policy of a scenario runs on the same one.
Requests are ordered by ``(arrival, position in the input)`` and numbered
``rid = 0, 1, ...`` in that order, which is also the tie rule everywhere ("first come").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Sequence

import numpy as np

__all__ = ["ClosedLoop", "FlowSpec", "Workload", "Request", "load_trace", "save_trace", "read_trace_lines"]

#: the default request sizes (docs/simulator.md §5), also of closed-loop clients: prompts U[64, 512],
#: outputs U[32, 384], max_tokens 384
DEFAULT_PROMPT = (64, 512)
DEFAULT_OUTPUT = (32, 384)


@dataclass(frozen=True)
class FlowSpec:
    """One flow (a client, or organisation + workload class).

    ``weight`` (> 0) scales its fair share; ``klass`` names its workload class and
    ``priority`` ranks it for the strict-priority policy (0 is the most urgent).
    """

    name: str
    weight: float = 1.0
    klass: str = "default"
    priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"flow name must be a non-empty string, got {self.name!r}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"weight of flow {self.name!r} must be a finite number > 0, got {w!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority of flow {self.name!r} must be an int, got {self.priority!r}")


@dataclass(frozen=True)
class ClosedLoop:
    """A closed-loop client: at the start of every step in ``[start, end)`` it tops its
    requests waiting at the balancer up to ``keep`` (``end`` ``None``: until the run
    ends). Sizes are uniform on the inclusive ``prompt``/``output`` ranges (tokens), every
    request asks for ``max_tokens`` (default: the top of the output range), drawn from
    the stream ``numpy.random.default_rng([seed, 7919, flow])``: the k-th request of the
    client has the same size under every policy.
    """

    flow: int
    keep: int
    prompt: tuple[int, int] = DEFAULT_PROMPT
    output: tuple[int, int] = DEFAULT_OUTPUT
    max_tokens: int | None = None
    start: int = 0
    end: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("flow", "keep", "start", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "keep" else 0):
                raise ValueError(f"closed-loop {name} must be an int >= {1 if name == 'keep' else 0}, got {v!r}")
        if self.end is not None and (isinstance(self.end, bool) or not isinstance(self.end, int)
                                     or self.end <= self.start):
            raise ValueError(f"closed-loop end must be None or an int > start {self.start}, got {self.end!r}")
        for name in ("prompt", "output"):
            lo, hi = getattr(self, name)
            if (isinstance(lo, bool) or isinstance(hi, bool) or not isinstance(lo, int) or not isinstance(hi, int)
                    or not 1 <= lo <= hi):
                raise ValueError(f"closed-loop {name} range must be ints 1 <= lo <= hi, got {[lo, hi]!r}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < self.output[1]):
            raise ValueError(f"closed-loop max_tokens must be an int >= the largest output {self.output[1]}, "
                             f"got {self.max_tokens!r}")

    @property
    def cap(self) -> int:
        """``max_tokens`` of its requests."""
        return self.max_tokens if self.max_tokens is not None else self.output[1]

    def active(self, t: int) -> bool:
        return self.start <= t and (self.end is None or t < self.end)

    def sizes(self) -> Iterator[tuple[int, int]]:
        """``(prompt, output)`` of its requests, in order, forever (blocks of 256 draws)."""
        rng = np.random.default_rng([self.seed, 7919, self.flow])
        while True:
            p = rng.integers(self.prompt[0], self.prompt[1], size=256, endpoint=True).tolist()
            o = rng.integers(self.output[0], self.output[1], size=256, endpoint=True).tolist()
            yield from zip(p, o)


@dataclass(frozen=True)
class Workload:
    """Requests of several flows, as parallel integer arrays sorted by arrival.

    ``arrival`` (steps), ``flow`` (index into ``flows``), ``prompt``, ``output`` and
    ``max_tokens`` (tokens). Built with :meth:`from_arrays`, which validates and sorts.
    ``closed``: closed-loop clients (:class:`ClosedLoop`), whose requests the run makes.
    """

    flows: tuple[FlowSpec, ...]
    arrival: np.ndarray
    flow: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    max_tokens: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    closed: tuple[ClosedLoop, ...] = ()

    def __len__(self) -> int:
        return int(self.arrival.shape[0])

    @property
    def flow_names(self) -> list[str]:
        return [f.name for f in self.flows]

    @classmethod
    def from_arrays(
        cls,
        flows: Sequence[FlowSpec],
        arrival: Iterable[int],
        flow: Iterable[int],
        prompt: Iterable[int],
        output: Iterable[int],
        max_tokens: Iterable[int] | None = None,
        meta: dict[str, Any] | None = None,
        closed: Sequence[ClosedLoop] = (),
    ) -> "Workload":
        """Validate, sort by ``(arrival, position in the given order)`` and freeze.

        ``max_tokens`` defaults to ``output``. Raises ``ValueError`` naming the first bad
        request (its position in the given order) and the bad value.
        """
        flows = tuple(flows)
        names = [f.name for f in flows]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate flow names: {dup}")
        a = np.asarray(list(arrival) if not isinstance(arrival, np.ndarray) else arrival, dtype=np.int64)
        fl = np.asarray(list(flow) if not isinstance(flow, np.ndarray) else flow, dtype=np.int64)
        p = np.asarray(list(prompt) if not isinstance(prompt, np.ndarray) else prompt, dtype=np.int64)
        o = np.asarray(list(output) if not isinstance(output, np.ndarray) else output, dtype=np.int64)
        if max_tokens is None:
            m = o.copy()
        else:
            m = np.asarray(list(max_tokens) if not isinstance(max_tokens, np.ndarray) else max_tokens, dtype=np.int64)
        n = a.shape[0]
        for name, arr in (("flow", fl), ("prompt", p), ("output", o), ("max_tokens", m)):
            if arr.shape != (n,):
                raise ValueError(f"{name} has shape {arr.shape}, expected ({n},) like arrival")
        _first_bad(a < 0, a, "arrival", "must be >= 0")
        _first_bad((fl < 0) | (fl >= len(flows)), fl, "flow index", f"must be in [0, {len(flows)})")
        _first_bad(p < 1, p, "prompt", "must be >= 1 token")
        _first_bad(o < 1, o, "output", "must be >= 1 token")
        _first_bad(m < o, m, "max_tokens", "must be >= output")
        order = np.argsort(a, kind="stable")  # by arrival, then position in the given order
        arrs = [x[order].copy() for x in (a, fl, p, o, m)]
        for x in arrs:
            x.setflags(write=False)
        closed = tuple(closed)
        for c in closed:
            if not isinstance(c, ClosedLoop) or not 0 <= c.flow < len(flows):
                raise ValueError(f"closed-loop client {c!r}: flow index must be in [0, {len(flows)})")
        sa, sf, sp, so, sm = arrs
        return cls(flows, sa, sf, sp, so, sm, meta=dict(meta or {}), closed=closed)

    def with_flows(self, flows: Sequence[FlowSpec]) -> "Workload":
        """The same requests with other flow specs (same names, same order)."""
        flows = tuple(flows)
        if [f.name for f in flows] != self.flow_names:
            raise ValueError(f"flow names {[f.name for f in flows]} differ from {self.flow_names}")
        return Workload(flows, self.arrival, self.flow, self.prompt, self.output, self.max_tokens, dict(self.meta),
                        self.closed)

    def requests(self) -> list["Request"]:
        """Fresh mutable request records (one simulation run consumes them)."""
        return [
            Request(i, f, a, p, o, m)
            for i, (a, f, p, o, m) in enumerate(
                zip(
                    self.arrival.tolist(),
                    self.flow.tolist(),
                    self.prompt.tolist(),
                    self.output.tolist(),
                    self.max_tokens.tolist(),
                )
            )
        ]


def _first_bad(mask: np.ndarray, values: np.ndarray, what: str, rule: str) -> None:
    if mask.any():
        i = int(np.flatnonzero(mask)[0])
        raise ValueError(f"request {i}: {what} {int(values[i])} {rule}")


class Request:
    """One request during one run.

    Fixed: ``rid``, ``flow`` (index), ``arrival`` (step), ``prompt``, ``output``,
    ``max_tokens`` (tokens). Filled in by the run: ``est`` (estimated cost, weighted
    tokens, fixed when the request reaches the balancer), ``admit`` (step it started,
    -1 if never), ``finish`` (step it left its server, -1 if not yet), ``server``,
    ``tag`` (a policy's private sort key), ``seq`` (the order in which requests reached
    the balancer, the "first come" of every tie rule; ``rid`` until the run sets it).
    """

    __slots__ = ("rid", "flow", "arrival", "prompt", "output", "max_tokens", "est", "admit", "finish", "server", "tag",
                 "seq")

    def __init__(self, rid: int, flow: int, arrival: int, prompt: int, output: int, max_tokens: int):
        self.rid = rid
        self.flow = flow
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.max_tokens = max_tokens
        self.est = 0.0
        self.admit = -1
        self.finish = -1
        self.server = -1
        self.tag = 0.0
        self.seq = rid

    def __repr__(self) -> str:
        return (
            f"Request(rid={self.rid}, flow={self.flow}, arrival={self.arrival}, prompt={self.prompt}, "
            f"output={self.output}, max_tokens={self.max_tokens}, admit={self.admit})"
        )


# ---------------------------------------------------------------------- JSONL traces
#
# One JSON object per line:
#   {"arrival": 12, "flow": "alice", "prompt_tokens": 310, "output_tokens": 95, "max_tokens": 256}
# ``arrival`` is in decode steps (a float is accepted and rounded up: the request is
# visible from the first step at or after it); ``max_tokens`` is optional (default:
# ``output_tokens``). Blank lines and lines starting with ``#`` are skipped. An optional
# header line declares flows in order, with weight, class and priority:
#   {"flows": [{"name": "alice", "weight": 2.0, "class": "interactive", "priority": 0}, ...]}
# Undeclared flows follow in order of first appearance (weight 1); the caller's
# ``weights`` override both.
#
# A closed-loop client is one line with ``keep_waiting`` instead of ``arrival``:
#   {"flow": "a", "keep_waiting": 1}
#   {"flow": "b", "keep_waiting": 2, "prompt_tokens": [100, 200], "output_tokens": [50, 60],
#    "max_tokens": 64, "start": 1000, "end": 5000}
# From ``start`` (default 0) until ``end`` (default: the end of the run) the flow keeps that
# many requests waiting at the balancer at every step (see :class:`ClosedLoop`); sizes are
# the defaults (prompts U[64, 512], outputs U[32, 384], max_tokens 384) unless given as
# ``[lo, hi]`` ranges. One such line per flow; it may also send ordinary requests.

_TRACE_FIELDS = ("arrival", "flow", "prompt_tokens", "output_tokens")
_CLOSED_FIELDS = ("flow", "keep_waiting", "prompt_tokens", "output_tokens", "max_tokens", "start", "end")


def _closed_line(rec: dict[str, Any], where: str, flow_index: int, seed: int) -> ClosedLoop:
    """A ``keep_waiting`` line as a :class:`ClosedLoop`; ``ValueError`` names the line and field."""
    for k in rec:
        if k not in _CLOSED_FIELDS:
            raise ValueError(f"{where}: unknown field {k!r} in a keep_waiting line (allowed: {', '.join(_CLOSED_FIELDS)})")

    def whole(k: str, v: object, lo: int) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{where}: {k} must be an int >= {lo}, got {v!r}")
        return v

    keep = whole("keep_waiting", rec["keep_waiting"], 1)
    ranges = {}
    for k, default in (("prompt_tokens", DEFAULT_PROMPT), ("output_tokens", DEFAULT_OUTPUT)):
        v = rec.get(k, list(default))
        if (not isinstance(v, list) or len(v) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in v)
                or not 1 <= v[0] <= v[1]):
            raise ValueError(f"{where}: {k} of a keep_waiting line must be [lo, hi], ints with 1 <= lo <= hi, got {v!r}")
        ranges[k] = (int(v[0]), int(v[1]))
    max_tokens = None
    if "max_tokens" in rec:
        max_tokens = whole("max_tokens", rec["max_tokens"], 1)
        if max_tokens < ranges["output_tokens"][1]:
            raise ValueError(f"{where}: max_tokens {max_tokens} is smaller than the largest output_tokens "
                             f"{ranges['output_tokens'][1]}")
    start = whole("start", rec.get("start", 0), 0)
    end = None
    if rec.get("end") is not None:
        end = whole("end", rec["end"], 1)
        if end <= start:
            raise ValueError(f"{where}: end {end} must be after start {start}")
    return ClosedLoop(flow_index, keep, ranges["prompt_tokens"], ranges["output_tokens"], max_tokens, start, end, seed)


def read_trace_lines(
    lines: Iterable[str], weights: dict[str, float] | None = None, source: str = "<trace>", seed: int = 0
) -> Workload:
    """Parse JSONL trace lines into a :class:`Workload`; ``ValueError`` names the bad line.
    ``seed`` seeds the sizes of closed-loop clients' requests."""
    weights = dict(weights or {})
    names: dict[str, int] = {}
    declared: dict[str, FlowSpec] = {}
    cols: list[list[int]] = [[], [], [], [], []]
    closed: list[ClosedLoop] = []
    closed_at: dict[str, str] = {}
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg}): {line[:80]!r}") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a JSON object, got {rec!r}")
        if "flows" in rec:
            if names or declared:
                raise ValueError(f"{where}: the flows header must come first and only once")
            specs = rec["flows"]
            if not isinstance(specs, list):
                raise ValueError(f"{where}: 'flows' must be a list of objects, got {specs!r}")
            for spec in specs:
                if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                    raise ValueError(f"{where}: every flow needs a string 'name', got {spec!r}")
                try:
                    fs = FlowSpec(spec["name"], float(spec.get("weight", 1.0)), str(spec.get("class", "default")),
                                  spec.get("priority", 0))
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{where}: {exc}") from None
                if fs.name in declared:
                    raise ValueError(f"{where}: flow {fs.name!r} declared twice")
                declared[fs.name] = fs
                names[fs.name] = len(names)
            continue
        if "keep_waiting" in rec:
            if "flow" not in rec:
                raise ValueError(f"{where}: missing field 'flow' in {line[:120]!r}")
            flow = rec["flow"]
            if not isinstance(flow, (str, int)) or isinstance(flow, bool):
                raise ValueError(f"{where}: flow must be a string or an int, got {flow!r}")
            flow = str(flow)
            if flow in closed_at:
                raise ValueError(f"{where}: flow {flow!r} already has a keep_waiting line ({closed_at[flow]})")
            idx = names.get(flow, len(names))
            closed.append(_closed_line(rec, where, idx, seed))
            names.setdefault(flow, idx)
            closed_at[flow] = where
            continue
        for k in _TRACE_FIELDS:
            if k not in rec:
                raise ValueError(f"{where}: missing field {k!r} in {line[:120]!r}")
        flow = rec["flow"]
        if not isinstance(flow, (str, int)) or isinstance(flow, bool):
            raise ValueError(f"{where}: flow must be a string or an int, got {flow!r}")
        flow = str(flow)
        arr = rec["arrival"]
        if isinstance(arr, bool) or not isinstance(arr, (int, float)) or not math.isfinite(arr) or arr < 0:
            raise ValueError(f"{where}: arrival must be a finite number >= 0 (steps), got {arr!r}")
        ints = []
        for k in ("prompt_tokens", "output_tokens", "max_tokens"):
            v = rec.get(k, rec["output_tokens"]) if k == "max_tokens" else rec[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{where}: {k} must be an int >= 1, got {v!r}")
            ints.append(v)
        if ints[2] < ints[1]:
            raise ValueError(f"{where}: max_tokens {ints[2]} is smaller than output_tokens {ints[1]}")
        if flow not in names:
            names[flow] = len(names)
        cols[0].append(int(math.ceil(arr)))
        cols[1].append(names[flow])
        cols[2].append(ints[0])
        cols[3].append(ints[1])
        cols[4].append(ints[2])
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"weights given for flows not in {source}: {unknown}")
    flows = []
    for n in names:
        d = declared.get(n)
        if d is None:
            flows.append(FlowSpec(n, float(weights.get(n, 1.0))))
        else:
            flows.append(FlowSpec(n, float(weights.get(n, d.weight)), d.klass, d.priority))
    arrival, flow_of, prompt, output, max_tokens = cols
    return Workload.from_arrays(flows, arrival, flow_of, prompt, output, max_tokens, meta={"source": source},
                                closed=closed)


def load_trace(path: str | Path, weights: dict[str, float] | None = None, seed: int = 0) -> Workload:
    """Read a JSONL trace file (see the format above)."""
    p = Path(path)
    with p.open("r", encoding="utf-8") as fh:
        return read_trace_lines(fh, weights, source=str(p), seed=seed)


def save_trace(workload: Workload, out: str | Path | IO[str]) -> None:
    """Write ``workload`` as a JSONL trace: a flows header, then one request per line.
    Replaying it gives the same flows and requests, so the same runs."""
    names = workload.flow_names
    header = {"flows": [{"name": f.name, "weight": f.weight, "class": f.klass, "priority": f.priority}
                        for f in workload.flows]}
    lines = [json.dumps(header, separators=(", ", ": "))]
    for a, f, p, o, m in zip(
        workload.arrival.tolist(),
        workload.flow.tolist(),
        workload.prompt.tolist(),
        workload.output.tolist(),
        workload.max_tokens.tolist(),
    ):
        lines.append(
            json.dumps(
                {"arrival": a, "flow": names[f], "prompt_tokens": p, "output_tokens": o, "max_tokens": m},
                separators=(", ", ": "),
            )
        )
    for c in workload.closed:
        rec: dict[str, Any] = {"flow": names[c.flow], "keep_waiting": c.keep, "prompt_tokens": list(c.prompt),
                     "output_tokens": list(c.output), "start": c.start}
        if c.max_tokens is not None:
            rec["max_tokens"] = c.max_tokens
        if c.end is not None:
            rec["end"] = c.end
        lines.append(json.dumps(rec, separators=(", ", ": ")))
    text = "\n".join(lines) + "\n"
    if isinstance(out, (str, Path)):
        Path(out).write_text(text, encoding="utf-8")
    else:
        out.write(text)
