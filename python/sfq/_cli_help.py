"""The words ``sfq simulate --help`` uses: every scenario, policy, trace field and output
column, in the user's terms. One place, so the help and its test cannot drift apart from
the scenario and policy tables (``tests/test_cli.py`` checks that every name in
:data:`sfq.sim.scenarios.SCENARIOS` and :data:`sfq.sim.policies.POLICIES` is explained).
It lives outside :mod:`sfq.sim` so that ``sfq --help`` imports nothing heavy. The model
behind the words is docs/simulator.md.
"""

from __future__ import annotations

__all__ = ["SUMMARY", "SCENARIOS", "POLICIES", "TRACE_FIELDS", "OUTPUT", "description", "epilog"]

SUMMARY = (
    "Simulate a fleet of continuous-batching inference servers, each with a KV-cache budget, "
    "under several scheduling policies, on the same seeded workload, and compare how fairly "
    "and how fast each one serves the clients. Time is counted in decode steps (one "
    "iteration of the engine), sizes in tokens, and service in weighted tokens: "
    "W = w_p * prompt tokens + w_q * output tokens (by default 1 and 2). The same arguments "
    "give the same output, byte for byte. Without a SCENARIO it runs the two headline "
    "scenarios, teams and return (about 4 s of CPU with plots, 1 s without)."
)

#: scenario name -> what it shows (C: one server's capacity in requests per step)
SCENARIOS: dict[str, str] = {
    "drift": (
        "Two clients, both sending more than their fair share from step 0 (Poisson arrivals "
        "at 0.9 and 0.6 of one server's capacity), one server with M = 8,192 KV tokens, "
        "20,000 steps. Shows the largest gap in service between the two (max drift) and the "
        "throughput: fair policies hold a bounded gap, FIFO's grows for as long as it runs."
    ),
    "return": (
        "Client 0 sends under its share for 3,000 steps, goes silent for 2,000, then comes "
        "back overloaded; client 1 is overloaded throughout. Measures the 600 steps after the "
        "return: the returning client's share of the service, of the cost dispatched, and the "
        "steady client's service. A policy that lets idle time be banked (lcf) hands the "
        "returning client the machine."
    ),
    "kv-sweep": (
        "drift for KV budgets M = 2,048 ... 32,768 tokens, beside the bound "
        "2 max(w_p L_input, w_q M) (L_input: the largest prompt): the bigger the batch the "
        "engine commits to, the coarser fairness can be."
    ),
    "rpm-sweep": (
        "drift's workload under FIFO with a per-client limit of 5, 20, 40 and 80 requests per "
        "\"minute\" (2,000 steps) and without one, beside the fair policies: a static rate "
        "limit trades throughput for fairness and wins on neither."
    ),
    "teams": (
        "The multi-team overload test: team A drops 400 long batch jobs at step 0, team B "
        "sends short interactive requests from step 300 (one per 20 steps on average), team C "
        "sends bursts of 24 from step 1,000 (about every 2,500 steps); 8 servers with one slot "
        "each; weights interactive 6, batch 1; prio ranks interactive first. Shows each team's "
        "wait p50/p95/p99, share of cost, and requests done."
    ),
    "shallow": (
        "Two clients that each keep exactly one request waiting at the balancer (closed loop), "
        "M = 8,192, 40,000 steps: the drift at a quarter, half and all of the run. With such "
        "shallow queues the balancer's queue often empties while the engine still works; a "
        "policy whose busy period ends then keeps resetting its fairness."
    ),
    "keep-one": (
        "Client 0 keeps one request waiting, client 1 floods (Poisson at 1.2 C), 20,000 steps: "
        "client 0's share of the service."
    ),
    "many": (
        "1,000 clients sending 5 requests each at uniform times in the first 5,000 steps, 8 "
        "servers, run until everything is done: what many short-lived flows cost."
    ),
    "trace": (
        "Replay your own arrivals from a JSONL file (--trace FILE, format below) on the fleet "
        "given by --servers, --slots and --kv (default: one server, M = 8,192); --weight "
        "FLOW=W sets a flow's weight; --steps sets a horizon (needed if a closed-loop client "
        "has no end)."
    ),
    "nested": (
        "One org's two teams: t1 of ten users, t2 of one, each user keeping two requests "
        "waiting, 20,000 steps: each team's and user's share under flat per-user SFQ (t1 gets "
        "10/11) and under nested shares, the policy's teams and users: equal (sfq-nested: "
        "each team 1/2, each t1 user 1/20)."
    ),
    "deadlines": (
        "An interactive class (TTFT objective 1 s, deadlines of 1 s or 3 s) beside two batch "
        "tenants flooding one 32-slot engine: per class the objective attainment and the batch "
        "service against FIFO's, for fifo, prio, sfq, sfq-edf (the engine with deadlines: "
        "EDF inside a flow) and sfq-edf-headroom-K (sfq-edf with the pool's limits.headroom: K, "
        "--headroom K[,K], default 3,5: the last K free slots kept for flows below their part)."
    ),
}

#: policy name -> how it decides who goes next
POLICIES: dict[str, str] = {
    "fifo": "one global queue in arrival order (in rpm-sweep also with per-client rate limits: 'rpm N')",
    "prio": "strict priority: always the most urgent level that has work (a flow's priority, 0 first; "
    "in teams the interactive class), FIFO inside a level; it protects the urgent and can starve the rest",
    "rr": "round robin over clients, one request per turn whatever its size",
    "drr": "deficit round robin: each turn a client gets --quantum weighted tokens of credit, "
    "and sends while its next request's estimated cost fits",
    "wfq": "weighted fair queueing: the smallest finish tag max(client's last finish, virtual time) "
    "+ estimated cost / weight goes first",
    "sfq": "this library's scheduler (sfq.Scheduler) as sfq.Dispatcher drives it: start-time fair "
    "queueing on estimated cost, dispatched only when a server can take the request; --charge picks "
    "what it charges (seed: the estimate, once; settle: corrected to the actual cost at completion; "
    "served: the prompt at dispatch and each output token as generated)",
    "sfq-seed": "the same core under the plain rule of docs/design.md: the estimate is charged at "
    "dispatch and never corrected, and the busy period ends when the balancer's queue empties",
    "lcf": "least counter first inside the engine: each client's counter of weighted tokens processed, "
    "smallest first, with no lift (idle time banks credit: the contrast to vtc)",
    "vtc": "the virtual token counter (Sheng et al., OSDI 2024): lcf plus the lift that raises a "
    "returning client's counter to the lowest active one",
    "vtc-h": "vtc charging w_q + --beta * context length per output token, a cost closer to memory "
    "bandwidth than to tokens",
}

#: JSONL trace fields, in the order a user writes them
TRACE_FIELDS: dict[str, str] = {
    "arrival": "step at which the request reaches the balancer (a number >= 0; rounded up)",
    "flow": "who sent it: a string or an int; flows are fairness's unit (a user, key or team)",
    "prompt_tokens": "the prompt's length, tokens (an int >= 1)",
    "output_tokens": "how many tokens it will generate (an int >= 1; the estimators do not see it)",
    "max_tokens": "the request's output cap, what the estimators see (optional; default output_tokens; "
    "never below output_tokens)",
}

TRACE_EXTRA = (
    "One JSON object per line; blank lines and lines starting with # are skipped. An optional "
    "first line declares flows, their weights, classes and priorities (for prio, 0 most urgent):\n"
    '  {"flows": [{"name": "alice", "weight": 2, "class": "chat", "priority": 0}]}\n'
    "A closed-loop client is a line with keep_waiting instead of arrival: from start (default "
    "0) to end (default: the run's end) it keeps that many requests waiting, sizes drawn from "
    "prompt_tokens and output_tokens given as [lo, hi] ranges:\n"
    '  {"flow": "b", "keep_waiting": 1, "prompt_tokens": [100, 200], "end": 5000}\n'
    "--write-trace FILE writes any scenario's workload in this format."
)

#: output columns and JSON fields
OUTPUT: dict[str, str] = {
    "max drift": "largest gap in weighted service between two clients over a stretch of steps in which "
    "both have a request waiting at the balancer (the JSON also has it on the estimated cost charged, "
    "max_drift_est, and two earlier forms for comparison: max_drift_from_start and max_interval_drift)",
    "bound": "2 max(w_p L_input, w_q M), the in-engine gap bound of Sheng et al.",
    "W/step": "throughput: weighted tokens served per step, over the whole run",
    "Jain": "Jain's fairness index of the clients' service (1 = equal)",
    "wait p50/p95/p99": "steps from arrival to start; a request never started counts until the run ends",
    "share": "a client's fraction of the service (or cost) delivered in the window measured",
}


def _items(d: dict[str, str], width: int) -> str:
    import textwrap

    out = []
    for name, text in d.items():
        lines = textwrap.wrap(text, 78 - width - 4, break_on_hyphens=False)
        out.append(f"  {name:<{width}}  {lines[0]}")
        out += [" " * (width + 4) + line for line in lines[1:]]
    return "\n".join(out)


def description() -> str:
    """The text before the options in ``sfq simulate --help``."""
    import textwrap

    return textwrap.fill(SUMMARY, 78, break_on_hyphens=False)


def epilog() -> str:
    """The text after the options in ``sfq simulate --help``."""
    import textwrap

    extra = "\n".join(
        line if line.startswith("  ") else textwrap.fill(line, 78, break_on_hyphens=False) for line in TRACE_EXTRA.split("\n")
    )
    return "\n\n".join(
        [
            "scenarios:\n" + _items(SCENARIOS, 9),
            "policies (default: those that apply to the scenario):\n" + _items(POLICIES, 8),
            "trace format (--trace FILE):\n" + _items(TRACE_FIELDS, 13) + "\n" + extra,
            "output:\n" + _items(OUTPUT, 16),
            "examples:\n"
            "  sfq simulate                          teams and return; plots in out/simulate\n"
            "  sfq simulate drift --policy sfq,vtc   two policies on one scenario\n"
            "  sfq simulate teams --json             one JSON document on stdout\n"
            "  sfq simulate trace --trace my.jsonl --weight alice=2 --no-plots",
            textwrap.fill("The model and the metrics are described in docs/simulator.md, the scheduler's "
                          "rule and its guarantees in docs/design.md.", 78),
        ]
    )
