"""Helpers of the policy tests: the API.md example file, a hand-stepped clock, policies from fragments."""

from __future__ import annotations

import textwrap

from sfq.policy import Policy, parse_policy

EXAMPLE = textwrap.dedent("""\
    pools:
      local-gpu:
        models: [llama-3-8b]
        backends:
          - {url: "http://127.0.0.1:8001", max_in_flight: 16}
        limits:
          requests_per_minute: 900
          tokens_per_minute: 180000
          max_in_flight: 24
    classes:
      system:      {strict: true, max_in_flight: 2, max_queue_length: 50, max_queue_age_seconds: 5}
      interactive: {weight: 6, max_queue_length: 2000, max_queue_age_seconds: 45}
      batch:       {weight: 1, max_queue_age_seconds: 7200}
    orgs:
      analytics:
        keys: ["sk-analytics-1"]
        classes: [batch, interactive]
        weight: 1
        max_in_flight: 8
        requests_per_minute: 600
      product:
        keys: ["sk-product-1"]
        classes: [interactive, system]
    cost: {input_weight: 1, output_weight: 2}
    retry: {max_attempts: 3, budget_per_flow_percent: 10, backoff: exponential_with_jitter,
            base_seconds: 0.5, max_seconds: 30}
    """)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def policy(pools: str = "", classes: str = "", orgs: str = "", extra: str = "") -> Policy:
    """A policy from YAML fragments (defaults: one pool p with model m and one backend)."""
    pools = pools or """
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 4}]
    """
    classes = classes or """
      batch: {weight: 1}
    """
    orgs = orgs or """
      a: {keys: [ka], classes: [batch]}
    """
    text = ("pools:" + textwrap.indent(textwrap.dedent(pools), "  ") + "\nclasses:"
            + textwrap.indent(textwrap.dedent(classes), "  ") + "\norgs:" + textwrap.indent(textwrap.dedent(orgs), "  ")
            + "\n" + textwrap.dedent(extra))
    return parse_policy(text)
