"""The cost estimate the balancer-side policies (drr, wfq, sfq) order by.

``cost = w_p * prompt + w_q * max_tokens * ratio`` (docs/design.md §4), ``ratio`` being the
actual output over ``max_tokens`` of the requests completed so far (a prior before any).
The estimate is stamped on a request when it reaches the balancer and never corrected
(docs/design.md §4); completions only change the estimates of later requests. Units:
weighted tokens, the same units as the service ``W``.

:func:`make_estimator` uses the project's own :class:`sfq.cost.CostEstimator` (calibrated
per model and, after enough completions, per flow) through its token-count entry,
``estimate_tokens(prompt_tokens, max_tokens)``: one estimator for the library and the
simulator. :class:`RatioEstimator` is the small stand-alone form the engine uses when a run
is given no estimator.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Estimator", "RatioEstimator", "ProjectEstimator", "make_estimator"]


class Estimator(Protocol):
    def estimate(self, r: Any) -> float:
        """The cost of request ``r`` (``r.prompt``, ``r.max_tokens``, ``r.flow``)."""

    def observe(self, r: Any) -> None:
        """``r`` completed with ``r.output`` tokens."""


class RatioEstimator:
    """``w_p * prompt + w_q * max_tokens * ratio``, one ratio calibrated from completions.

    ``prior`` is the ratio before any completion; ``calibrate=False`` keeps it fixed.
    """

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0, prior: float = 0.5,
                 calibrate: bool = True):
        for name, v in (("input_weight", input_weight), ("output_weight", output_weight)):
            if not (v >= 0.0) or v == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not (0.0 < prior <= 1.0):
            raise ValueError(f"prior ratio must be in (0, 1], got {prior!r}")
        self.input_weight = float(input_weight)
        self.output_weight = float(output_weight)
        self.prior = float(prior)
        self.calibrate = calibrate
        self._out = 0
        self._max = 0

    @property
    def ratio(self) -> float:
        """Expected output tokens per ``max_tokens`` token."""
        return self._out / self._max if self._max else self.prior

    def estimate(self, r: Any) -> float:
        c = self.input_weight * r.prompt + self.output_weight * r.max_tokens * self.ratio
        return c if c >= 1.0 else 1.0

    def observe(self, r: Any) -> None:
        if self.calibrate:
            self._out += r.output
            self._max += r.max_tokens


class ProjectEstimator:
    """Adapts :class:`sfq.cost.CostEstimator` to simulated requests (exact prompt counts,
    per-flow calibration after ``min_flow_samples`` completions of that flow)."""

    MODEL = "sim"

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0, prior: float = 0.5,
                 min_flow_samples: int = 20):
        from sfq.cost import CostEstimator

        self.inner = CostEstimator(
            input_weight=input_weight,
            output_weight=output_weight,
            prior_ratio=prior,
            min_flow_samples=min_flow_samples,
        )
        self._pending: dict[int, Any] = {}  # rid -> Estimate, until the request completes

    def estimate(self, r: Any) -> float:
        e = self.inner.estimate_tokens(r.prompt, r.max_tokens, model=self.MODEL, flow=r.flow)
        self._pending[r.rid] = e
        return float(e.cost)

    def observe(self, r: Any) -> None:
        e = self._pending.pop(r.rid)
        self.inner.observe(e, {"completion_tokens": r.output, "prompt_tokens": r.prompt}, r.flow)


def make_estimator(input_weight: float, output_weight: float, prior: float = 0.5) -> Estimator:
    """The project's estimator, :class:`sfq.cost.CostEstimator`, as the simulator uses it."""
    return ProjectEstimator(input_weight, output_weight, prior)
