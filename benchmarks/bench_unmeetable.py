"""How often the early refusal of a deadline that cannot be met is right (a class's
``refuse_unmeetable``, docs/design.md §5d): the seeded simulation of
``tests/policy/deadline_sim.py`` over several seeds and loads, no I/O, deterministic.

For each seed, two runs of the same arrivals and service times: the *shadow* run refuses
nothing and records each request's prediction at arrival, then what became of it (a request
predicted unmeetable that started in time is a defect: it would have been refused and would
have made it); the *refusing* run refuses, and counts what started in time and what waited until
its deadline to be dropped::

    python benchmarks/bench_unmeetable.py                # seeds 0-9, the flood at 12 a second
    python benchmarks/bench_unmeetable.py --seeds 20 --flood-rate 8 --spread 1.0

Results: benchmarks/README.md ("Deadlines").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "policy"))

from deadline_sim import simulate  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default 10)")
    ap.add_argument("--n", type=int, default=1500, help="interactive arrivals per run, about (default 1500)")
    ap.add_argument("--flood-rate", type=float, default=12.0, help="the flood's requests a second (default 12)")
    ap.add_argument("--steady-rate", type=float, default=2.0, help="the steady flow's (default 2)")
    ap.add_argument("--spread", type=float, default=0.5, help="log-normal sigma of service times (default 0.5)")
    a = ap.parse_args(argv)
    rows = []
    tot = dict.fromkeys(("pred", "defects", "caught", "missed", "in_time0", "in_time1", "missed1", "refused",
                         "steady_refused", "sent"), 0)
    for seed in range(a.seeds):
        kw = dict(seed=seed, n=a.n, spread=a.spread, flood_rate=a.flood_rate, steady_rate=a.steady_rate)
        sh = simulate(refuse=False, **kw)  # type: ignore[arg-type]
        re = simulate(refuse=True, **kw)  # type: ignore[arg-type]
        rows.append((seed, sh.submitted, sh.predicted_unmeetable, sh.defects, sh.defect_rate, sh.missed, sh.caught,
                     sh.in_time, re.in_time, re.refused, re.missed, sh.mean_missed_wait, re.mean_missed_wait))
        for k, v in (("pred", sh.predicted_unmeetable), ("defects", sh.defects), ("caught", sh.caught),
                     ("missed", sh.missed), ("in_time0", sh.in_time), ("in_time1", re.in_time),
                     ("missed1", re.missed), ("refused", re.refused),
                     ("steady_refused", re.refused_by.get("steady", 0)), ("sent", sh.submitted)):
            tot[k] += v
    print("| seed | sent | predicted unmeetable | defects | defect rate | missed (shadow) | of them predicted "
          "| in time, shadow | in time, refusing | refused | missed, refusing "
          "| wait of a miss, shadow / refusing (s) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (seed, sent, pred, dfx, rate, missed, caught, it0, it1, ref, missed1, w0, w1) in rows:
        print(f"| {seed} | {sent} | {pred} | {dfx} | {rate:.1%} | {missed} | {caught} | {it0} | {it1} | {ref} "
              f"| {missed1} | {w0:.1f} / {w1:.1f} |")
    print(f"\nall seeds: {tot['sent']} sent; predicted unmeetable {tot['pred']}, of which {tot['defects']} started in "
          f"time in the shadow run (defect rate {tot['defects'] / max(1, tot['pred']):.1%}); "
          f"{tot['caught']} of {tot['missed']} misses predicted ({tot['caught'] / max(1, tot['missed']):.1%}); "
          f"in time {tot['in_time0']} -> {tot['in_time1']} ({tot['in_time1'] / tot['in_time0'] - 1:+.1%}) "
          f"when refusing; dropped at their deadline {tot['missed']} -> {tot['missed1']} "
          f"({tot['missed1'] / tot['missed'] - 1:+.1%}), refused at once {tot['refused']}; "
          f"the steady flow refused {tot['steady_refused']} times")


if __name__ == "__main__":
    main()
