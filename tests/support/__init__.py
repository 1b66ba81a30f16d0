"""Support code shared by the test folders and the benchmarks (not tests: nothing here is
collected).

* ``support.workload``: loopback OpenAI-compatible engines that count every org's service as
  they deliver it, a workload of orgs driven with the official ``openai`` client over one or
  several gateways, and the measures (shares, Jain's index, drift);
* ``support.processes``: real processes: ``redis-server`` on a free port, ``sfq serve``,
  bounded waits;
* ``support.fleet``: the fleet harness: N engines, Redis, K gateways, a scenario's load and
  its report (shares vs weighted shares, deviation, Jain, TTFT p99, outcomes).

The tests reach it as ``support`` (``tests/`` is on ``sys.path`` under pytest: ``tests/conftest.py``
is a rootdir conftest in a folder without ``__init__.py``); scripts outside pytest put
``tests/`` on ``sys.path`` themselves.
"""
