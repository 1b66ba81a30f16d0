"""Nested shares (issue 30): the policy's ``teams``, ``users`` and ``max_users``, the flows they
make, and the tree of schedulers that serves them (``sfq.engine.tree``), on both cores.

The fairness bound checked here is the one docs/design.md ("Nested shares") derives: at every
node of the tree, two children backlogged over an interval receive normalised service (the
cost of the leaves below them, divided by their weight at that node) within
``c_max / w_i + c_max / w_j`` of each other, ``c_max`` the largest cost of one request.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_helpers import Clock

from sfq.engine import PolicyEngine, Request
from sfq.errors import BadRequest, PolicyError, Refused
from sfq.policy import Flow, parse_policy
from sfq.policy.classify import Classifier, check_user

POOL = """\
pools:
  p:
    models: [m]
    backends: [{url: "http://127.0.0.1:9", max_in_flight: 1}]
classes:
  batch: {weight: 1}
  interactive: {weight: 3}
"""

ACME = POOL + """\
orgs:
  acme:
    weight: 2
    classes: [batch, interactive]
    users: equal
    teams:
      research: {weight: 1, keys: ["sk-acme-research"]}
      product: {weight: 3, keys: ["sk-acme-product"], max_users: 5}
  globex:
    keys: ["sk-globex"]
    classes: [batch]
"""

HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------ the policy file
def test_teams_and_users_parse() -> None:
    pol = parse_policy(ACME)
    acme = pol.orgs["acme"]
    assert pol.nested and acme.nested and acme.users
    assert [t.name for t in acme.teams.values()] == ["research", "product"]
    assert acme.teams["product"].weight == 3.0 and acme.teams["product"].max_users == 5
    assert acme.teams["research"].max_users == 1000 and acme.key_digests == ()
    assert not pol.orgs["globex"].nested


def test_a_file_without_teams_or_users_is_flat() -> None:
    pol = parse_policy(POOL + "orgs:\n  a: {keys: [ka], classes: [batch]}\n")
    assert not pol.nested and not pol.orgs["a"].teams and not pol.orgs["a"].users


@pytest.mark.parametrize(("orgs", "path", "problem"), [
    ("acme: {classes: [batch], teams: {research: {weight: 0, keys: [k]}}}",
     "orgs.acme.teams.research.weight", "must be a number > 0, got 0"),
    ("acme: {classes: [batch], teams: {research: {weight: -1, keys: [k]}}}",
     "orgs.acme.teams.research.weight", "must be a number > 0, got -1"),
    ("acme: {classes: [batch], teams: {research: {keys: [k], colour: red}}}",
     "orgs.acme.teams.research.colour", "unknown key"),
    ("acme: {classes: [batch], teams: [research]}", "orgs.acme.teams", "must be a mapping of names"),
    ("acme: {classes: [batch], teams: {}}", "orgs.acme.teams", "must name at least one entry"),
    ("acme: {classes: [batch], users: everyone, keys: [k]}", "orgs.acme.users", "must be 'equal'"),
    ("acme: {classes: [batch], users: equal, max_users: 0, keys: [k]}", "orgs.acme.max_users",
     "must be an integer >= 1, got 0"),
    ("acme: {classes: [batch], max_users: 5, keys: [k]}", "orgs.acme.max_users", "applies only with users: equal"),
    ("acme: {classes: [batch], teams: {r: {keys: [k], max_users: 3}}}", "orgs.acme.teams.r.max_users",
     "applies only with users: equal"),
    ("acme: {classes: [batch], keys: [k0], teams: {r: {keys: [k]}}}", "orgs.acme.keys[0]",
     "an org with teams gives its keys to its teams"),
    ("acme: {classes: [batch], teams: {r: {keys: [k, k]}}}", "orgs.acme.teams.r.keys[1]", "listed twice"),
])
def test_bad_nested_fields_name_their_path(orgs: str, path: str, problem: str) -> None:
    with pytest.raises(PolicyError) as ei:
        parse_policy(POOL + "orgs:\n  " + orgs + "\n")
    assert ei.value.path == path, str(ei.value)
    assert problem in str(ei.value)


def test_a_key_in_two_teams_is_refused() -> None:
    with pytest.raises(PolicyError) as ei:
        parse_policy(POOL + """\
orgs:
  acme:
    classes: [batch]
    teams:
      research: {keys: [shared]}
      product: {keys: [mine, shared]}
""")
    assert ei.value.path == "orgs.acme.teams.product.keys[1]"
    assert "already the key of team 'research' of org 'acme'" in str(ei.value)


def test_a_team_key_that_is_another_orgs_key_is_refused() -> None:
    with pytest.raises(PolicyError) as ei:
        parse_policy(POOL + """\
orgs:
  globex: {keys: [shared], classes: [batch]}
  acme: {classes: [batch], teams: {research: {keys: [shared]}}}
""")
    assert ei.value.path == "orgs.acme.teams.research.keys[0]"
    assert "already the key of org 'globex'" in str(ei.value)


def test_nested_shares_with_a_shared_ledger_are_accepted_at_load() -> None:
    """Several gateways run nested shares as one does (the fleet's decider runs the engine's
    tree: docs/design.md §5a.1); tests/state and tests/fleet run them through Redis."""
    pol = parse_policy(ACME + 'state: {redis: "redis://127.0.0.1:6379/0"}\n')
    assert pol.nested and pol.state is not None and pol.state.redis


# ------------------------------------------------------------------ who a request is
def test_the_key_names_the_team_and_the_header_the_user() -> None:
    cl = Classifier(parse_policy(ACME))
    f = cl.classify("sk-acme-research", None, "m", user="ana")
    assert f == Flow("acme", "batch", "p", "research", "ana") and (f.team, f.user) == ("research", "ana")
    anon = cl.classify("sk-acme-product", "interactive", "m")
    assert anon.team == "product" and anon.user is not None and anon.user.startswith("key:")
    assert "sk-acme" not in anon.user  # the key itself is never kept
    assert cl.classify("sk-globex", None, "m", user="ana") == ("globex", "batch", "p")  # a flat org: no user


def test_flat_flows_keep_their_equality_and_hash() -> None:
    f = Flow("a", "b", "c")
    assert f == ("a", "b", "c") and hash(f) == hash(("a", "b", "c")) and len(f) == 3
    assert (f.team, f.user) == (None, None) and f.flat is f
    g = Flow("a", "b", "c", team="t", user="u")
    assert g != f and g.flat == f and repr(g) == "Flow(org='a', cls='b', pool='c', team='t', user='u')"


def test_an_embedders_nested_flow_is_checked() -> None:
    cl = Classifier(parse_policy(ACME))
    assert cl.check(Flow("acme", "", "p", team="product", user="bo")) == ("acme", "batch", "p", "product", "bo")
    assert cl.check(Flow("acme", "batch", "p", team="product")).user == ""  # no user named: one user
    with pytest.raises(Refused, match="no team 'ops'"):
        cl.check(Flow("acme", "batch", "p", team="ops", user="bo"))
    with pytest.raises(Refused, match="no team None"):
        cl.check(Flow("acme", "batch", "p"))
    with pytest.raises(Refused, match="has no teams"):
        cl.check(Flow("globex", "batch", "p", team="x", user="y"))


@pytest.mark.parametrize("bad", ["", "x" * 129, "é" * 65, "a\nb", "a\x00", "a\x7f"])
def test_a_bad_user_is_a_bad_request_naming_the_header(bad: str) -> None:
    with pytest.raises(BadRequest) as ei:
        check_user(bad)
    assert ei.value.param == "X-SFQ-User" and "X-SFQ-User" in str(ei.value)


def test_a_good_user_passes() -> None:
    assert check_user("y" * 128) == "y" * 128 and check_user("Ana María") == "Ana María"


# ------------------------------------------------------------------ the tree's decisions
def _drain(e: PolicyEngine, n: int) -> list[Request]:
    out: list[Request] = []
    while len(out) < n:
        started = e.poll()
        if not started:
            break
        for r in started:
            out.append(r)
            e.complete(r)
    return out


def _flat_and_degenerate(weights: Sequence[float]) -> tuple[str, str]:
    """The same orgs twice: flat, and each with one team (holding its key) of one user."""
    flat = POOL + "orgs:\n" + "".join(
        f"  o{i}: {{keys: [k{i}], weight: {w}, classes: [batch, interactive]}}\n" for i, w in enumerate(weights))
    nested = POOL + "orgs:\n" + "".join(
        f"  o{i}: {{weight: {w}, classes: [batch, interactive], users: equal, teams: {{only: {{keys: [k{i}]}}}}}}\n"
        for i, w in enumerate(weights))
    return flat, nested


@HYP
@given(weights=st.lists(st.sampled_from([1, 2, 3, 0.5]), min_size=2, max_size=4),
       events=st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(1, 400), st.integers(1, 300),
                                 st.integers(0, 3)), min_size=1, max_size=60),
       charge=st.sampled_from(["served", "settle", "seed"]))
def test_a_tree_of_single_children_decides_as_the_flat_file(core: Callable[[], Any], weights: list[float],
                                                            events: list[tuple[int, bool, int, int, int]],
                                                            charge: str) -> None:
    """A file without teams or users means what it meant: the same event sequence through the
    flat file and through the file whose orgs each have one team of one user (every inner node
    of the tree has one child) starts the same requests in the same order, every time, with
    charges corrected at dispatch and at settlement."""
    flat, nested = _flat_and_degenerate(weights)
    runs: list[list[tuple[int, int]]] = []
    for text, nest in ((flat, False), (nested, True)):
        pol = parse_policy(text.replace("classes:\n", f"cost: {{charge: {charge}}}\nclasses:\n", 1))
        e = PolicyEngine(pol, clock=Clock(), scheduler=core)
        order: list[tuple[int, int]] = []
        label: dict[int, tuple[int, int]] = {}
        running: list[Request] = []
        for n, (org, inter, prompt, out_tokens, polls) in enumerate(events):
            o = org % len(weights)
            cls = "interactive" if inter else "batch"
            f = Flow(f"o{o}", cls, "p", "only", "one") if nest else Flow(f"o{o}", cls, "p")
            est = e.estimator.estimate_tokens(prompt, 300)
            r = e.submit(f, estimate=est)
            label[r.id] = (o, n)
            for _ in range(polls):
                running += e.poll()
                if running:
                    r0 = running.pop(0)
                    order.append(label[r0.id])
                    e.complete(r0, {"prompt_tokens": prompt, "completion_tokens": out_tokens})
        while True:
            running += e.poll()
            if not running:
                break
            r0 = running.pop(0)
            order.append(label[r0.id])
            e.complete(r0, {"prompt_tokens": 10, "completion_tokens": 10})
        runs.append(order)
    assert runs[0] == runs[1]


def _tree_policy(orgs: list[tuple[float, list[tuple[float, int]]]]) -> str:
    lines = [POOL, "orgs:\n"]
    for i, (w, teams) in enumerate(orgs):
        lines.append(f"  o{i}:\n    weight: {w}\n    classes: [batch]\n    users: equal\n    teams:\n")
        for j, (tw, _) in enumerate(teams):
            lines.append(f"      t{j}: {{weight: {tw}, keys: [k{i}-{j}]}}\n")
    return "".join(lines)


TREES = st.lists(st.tuples(st.sampled_from([1, 2, 3]),
                           st.lists(st.tuples(st.sampled_from([1, 2, 4]), st.integers(1, 4)), min_size=1,
                                    max_size=3)),
                 min_size=1, max_size=3)


@HYP
@given(tree=TREES, seed=st.integers(0, 2**32 - 1))
def test_every_node_gets_its_weighted_share_within_the_bound(core: Callable[[], Any],
                                                             tree: list[tuple[float, list[tuple[float, int]]]],
                                                             seed: int) -> None:
    """Everyone backlogged, costs random in [1, C]: at every node, any two children's normalised
    service differs by at most C/w_i + C/w_j after every dispatch (docs/design.md)."""
    rng = random.Random(seed)
    C = 50.0
    pol = parse_policy(_tree_policy(tree))
    e = PolicyEngine(pol, clock=Clock(), scheduler=core)
    leaves = [Flow(f"o{i}", "batch", "p", f"t{j}", f"u{k}")
              for i, (_, teams) in enumerate(tree) for j, (_, users) in enumerate(teams) for k in range(users)]
    per_leaf = 30
    for f in leaves:
        for _ in range(per_leaf):
            e.submit(f, cost=float(rng.randint(1, int(C))))
    served: dict[tuple[Any, ...], float] = defaultdict(float)  # node path -> cost of the leaves below it
    left = {f: per_leaf for f in leaves}
    while all(left.values()):
        (r,) = _drain(e, 1)
        f = r.flow
        left[f] -= 1
        for node in ((f.org,), (f.org, f.team), (f.org, f.team, f.user)):
            served[node] += r.cost
        _check_bound(tree, served, C)


def _check_bound(tree: list[tuple[float, list[tuple[float, int]]]], served: dict[tuple[Any, ...], float],
                 C: float) -> None:
    def pairs(kids: list[tuple[tuple[Any, ...], float]]) -> None:
        for a, wa in kids:
            for b, wb in kids:
                gap = served[a] / wa - served[b] / wb
                assert gap <= C / wa + C / wb + 1e-6, (a, b, served[a], served[b], wa, wb)

    pairs([((f"o{i}",), float(w)) for i, (w, _) in enumerate(tree)])
    for i, (_, teams) in enumerate(tree):
        pairs([((f"o{i}", f"t{j}"), float(tw)) for j, (tw, _) in enumerate(teams)])
        for j, (_, users) in enumerate(teams):
            pairs([((f"o{i}", f"t{j}", f"u{k}"), 1.0) for k in range(users)])


@HYP
@given(idle_for=st.integers(1, 60), level=st.sampled_from(["user", "team"]), seed=st.integers(0, 2**32 - 1))
def test_no_credit_for_idling_at_any_level(core: Callable[[], Any], idle_for: int, level: str, seed: int) -> None:
    """A user (or a whole team) that goes idle while its peers are served and comes back joins
    at ``S = max(S, v)`` at its parent: from its return on, it never leads its peer by more
    than the bound; it gets no burst for the time it was away."""
    rng = random.Random(seed)
    C = 40.0
    pol = parse_policy(_tree_policy([(1, [(1, 2), (1, 1)])]))
    e = PolicyEngine(pol, clock=Clock(), scheduler=core)
    u0, u1, v0 = (Flow("o0", "batch", "p", "t0", "u0"), Flow("o0", "batch", "p", "t0", "u1"),
                  Flow("o0", "batch", "p", "t1", "v0"))
    back = [u1] if level == "user" else [u0, u1]
    for f in back:  # served first, then away
        e.submit(f, cost=float(rng.randint(1, int(C))))
    for f in ([u0, v0] if level == "user" else [v0]):  # the ones that stay
        for _ in range(idle_for + 80):
            e.submit(f, cost=float(rng.randint(1, int(C))))
    _drain(e, idle_for + 2 * len(back))  # meanwhile u1 (or all of t0) has nothing waiting
    for f in back:
        for _ in range(40):
            e.submit(f, cost=float(rng.randint(1, int(C))))
    returner, peer = ("u1", "u0") if level == "user" else ("t0", "t1")
    got: dict[str, float] = defaultdict(float)
    for r in _drain(e, 60):
        got[str(r.flow.user if level == "user" else r.flow.team)] += r.cost
        assert got[returner] - got[peer] <= 2 * C + 1e-6, dict(got)


def test_an_idle_users_queue_is_dropped_and_it_rejoins_at_max_s_v(core: Callable[[], Any]) -> None:
    """A user with nothing waiting or running is not live: its queue is dropped (memory follows
    live users) and the engine no longer counts it. Dropping is safe: if it comes back while
    its meter is still ahead of its team's v, the core still holds the meter and it rejoins at
    ``max(S, v)`` (behind a peer it had outrun), and if it comes back later it starts at v,
    which is what max(S, v) gives then too."""
    pol = parse_policy(_tree_policy([(1, [(1, 2)])]))
    e = PolicyEngine(pol, clock=Clock(), scheduler=core)
    u0, u1 = Flow("o0", "batch", "p", "t0", "u0"), Flow("o0", "batch", "p", "t0", "u1")
    big = e.submit(u0, cost=100.0)
    for _ in range(3):
        e.submit(u1, cost=10.0)
    first = _drain(e, 1)
    assert first == [big]
    q = e.queues["p"]
    assert u0 not in q.flows and ("o0", "t0") in e.users and "u0" not in e.users[("o0", "t0")]
    e.submit(u0, cost=10.0)  # back at once: its meter (100 ahead) still counts
    order = [r.flow.user for r in _drain(e, 4)]
    assert order == ["u1", "u1", "u1", "u0"], order
    assert not q.flows.get(u0) and not e.users


def test_max_users_refuses_a_new_user_with_its_reason(core: Callable[[], Any]) -> None:
    pol = parse_policy(ACME)
    e = PolicyEngine(pol, clock=Clock(), scheduler=core)
    for i in range(5):
        e.submit(Flow("acme", "batch", "p", "product", f"u{i}"), cost=1.0)
    e.submit(Flow("acme", "batch", "p", "product", "u0"), cost=1.0)  # a live user may add more
    e.submit(Flow("acme", "batch", "p", "research", "u9"), cost=1.0)  # another team: its own limit
    with pytest.raises(Refused) as ei:
        e.submit(Flow("acme", "batch", "p", "product", "u5"), cost=1.0)
    assert ei.value.reason == "too_many_users" and ei.value.http_status == 429
    assert "team 'product' of org 'acme'" in str(ei.value) and "(max_users)" in str(ei.value)
    assert e.metrics.flows[("acme", "batch", "p")].refused_by == {"too_many_users": 1}
    _drain(e, 7)
    e.submit(Flow("acme", "batch", "p", "product", "u5"), cost=1.0)  # the others are done: room again


def test_check_config_shows_teams(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from sfq.cli import main

    f = tmp_path / "acme.yaml"
    f.write_text(ACME)
    assert main(["check-config", str(f), "--plain"]) == 0
    out = capsys.readouterr().out
    assert "acme  2 teams" in out and "2 teams, users in 1 orgs)" in out
    assert "no keys" not in out  # its keys are its teams'
    assert main(["check-config", str(f), "--plain", "--flows"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("acme  ")]
    assert ["acme", "research", "1", "25.0%", "equal,", "max_users", "1000"] in rows
    assert ["acme", "product", "3", "75.0%", "equal,", "max_users", "5"] in rows


# ------------------------------------------------------------------ the embedder's API
async def test_an_embedder_submits_nested_flows_and_keys_name_teams() -> None:
    """``sfq.PolicyDispatcher`` takes the same identity as the gateway: ``sfq.Flow(org, cls,
    pool, team=, user=)`` checked by the policy, or a team's key; counters stay per (org,
    class, pool)."""
    import random as _random

    from fake_openai import FakeOpenAI

    from sfq.dispatch import PolicyDispatcher

    up = FakeOpenAI()
    await up.start()
    try:
        text = ACME.replace('"http://127.0.0.1:9"', f'"{up.url}"')
        async with PolicyDispatcher(parse_policy(text), rng=_random.Random(1)) as pd:
            body = {"model": "m", "prompt": "hello", "max_tokens": 2}
            await pd.submit_flow(Flow("acme", "batch", "p", team="research", user="ana"), body)
            await pd.submit("sk-acme-product", body)  # the key names the team; the user: the key's
            with pytest.raises(Refused) as ei:
                await pd.submit_flow(Flow("acme", "batch", "p", team="ops", user="ana"), body)
            assert ei.value.reason == "unknown_org"
            row = pd.stats()["flows"]["acme/batch/p"]
            assert row["completed"] == 2
            assert not pd.engine.users  # both done: no live user left
    finally:
        await up.stop()


def test_memory_follows_live_users(core: Callable[[], Any]) -> None:
    """500 users come and go, one request each: afterwards the pool, the tree and the engine
    hold nothing of any of them (a stream of invented users does not grow the gateway)."""
    pol = parse_policy(_tree_policy([(1, [(1, 1)])]))
    e = PolicyEngine(pol, clock=Clock(), scheduler=core)
    q = e.queues["p"]
    before = set(q.flows)
    for i in range(500):
        e.submit(Flow("o0", "batch", "p", "t0", f"user-{i}"), cost=10.0)
        _drain(e, 1)
    assert set(q.flows) == before and not e.users
    assert not [f for f in q.sched._paths if len(f) > 3]
    team = q.sched._nodes[(Flow("o0", "batch", "p"), "t0")]
    assert team.sched.known_flows <= 1  # the core forgot every user v has passed


def test_class_weights_and_strict_classes_keep_their_meaning(core: Callable[[], Any]) -> None:
    """The class sits with the org at the root: acme (weight 2) gets 2 x 3 for interactive and
    2 x 1 for batch, as in a flat file, whichever team sends them; teams split each class's
    part (here one team per class, so each takes all of it); a strict class goes first."""
    text = ACME.replace("  interactive: {weight: 3}\n",
                        "  interactive: {weight: 3}\n  system: {strict: true, max_in_flight: 1, max_queue_length: 5}\n")
    text = text.replace("classes: [batch, interactive]\n    users", "classes: [batch, interactive, system]\n    users")
    e = PolicyEngine(parse_policy(text), clock=Clock(), scheduler=core)
    research = Flow("acme", "interactive", "p", "research", "a")
    product = Flow("acme", "batch", "p", "product", "b")
    globex = Flow("globex", "batch", "p")
    for f in (research, product, globex):
        for _ in range(700):
            e.submit(f, cost=1.0)
    urgent = e.submit(Flow("acme", "system", "p", "product", "b"), cost=1.0)
    got = _drain(e, 901)
    assert got[0] is urgent
    n = {f: sum(1 for r in got[1:] if r.flow == f) for f in (research, product, globex)}
    assert abs(n[research] - 600) <= 2 and abs(n[product] - 200) <= 2 and abs(n[globex] - 100) <= 2, n


def test_a_team_key_sha256_in_two_teams_is_named_where_it_is_written() -> None:
    import hashlib

    digest = hashlib.sha256(b"shared").hexdigest()
    with pytest.raises(PolicyError) as ei:
        parse_policy(POOL + f"""\
orgs:
  acme:
    classes: [batch]
    teams:
      research: {{keys: [shared]}}
      product: {{key_sha256: ["{digest}"]}}
""")
    assert ei.value.path == "orgs.acme.teams.product.key_sha256[0]"
    assert "already the key of team 'research' of org 'acme'" in str(ei.value)


def test_a_reload_keeps_nested_requests_and_flattens_them_when_the_org_stops_nesting(core: Callable[[], Any]) -> None:
    e = PolicyEngine(parse_policy(ACME), clock=Clock(), scheduler=core)
    ana = Flow("acme", "batch", "p", "research", "ana")
    running = e.submit(ana, cost=1.0)
    assert e.poll() == [running]
    waiting = [e.submit(ana, cost=1.0) for _ in range(3)]
    # the same file with other team weights: everything carries over, the user still live
    e2, ended = e.reloaded(parse_policy(ACME.replace("weight: 3, keys", "weight: 5, keys")))
    assert not ended and e2.users == {("acme", "research"): {"ana": 4}}
    # acme without teams: its waiting requests become the org's own (flat) and are served
    flat = parse_policy(ACME.replace("""    users: equal
    teams:
      research: {weight: 1, keys: ["sk-acme-research"]}
      product: {weight: 3, keys: ["sk-acme-product"], max_users: 5}
""", """    keys: ["sk-acme"]
"""))
    assert not flat.nested
    e3, ended = e2.reloaded(flat)
    assert not ended and not e3.users
    e3.complete(running)
    got = _drain(e3, 3)
    assert got == waiting and all(r.flow == ("acme", "batch", "p") for r in got)


def test_team_weights_hold_in_an_org_without_users(core: Callable[[], Any]) -> None:
    """An org with teams and no ``users``: each team is a leaf of the org's node, at its weight
    (3:1 here; once the weights were told only to a team node, made for users, and such teams
    went 1:1)."""
    text = POOL + """\
orgs:
  acme:
    classes: [batch]
    teams:
      research: {weight: 3, keys: ["sk-r"]}
      product: {weight: 1, keys: ["sk-p"]}
  globex: {keys: ["sk-g"], classes: [batch]}
"""
    e = PolicyEngine(parse_policy(text), clock=Clock(), scheduler=core)
    research, product = Flow("acme", "batch", "p", "research"), Flow("acme", "batch", "p", "product")
    globex = Flow("globex", "batch", "p")
    for f in (research, product, globex):
        for _ in range(300):
            e.submit(f, cost=1.0)
    got = _drain(e, 400)
    n = {f: sum(1 for r in got if r.flow == f) for f in (research, product, globex)}
    assert abs(n[research] - 150) <= 2 and abs(n[product] - 50) <= 2 and abs(n[globex] - 200) <= 2, n
