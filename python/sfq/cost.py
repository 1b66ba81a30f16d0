"""Cost estimation for LLM requests.

A request's cost is estimated when it is dispatched (``sfq.Dispatcher`` estimates again at
dispatch, from what the calibration has learned by then)::

    cost = input_weight * prompt_tokens + output_weight * expected_output_tokens
    expected_output_tokens = n * max_tokens * ratio     (times the prompts of a batch prompt)

``ratio`` is "total actual output / total max_tokens" over completed requests: per model
once the model has ``min_model_samples`` completions, per (model, flow) once that flow has
``min_flow_samples``; ``prior_ratio`` before that. Prompt tokens are exact when the caller
gives a ``tokenizer`` (or the prompt is already token ids); otherwise the prompt's length in
characters is divided by a characters-per-token ratio calibrated per model from the
backends' ``usage.prompt_tokens`` (``chars_per_token`` before any sample).

Calibration happens only from completed requests (``observe``) and only changes the costs
of *later* requests. Whether a dispatched request's charge is corrected afterwards is the
dispatcher's charge mode (``Dispatcher(charge=...)``): ``actual_cost`` turns a usage report
into the cost the ``settle`` and ``served`` modes correct the meter to. The calibration state
can be saved to and loaded from JSON so a restarted proxy keeps it.

No single usage report can poison the calibration. Every field is checked and clamped to
what the request could have produced: ``completion_tokens`` to ``[0, max_tokens]``;
``prompt_tokens`` to ``[chars / 16, 4 * chars]`` (no tokenizer makes tokens of more than 16
characters on average, or more than one token per UTF-8 byte) and, further, to within a
factor 4 of what the current chars-per-token ratio predicts (``clamped`` counts the fields
clamped). The ratio itself is robust: the prior ``chars_per_token`` counts as 64 characters
of evidence, so the first report cannot set it alone, and one report moves it by at most its
share of the characters seen, times 4 (a chat template's own tokens on a tiny prompt
included). The output ratio needs no such care: each report is clamped to ``[0, 1]`` of its
own cap, so it moves the ratio by at most its share of the caps seen.

A saved state is validated on load: a non-finite, negative or impossible total (output above
its cap, a chars-per-token ratio outside ``[1/4, 16]``, counts that disagree) is a
``ValueError`` naming the entry and the field, and the estimator is left unchanged (a bad
state is refused, never silently repaired).

Cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``, reported by vLLM, SGLang
and the providers) count ``cached_input_weight`` prompt tokens each (default 1: like any
other). With a weight other than 1, the estimate expects the fraction of a prompt served from
a cache that the flow's (else the model's) usage reports showed, learned like the output
ratio (same sample thresholds, same bounded per-flow memory): ``charged prompt = prompt x (1 -
(1 - cached_input_weight) x cached fraction)``.

Units: tokens for every count, "cost units" for costs (whatever ``input_weight`` and
``output_weight`` make of a token; 1.0 each by default, i.e. tokens).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Hashable, Mapping, Sized
from pathlib import Path
from typing import Any

from ._common import MAX_COST
from .errors import BadRequest

__all__ = ["CostEstimator", "Estimate", "cached_tokens_of", "prompt_of"]

STATE_VERSION = 1
#: bounds of a prompt's characters per token (a report outside them is clamped into them)
MIN_CHARS_PER_TOKEN = 0.25
MAX_CHARS_PER_TOKEN = 16.0
#: one report may move a prompt's token count at most this factor away from the estimate
MAX_PROMPT_SURPRISE = 4.0
#: tokens: the most output a request may ask for (``max_tokens`` x ``n``), 2**27 (134M): beyond
#: any model's context; a request past it is a ``BadRequest``, the same under any cost weights
MAX_OUTPUT_TOKENS = 1 << 27
#: the weight of the prior chars_per_token, in characters of evidence
PRIOR_CHARS = 64.0

#: a tokenizer: text -> the number of tokens, or the tokens themselves (their len() is used)
Tokenizer = Callable[[str], "int | Sized"]


class Estimate:
    """One request's estimate. Counts in tokens, ``cost`` in cost units.

    ``prompt_tokens`` is exact when ``prompt_exact`` (tokenizer or token ids), otherwise
    ``prompt_chars / chars_per_token``. ``max_tokens`` is the request's total output cap
    (``copies * max_tokens``); ``expected_output = max_tokens * ratio``. ``copies`` is the
    number of sequences the server generates: ``n`` times the number of prompts of a batch
    (``prompt`` as a list of strings or of token-id lists).
    """

    __slots__ = ("model", "cost", "prompt_tokens", "prompt_exact", "prompt_chars", "max_tokens", "ratio",
                 "expected_output", "copies", "charged_prompt")

    def __init__(self, model: str, cost: float, prompt_tokens: float, prompt_exact: bool, prompt_chars: int,
                 max_tokens: int, ratio: float, expected_output: float, copies: int = 1,
                 charged_prompt: float | None = None) -> None:
        self.model = model
        self.cost = cost
        self.prompt_tokens = prompt_tokens
        self.prompt_exact = prompt_exact
        self.prompt_chars = prompt_chars
        self.max_tokens = max_tokens
        self.ratio = ratio
        self.expected_output = expected_output
        self.copies = copies
        #: the prompt as the charge counts it: ``prompt_tokens`` less the expected cached tokens'
        #: discount (``cached_input_weight``); ``prompt_tokens`` itself at weight 1
        self.charged_prompt = prompt_tokens if charged_prompt is None else charged_prompt

    def __repr__(self) -> str:
        return (f"Estimate(model={self.model!r}, cost={self.cost!r}, prompt_tokens={self.prompt_tokens!r}, "
                f"prompt_exact={self.prompt_exact}, prompt_chars={self.prompt_chars}, "
                f"max_tokens={self.max_tokens}, ratio={self.ratio!r}, expected_output={self.expected_output!r})")


class _Sums:
    """Running totals of one calibration key."""

    __slots__ = ("output", "cap", "n_out", "chars", "tokens", "n_prompt", "reported", "cached", "n_cache")

    def __init__(self) -> None:
        self.output = 0.0  # actual completion tokens
        self.cap = 0.0  # max_tokens asked for
        self.n_out = 0  # completed requests counted in output/cap
        self.chars = 0.0  # prompt characters (estimated prompts only)
        self.tokens = 0.0  # the backends' prompt_tokens for those prompts
        self.n_prompt = 0
        self.reported = 0.0  # prompt tokens of the usage reports (cached fraction's denominator)
        self.cached = 0.0  # of which served from a cache (prompt_tokens_details.cached_tokens)
        self.n_cache = 0  # usage reports counted in reported/cached

    def to_json(self) -> dict[str, float]:
        d = {"output": self.output, "cap": self.cap, "n_out": self.n_out,
             "chars": self.chars, "tokens": self.tokens, "n_prompt": self.n_prompt}
        if self.n_cache:
            d.update(reported=self.reported, cached=self.cached, n_cache=self.n_cache)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> _Sums:
        s = cls()
        try:
            s.output, s.cap, s.chars, s.tokens = (float(d[k]) for k in ("output", "cap", "chars", "tokens"))
            s.n_out, s.n_prompt = int(d["n_out"]), int(d["n_prompt"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(Infinity)
            raise ValueError(f"bad calibration entry {where}: {d!r} ({exc})") from None
        if min(s.output, s.cap, s.chars, s.tokens, s.n_out, s.n_prompt) < 0 or not all(
                math.isfinite(x) for x in (s.output, s.cap, s.chars, s.tokens)):
            raise ValueError(f"bad calibration entry {where}: negative or non-finite totals in {d!r}")
        try:  # (absent from states saved before cached tokens were learned)
            s.reported, s.cached, s.n_cache = float(d.get("reported", 0)), float(d.get("cached", 0)), int(d.get("n_cache", 0))
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"bad calibration entry {where}: {d!r} ({exc})") from None
        if not (math.isfinite(s.reported) and 0 <= s.cached <= s.reported * (1 + 1e-9) and s.n_cache >= 0
                and (s.n_cache == 0) == (s.reported == 0)):
            raise ValueError(f"bad calibration entry {where}: 'cached' {s.cached!r}, 'reported' {s.reported!r} and "
                             f"'n_cache' {s.n_cache!r} disagree (cached tokens are part of the prompt)")
        if s.output > s.cap * (1 + 1e-9):
            raise ValueError(f"bad calibration entry {where}: 'output' {s.output!r} exceeds 'cap' {s.cap!r} "
                             "(no server generates more than it was allowed)")
        if (s.n_out == 0) != (s.cap == 0):
            raise ValueError(f"bad calibration entry {where}: 'n_out' {s.n_out!r} and 'cap' {s.cap!r} disagree")
        if s.n_prompt or s.chars or s.tokens:
            if s.n_prompt == 0 or s.tokens <= 0 or s.chars <= 0:
                raise ValueError(f"bad calibration entry {where}: 'chars' {s.chars!r}, 'tokens' {s.tokens!r} "
                                 f"and 'n_prompt' {s.n_prompt!r} disagree")
            cpt = s.chars / s.tokens
            if not MIN_CHARS_PER_TOKEN * (1 - 1e-9) <= cpt <= MAX_CHARS_PER_TOKEN * (1 + 1e-9):
                raise ValueError(f"bad calibration entry {where}: 'chars' / 'tokens' = {cpt!r} characters per token, "
                                 f"outside [{MIN_CHARS_PER_TOKEN}, {MAX_CHARS_PER_TOKEN}]")
        return s


def _positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return v


def _count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def cached_tokens_of(usage: Mapping[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` (0 when absent or not an integer >= 0)."""
    d = usage.get("prompt_tokens_details")
    if d is None or (type(d) is not dict and not isinstance(d, Mapping)):
        return 0
    c = d.get("cached_tokens")
    return c if type(c) is int and c > 0 else 0


def prompt_of(body: Mapping[str, Any]) -> tuple[str, int]:
    """The prompt of an OpenAI request body as ``(text, token_ids_count)``.

    Completions: ``prompt`` is a string, a list of strings, a list of token ids or a list of
    lists of token ids (ids are counted, not joined). Chat: the text parts of every message's
    ``content`` (a string, or a list of parts with ``"text"``), one message per line.
    """
    if "messages" in body:
        msgs = body["messages"]
        if not isinstance(msgs, list):
            raise BadRequest(f"'messages' must be a list, got {msgs!r}", param="messages")
        parts: list[str] = []
        for m in msgs:
            if not isinstance(m, Mapping):
                raise BadRequest(f"every message must be an object, got {m!r}", param="messages")
            c = m.get("content")
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                for p in c:
                    if isinstance(p, Mapping) and isinstance(p.get("text"), str):
                        parts.append(p["text"])
            elif c is not None:
                raise BadRequest(f"message content must be a string or a list of parts, got {c!r}",
                                 param="messages")
        return "\n".join(parts), 0
    if "prompt" in body:
        p = body["prompt"]
        if isinstance(p, str):
            return p, 0
        if isinstance(p, list):
            if all(isinstance(x, str) for x in p):
                return "\n".join(p), 0
            if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
                return "", len(p)
            if all(isinstance(x, list) for x in p):
                return "", sum(len(x) for x in p)
        raise BadRequest(f"'prompt' must be a string, a list of strings or token ids, got {p!r}", param="prompt")
    raise BadRequest("the request body has neither 'prompt' (/v1/completions) nor 'messages' (/v1/chat/completions)")


class CostEstimator:
    """Prices a request before it runs, so a scheduler can charge its flow: cost =
    ``input_weight`` x prompt tokens + ``output_weight`` x expected output tokens, learning
    from completed requests how much of ``max_tokens`` each model (and flow) really uses.

    The dispatchers estimate every request with one (``Dispatcher(estimator=...)``; a policy
    file's ``cost`` section); use it alone to price requests for your own
    :class:`sfq.Scheduler`: ``est.estimate(body).cost``, then ``est.observe(estimate, usage)``
    when the reply's ``usage`` arrives. A malformed body raises
    :class:`sfq.errors.BadRequest` naming the field.

    Parameters
    ----------
    input_weight, output_weight:
        cost units per prompt token and per (expected) output token; >= 0, not both 0.
    prior_ratio:
        expected output / max_tokens before any completion of the model was seen (> 0).
        1.0 charges the full cap until calibrated.
    min_model_samples, min_flow_samples:
        completions a model (a flow, within its model) needs before its own ratio is used.
    chars_per_token:
        characters per prompt token before any calibration sample of the model (> 0).
    tokenizer:
        optional ``text -> token count`` (or ``text -> tokens``): exact prompt counts.
        Chat prompts are tokenized as their message texts joined by newlines (the template's
        own tokens are not counted).
    default_max_tokens:
        the output cap assumed when a request does not set ``max_tokens`` (>= 1).
    min_cost:
        the smallest cost handed out (> 0): the scheduler needs costs > 0.
    cached_input_weight:
        prompt tokens one cached prompt token counts as (>= 0; default 1: like any other).
    """

    def __init__(
        self,
        input_weight: float = 1.0,
        output_weight: float = 1.0,
        *,
        prior_ratio: float = 1.0,
        min_model_samples: int = 1,
        min_flow_samples: int = 20,
        chars_per_token: float = 4.0,
        tokenizer: Tokenizer | None = None,
        default_max_tokens: int = 1024,
        min_cost: float = 1.0,
        max_flows: int = 100_000,
        cached_input_weight: float = 1.0,
    ) -> None:
        self.input_weight = _positive("input_weight", input_weight, allow_zero=True)
        self.output_weight = _positive("output_weight", output_weight, allow_zero=True)
        if self.input_weight == 0 and self.output_weight == 0:
            raise ValueError("input_weight and output_weight are both 0: every cost would be 0")
        self.prior_ratio = _positive("prior_ratio", prior_ratio)
        self.min_model_samples = _count("min_model_samples", min_model_samples, 1)
        self.min_flow_samples = _count("min_flow_samples", min_flow_samples, 1)
        self.chars_per_token = _positive("chars_per_token", chars_per_token)
        if tokenizer is not None and not callable(tokenizer):
            raise TypeError(f"tokenizer must be callable, got {tokenizer!r}")
        self.tokenizer = tokenizer
        self.default_max_tokens = _count("default_max_tokens", default_max_tokens, 1)
        self.min_cost = _positive("min_cost", min_cost)
        self.max_flows = _count("max_flows", max_flows, 1)
        self.cached_input_weight = _positive("cached_input_weight", cached_input_weight, allow_zero=True)
        self._models: dict[str, _Sums] = {}
        self._flows: dict[tuple[str, Hashable], _Sums] = {}
        self.observed = 0  # completions observed
        self.ignored = 0  # completions without a usable usage report
        self.clamped = 0  # usage fields clamped to what the request could have produced
        self.epoch = 0  # bumps whenever the calibration changes: an estimate of an older epoch may be stale

    # ---------------------------------------------------------------- calibration
    def ratio(self, model: str, flow: Hashable = None) -> float:
        """The output/max_tokens ratio used now for ``model`` (and ``flow``)."""
        if flow is not None:
            f = self._flows.get((model, flow))
            if f is not None and f.n_out >= self.min_flow_samples and f.cap > 0:
                return f.output / f.cap
        m = self._models.get(model)
        if m is not None and m.n_out >= self.min_model_samples and m.cap > 0:
            return m.output / m.cap
        return self.prior_ratio

    def on_prior(self, model: str, flow: Hashable) -> bool:
        """Whether ``flow``'s requests for ``model`` are priced at the prior ratio: neither the
        flow (``min_flow_samples`` usage reports) nor the model (``min_model_samples``) has
        calibrated an output ratio yet, so an estimate is ``max_tokens`` at face value."""
        f = self._flows.get((model, flow))
        if f is not None and f.n_out >= self.min_flow_samples and f.cap > 0:
            return False
        m = self._models.get(model)
        return not (m is not None and m.n_out >= self.min_model_samples and m.cap > 0)

    def cached_fraction(self, model: str, flow: Hashable = None) -> float:
        """The fraction of a prompt expected from a cache for ``model`` (and ``flow``): the
        flow's usage reports once it has ``min_flow_samples``, else the model's once it has
        ``min_model_samples``, else 0."""
        if flow is not None:
            f = self._flows.get((model, flow))
            if f is not None and f.n_cache >= self.min_flow_samples and f.reported > 0:
                return f.cached / f.reported
        m = self._models.get(model)
        if m is not None and m.n_cache >= self.min_model_samples and m.reported > 0:
            return m.cached / m.reported
        return 0.0

    def charged_prompt(self, prompt: float, cached: float) -> float:
        """Prompt tokens as the charge counts them: ``cached`` of them at ``cached_input_weight``."""
        w = self.cached_input_weight
        return prompt if w == 1.0 or cached <= 0 else prompt - (1.0 - w) * cached

    def chars_per_token_of(self, model: str) -> float:
        """The characters-per-token ratio used now for ``model``'s estimated prompts."""
        m = self._models.get(model)
        if m is not None and m.n_prompt > 0 and m.tokens > 0 and m.chars > 0:
            return (m.chars + PRIOR_CHARS) / (m.tokens + PRIOR_CHARS / self.chars_per_token)
        return self.chars_per_token

    def estimate(self, body: Mapping[str, Any], flow: Hashable = None) -> Estimate:
        """The estimate for an OpenAI request body (``/v1/completions`` or ``/v1/chat/completions``).

        Raises :class:`sfq.errors.BadRequest` (a ``ValueError``) naming the bad field for a
        malformed body, or for one whose cost would exceed the largest cost the scheduler takes
        (``sfq.MAX_COST``); ``TypeError`` when ``body`` is not a mapping.
        """
        # fast paths use exact type checks (type(True) is bool, not int); the slow paths validate
        if type(body) is not dict and not isinstance(body, Mapping):
            raise TypeError(f"the request body must be a mapping (a JSON object), got {type(body).__name__}")
        model = body.get("model")
        if type(model) is not str:
            if model is not None:
                raise BadRequest(f"'model' must be a string, got {model!r}", param="model")
            model = ""
        mt = body.get("max_tokens")
        if type(mt) is not int or mt < 1:
            if mt is None:
                mt = body.get("max_completion_tokens")
            if mt is None:
                mt = self.default_max_tokens
            elif isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
                raise BadRequest(f"'max_tokens' must be an integer >= 1, got {mt!r}", param="max_tokens")
        n = body.get("n")
        if n is None:
            copies = 1
        elif type(n) is int and n >= 1:
            copies = n
        else:
            raise BadRequest(f"'n' must be an integer >= 1, got {n!r}", param="n")
        p = body.get("prompt")
        if type(p) is str and "messages" not in body:
            text, ids = p, 0
        else:
            text, ids = prompt_of(body)
            if "messages" not in body and type(p) is list and len(p) > 1 and not isinstance(p[0], int):
                copies *= len(p)  # a batch of prompts: the server generates n completions for each
        cap = mt * copies
        if cap > MAX_OUTPUT_TOKENS:  # (a token count, whatever the cost weights: every face answers alike)
            raise BadRequest(f"the request asks for {cap} output tokens ('max_tokens' {mt} x {copies}), more than any "
                             f"model generates (at most {MAX_OUTPUT_TOKENS}): lower max_tokens or n", param="max_tokens" if "max_tokens" in body
                             else None)
        if ids or not text:
            prompt, exact, chars = float(ids), True, 0
        elif self.tokenizer is not None:
            t = self.tokenizer(text)
            prompt = float(t if isinstance(t, int) and not isinstance(t, bool) else len(t))  # type: ignore[arg-type]
            exact, chars = True, len(text)
        else:
            chars = len(text)
            prompt, exact = chars / self.chars_per_token_of(model), False
        try:
            return self._priced(model, prompt, exact, chars, cap, copies, flow)
        except OverflowError as exc:  # the body asks for more than any request may cost
            raise BadRequest(str(exc), param="max_tokens" if "max_tokens" in body else None) from None

    def reestimate(self, estimate: Estimate, flow: Hashable = None) -> Estimate:
        """``estimate(body, flow)`` again for the request ``estimate`` was made for, with the
        calibration as it is now, without reading the body again (its prompt and its cap are
        the same; the characters per token and the output ratio are read afresh)."""
        model = estimate.model
        if estimate.prompt_exact:
            prompt = estimate.prompt_tokens
        else:
            prompt = estimate.prompt_chars / self.chars_per_token_of(model)
        return self._priced(model, prompt, estimate.prompt_exact, estimate.prompt_chars, estimate.max_tokens,
                            estimate.copies, flow)

    def estimate_tokens(self, prompt_tokens: int, max_tokens: int, *, model: str = "",
                        flow: Hashable = None) -> Estimate:
        """The estimate for a request whose prompt is known to have ``prompt_tokens`` tokens and
        which may generate up to ``max_tokens`` (the simulator's entry; a caller that counted
        the tokens itself): exactly what :meth:`estimate` gives for a body with that prompt."""
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an integer >= 0, got {prompt_tokens!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        return self._priced(model, float(prompt_tokens), True, 0, max_tokens, 1, flow)

    def _priced(self, model: str, prompt: float, exact: bool, chars: int, cap: int, copies: int,
                flow: Hashable) -> Estimate:
        ratio = self.ratio(model, flow)
        expected = cap * ratio
        charged = prompt
        if self.cached_input_weight != 1.0:  # (weight 1: the cached fraction changes nothing)
            charged = self.charged_prompt(prompt, prompt * self.cached_fraction(model, flow))
        cost = self.input_weight * charged + self.output_weight * expected
        if cost < self.min_cost:
            cost = self.min_cost
        elif cost > MAX_COST:
            raise OverflowError(f"the request asks for too much output: its estimated cost {cost!r} exceeds the "
                                f"largest cost {MAX_COST:.0f}; lower max_tokens or n")
        return Estimate(model, cost, prompt, exact, chars, cap, ratio, expected, copies, charged)

    def observe(self, estimate: Estimate, usage: Mapping[str, Any] | None, flow: Hashable = None) -> bool:
        """Feed one completed request's ``usage`` (OpenAI: ``prompt_tokens``, ``completion_tokens``)
        into the calibration. Returns False (and counts it in ``ignored``) when ``usage`` is missing
        or malformed. Changes only the costs of later estimates."""
        comp = usage.get("completion_tokens") if type(usage) is dict or isinstance(usage, Mapping) else None
        if type(comp) is not int or comp < 0:
            self.ignored += 1
            return False
        # no server generates more than the cap it was given: a larger report is clamped, so one
        # absurd usage report cannot drive the ratio above 1 (or to infinity) for everyone
        if comp > estimate.max_tokens:
            comp = estimate.max_tokens
            self.clamped += 1
        self.observed += 1
        self.epoch += 1
        model = estimate.model
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _Sums()
        m.output += comp
        m.cap += estimate.max_tokens
        m.n_out += 1
        learn = [m]
        if flow is not None:
            key = (model, flow)
            f = self._flows.get(key)
            if f is None:
                if len(self._flows) >= self.max_flows:
                    self._prune_flows()
                f = self._flows[key] = _Sums()
            f.output += comp
            f.cap += estimate.max_tokens
            f.n_out += 1
            learn.append(f)
        pt = usage.get("prompt_tokens")  # type: ignore[union-attr]
        if type(pt) is int and pt > 0:  # the cached fraction: learned per model and flow, like the ratio
            cached = min(cached_tokens_of(usage), pt)  # type: ignore[arg-type]
            for s in learn:
                s.reported += pt
                s.cached += cached
                s.n_cache += 1
        chars = estimate.prompt_chars
        if not estimate.prompt_exact and chars > 0 and type(pt) is int and pt > 0:
            if m.n_prompt > 0 and m.tokens > 0:  # chars_per_token_of(model), inline
                cpt = (m.chars + PRIOR_CHARS) / (m.tokens + PRIOR_CHARS / self.chars_per_token)
            else:
                cpt = self.chars_per_token
            expect = chars / cpt
            lo = expect / MAX_PROMPT_SURPRISE
            if lo < chars / MAX_CHARS_PER_TOKEN:
                lo = chars / MAX_CHARS_PER_TOKEN
            hi = expect * MAX_PROMPT_SURPRISE
            if hi > chars / MIN_CHARS_PER_TOKEN:
                hi = chars / MIN_CHARS_PER_TOKEN
            tokens = float(pt)
            if not lo <= tokens <= hi:
                tokens = min(max(tokens, lo), hi)
                self.clamped += 1
            m.chars += chars
            m.tokens += tokens
            m.n_prompt += 1
        return True

    def actual_cost(self, estimate: Estimate, usage: Mapping[str, Any] | None) -> float | None:
        """The cost of a finished request from the server's ``usage`` report, in cost units
        (``input_weight * prompt_tokens + output_weight * completion_tokens``), or ``None`` when
        the report has no usable ``completion_tokens``. Clamped like ``observe``: output to
        ``[0, max_tokens]``, prompt tokens to within a factor 4 of the estimate (plus 64 for a
        chat template's own tokens; the estimate when the report has none), so one absurd
        report cannot move a meter by more than the request could have cost."""
        if type(usage) is not dict and not isinstance(usage, Mapping):
            return None
        comp = usage.get("completion_tokens")
        if type(comp) is not int or comp < 0:
            return None
        if comp > estimate.max_tokens:
            comp = estimate.max_tokens
        prompt = estimate.prompt_tokens
        pt = usage.get("prompt_tokens")
        if type(pt) is int and pt >= 0:
            lo = prompt / MAX_PROMPT_SURPRISE
            hi = prompt * MAX_PROMPT_SURPRISE + PRIOR_CHARS
            reported = float(pt)
            prompt = lo if pt < lo else hi if pt > hi else reported
            if self.cached_input_weight != 1.0 and pt > 0:  # cached tokens: their share of the (clamped) prompt
                prompt = self.charged_prompt(prompt, prompt * min(cached_tokens_of(usage), pt) / reported)
        cost = self.input_weight * prompt + self.output_weight * comp
        return self.min_cost if cost < self.min_cost else MAX_COST if cost > MAX_COST else cost

    def _prune_flows(self) -> None:
        """Keep per-flow calibration bounded (``max_flows``): drop down to 90% of it, first the
        flows with too few samples to be used yet, then the oldest; estimates for a dropped
        flow fall back to its model's ratio."""
        excess = len(self._flows) - int(self.max_flows * 0.9)
        unused = [k for k, f in self._flows.items() if f.n_out < self.min_flow_samples][:excess]
        for k in unused:
            del self._flows[k]
        excess -= len(unused)
        if excess > 0:
            for k in list(self._flows)[:excess]:
                del self._flows[k]

    # ---------------------------------------------------------------- persistence
    def state(self) -> dict[str, Any]:
        """The calibration as a JSON-ready dict. Flow ids must be JSON values (str, int, float,
        bool, None) or tuples of them; anything else raises ``TypeError`` naming the flow."""
        flows = []
        for (model, flow), s in self._flows.items():
            flows.append({"model": model, "flow": _flow_to_json(flow), **s.to_json()})
        return {
            "version": STATE_VERSION,
            "models": {model: s.to_json() for model, s in self._models.items()},
            "flows": flows,
            "observed": self.observed,
            "ignored": self.ignored,
            "clamped": self.clamped,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Replace the calibration with ``state`` (from ``state()``). Validates everything first:
        on a bad state it raises ``ValueError`` and the estimator is unchanged."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, Mapping) else state
            raise ValueError(f"not an sfq cost-estimator state of version {STATE_VERSION}: version {got!r}")
        models_in = state.get("models", {})
        flows_in = state.get("flows", [])
        if not isinstance(models_in, Mapping) or not isinstance(flows_in, list):
            raise ValueError("bad cost-estimator state: 'models' must be an object and 'flows' a list")
        models = {str(k): _Sums.from_json(v, f"for model {k!r}") for k, v in models_in.items()}
        flows: dict[tuple[str, Hashable], _Sums] = {}
        for entry in flows_in:
            if not isinstance(entry, Mapping) or "model" not in entry or "flow" not in entry:
                raise ValueError(f"bad flow entry in cost-estimator state: {entry!r}")
            key = (str(entry["model"]), _flow_from_json(entry["flow"]))
            flows[key] = _Sums.from_json(entry, f"for flow {key[1]!r} of model {key[0]!r}")
        observed, ignored, clamped = state.get("observed", 0), state.get("ignored", 0), state.get("clamped", 0)
        if not all(type(c) is int and c >= 0 for c in (observed, ignored, clamped)):
            raise ValueError(f"bad counters in cost-estimator state: observed={observed!r} ignored={ignored!r} "
                             f"clamped={clamped!r}")
        self._models, self._flows = models, flows
        self.observed, self.ignored, self.clamped = observed, ignored, clamped
        self.epoch += 1

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the calibration to ``path`` as JSON (atomically: a temporary file, then a rename)."""
        data = json.dumps(self.state(), indent=1, sort_keys=True)
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def load(self, path: str | os.PathLike[str]) -> None:
        """Replace the calibration with the one saved at ``path`` (see ``restore``)."""
        with open(path, encoding="utf-8") as fh:
            try:
                state = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {exc}") from None
        self.restore(state)


_JSON_SCALARS = (str, int, float, bool, type(None))


def _flow_to_json(flow: Hashable) -> Any:
    if isinstance(flow, _JSON_SCALARS):
        if isinstance(flow, float) and not math.isfinite(flow):
            raise TypeError(f"flow id {flow!r} cannot be saved as JSON")
        return flow
    if isinstance(flow, tuple):
        return [_flow_to_json(x) for x in flow]
    raise TypeError(f"flow id {flow!r} cannot be saved as JSON (use str, int, float, bool, None or tuples of them)")


def _flow_from_json(value: Any) -> Hashable:
    if isinstance(value, list):
        return tuple(_flow_from_json(x) for x in value)
    if isinstance(value, _JSON_SCALARS):
        return value
    raise ValueError(f"bad flow id in cost-estimator state: {value!r}")

