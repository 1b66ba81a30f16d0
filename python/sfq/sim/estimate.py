"""The cost estimate the balancer-side policies (drr, wfq, sfq) order by.

``cost = w_in * prompt + w_out * max_tokens * ratio`` (seed 000 §7.4), with ``ratio`` the
total actual output over the total ``max_tokens`` of the requests completed so far (a
prior until the first completion). The estimate is taken once, when the request reaches
the balancer, and never corrected (seed 000 §5.1). Units: weighted tokens.

If the project's ``sfq.cost.CostEstimator`` is importable and has the methods used here
(``estimate(prompt_tokens, max_tokens)`` and ``observe(max_tokens, output_tokens)``), it
is used instead of :class:`RatioEstimator`, so the simulator exercises the real one.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Estimator", "RatioEstimator", "make_estimator"]


class Estimator(Protocol):
    def estimate(self, prompt_tokens: int, max_tokens: int) -> float: ...

    def observe(self, max_tokens: int, output_tokens: int) -> None: ...


class RatioEstimator:
    """``w_in * prompt + w_out * max_tokens * ratio``, ``ratio`` calibrated from completions.

    ``prior`` is the ratio before any completion; ``calibrate=False`` keeps it fixed.
    """

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0, prior: float = 0.5, calibrate: bool = True):
        for name, v in (("input_weight", input_weight), ("output_weight", output_weight)):
            if not (v >= 0.0) or v != v or v == float("inf"):
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

    def estimate(self, prompt_tokens: int, max_tokens: int) -> float:
        c = self.input_weight * prompt_tokens + self.output_weight * max_tokens * self.ratio
        return c if c > 0.0 else 1.0

    def observe(self, max_tokens: int, output_tokens: int) -> None:
        if self.calibrate:
            self._out += output_tokens
            self._max += max_tokens


def make_estimator(input_weight: float, output_weight: float, prior: float = 0.5) -> Estimator:
    """The project's ``sfq.cost.CostEstimator`` when it fits, else :class:`RatioEstimator`."""
    try:  # pragma: no cover - depends on what has landed
        from sfq.cost import CostEstimator  # type: ignore[import-not-found]
    except ImportError:
        return RatioEstimator(input_weight, output_weight, prior)
    try:  # pragma: no cover
        est = CostEstimator(input_weight=input_weight, output_weight=output_weight)
        if callable(getattr(est, "estimate", None)) and callable(getattr(est, "observe", None)):
            return est
    except TypeError:
        pass
    return RatioEstimator(input_weight, output_weight, prior)
