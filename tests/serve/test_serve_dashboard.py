"""``GET /dashboard`` in a real headless browser (Debian's ``chromium`` and ``chromium-driver``,
driven by Selenium), against a real ``sfq serve`` and a real loopback engine.

* the page is served without a key, pins its one script in its Content-Security-Policy, holds
  no key; ``--no-dashboard`` answers 404 there (``/stats`` stays);
* two orgs of equal weight flood the engine through the official ``openai`` client: the page
  loads with no console error, shows both orgs, each near half, and the class they send (its
  weight, 3, in the classes table and on each org's row); one org stops, and the page's figure
  for the other rises to nearly all of the pool (the window is 2 s), its history drawn from the
  first poll (no empty time before it), requests waiting and in flight drawn as two series;
  no key reaches the page or ``/stats``;
* orgs named as markup (an ``<img onerror>``, a ``<script>``) are shown as text: nothing of
  theirs runs, no element of theirs is made.

Skipped, saying why, without chromium, chromedriver or Selenium unless ``SFQ_REQUIRE_BROWSER``
is set (``.ci/run`` installs them and sets it). ``SFQ_DASHBOARD_SCREENSHOT=PATH`` saves the
flooding test's last frame there (docs/img/dashboard.png was taken so).
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.processes import LIMIT, Gateway, wait_until
from support.workload import Fleet, OrgLoad, policy_text, start_workload

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=LIMIT) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    missing = [n for n, ok in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER),
                               ("selenium", webdriver is not None)) if not ok]
    if missing:
        if os.environ.get("SFQ_REQUIRE_BROWSER"):
            raise RuntimeError(f"SFQ_REQUIRE_BROWSER is set but {', '.join(missing)} missing "
                               "(apt-get install chromium chromium-driver; pip install selenium)")
        pytest.skip(f"no {', '.join(missing)} (Debian: apt-get install chromium chromium-driver; "
                    "pip install selenium); .ci/run installs them")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1100", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(LIMIT)
    try:
        yield driver
    finally:
        driver.quit()


def errors(driver: Any) -> list[dict[str, Any]]:
    """The browser console's errors since the last call (CSP violations and failed loads too)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def shares(driver: Any) -> dict[str, float | None]:
    """The share the page shows for each org of pool main (the cell's exact figure), read in
    one script (the page redraws its table at every poll)."""
    return dict(driver.execute_script("""
        const out = [];
        const rows = document.querySelectorAll('section[data-pool="main"] table[data-table="orgs"] tbody tr');
        for (const tr of rows) {
          const td = tr.querySelector('[data-k="share"]');
          out.push([tr.getAttribute("data-org"), td && td.hasAttribute("data-value") ? Number(td.dataset.value) : null]);
        }
        return out;"""))


def shown(driver: Any, script: str) -> Any:
    """What ``script`` (an expression) evaluates to in the page."""
    return driver.execute_script("return " + script)


def started(tmp: Path, orgs: list[OrgLoad], fleet: Fleet, extra: tuple[str, ...] = ()) -> Gateway:
    cfg = tmp / "policy.yaml"
    text = policy_text([e.url for e in fleet.engines], orgs, extra="metrics: {window_seconds: 2}\n")
    cfg.write_text(text.replace("  batch: {weight: 1}\n", "  batch: {weight: 3}\n"))  # (a class weight to show)
    return Gateway(cfg, extra=("--access-log", "off", *extra))


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet((1.0,), slots=4, unit=0.002).start()
    try:
        yield f
    finally:
        f.stop()


def test_the_page_needs_no_key_pins_its_script_and_is_off_with_no_dashboard(tmp_path: Path, fleet: Fleet) -> None:
    orgs = [OrgLoad("acme", "sk-acme-secret")]
    gw = started(tmp_path, orgs, fleet)
    try:
        status, headers, body = _get(gw.url + "/dashboard")
        assert status == 200 and headers["Content-Type"].startswith("text/html"), headers
        csp = headers["Content-Security-Policy"]
        assert "script-src 'sha256-" in csp and "default-src 'none'" in csp and "connect-src 'self'" in csp, csp
        assert "unsafe-inline" not in csp.split("script-src", 1)[1].split(";", 1)[0]
        assert b"sk-acme-secret" not in body and b"http://" not in body.replace(b"http://www.w3.org/2000/svg", b"")
    finally:
        gw.stop()
    gw = started(tmp_path, orgs, fleet, ("--no-dashboard",))
    try:
        status, _, body = _get(gw.url + "/dashboard")
        assert status == 404 and json.loads(body)["error"]["code"] == "unknown_route", body
        assert "/dashboard)" not in json.loads(body)["error"]["message"]  # (the routes it names are the ones there)
        assert _get(gw.url + "/stats")[0] == 200
    finally:
        gw.stop()


def test_the_page_shows_both_orgs_and_follows_their_shares(tmp_path: Path, fleet: Fleet, browser: Any) -> None:
    orgs = [OrgLoad("alpha", "sk-alpha-secret", clients=6), OrgLoad("beta", "sk-beta-secret", clients=6)]
    gw = started(tmp_path, orgs, fleet)
    try:
        errors(browser)  # (what an earlier test left in the log)
        browser.get(gw.url + "/dashboard?interval=0.25&minutes=0.25")
        alpha = start_workload(gw.url, orgs[:1], 11.0, fleet.log)
        beta = start_workload(gw.url, orgs[1:], 5.0, fleet.log)
        # both flooding: both shown, each near half of the pool
        both = wait_until(lambda: (s := shares(browser)).keys() == {"alpha", "beta"}
                          and all(v is not None and 0.3 < v < 0.7 for v in s.values()) and s,
                          "the page to show both orgs near half")
        jain = shown(browser, """document.querySelector('section[data-pool="main"] [data-k="jain"]').textContent""")
        assert float(jain) > 0.8, jain
        assert beta.result(LIMIT).ok["beta"] > 0
        # beta stopped: within the 2 s window the page's figure for alpha rises to nearly all
        after = wait_until(lambda: ((s := shares(browser)).get("alpha") or 0) >= 0.95 and s,
                           "the page to show alpha's share rising once beta stopped")
        assert after["alpha"] > both["alpha"] + 0.25, (both, after)
        # the history of the polls is drawn: alpha's line has a point per poll
        line = shown(browser, """document.querySelector('svg[data-chart="shares"] path[data-org="alpha"]')
                                 .getAttribute("d")""")
        assert line.count("L") >= 10, line
        assert int(shown(browser, "document.body.dataset.polls")) >= 10
        # the class they send, with its weight: in the classes table and on each org's row
        cls = shown(browser, """[...document.querySelectorAll(
            'section[data-pool="main"] table[data-table="classes"] tbody tr')].map(
            (tr) => [tr.dataset.class, tr.querySelector('[data-k="weight"]').textContent])""")
        assert cls == [["batch", "3"]], cls
        on_rows = shown(browser, """[...document.querySelectorAll(
            'section[data-pool="main"] table[data-table="orgs"] tbody tr [data-k="classes"]')].map(
            (td) => td.textContent)""")
        assert on_rows == ["batch \u00d73", "batch \u00d73"], on_rows  # (batch x3)
        # the class has no time-to-first-token objective: none shown (not 100 %), its p99 shown
        ttft = shown(browser, """[...document.querySelectorAll(
            'section[data-pool="main"] table[data-table="classes"] tbody tr')].map((tr) => ["ttft_objective_seconds",
            "attainment", "attainment_requests", "ttft_p99"].map((k) => tr.querySelector(`[data-k="${k}"]`).textContent))""")
        assert ttft[0][:2] == ["-", "-"] and int(ttft[0][2]) > 0 and ttft[0][3] != "-", ttft
        # requests waiting and in flight: two series, two colours, a point per poll each; both charts
        # start at the first poll kept (the left edge, x = 14), not at an empty stretch before it
        queue = shown(browser, """[...document.querySelectorAll('svg[data-chart="queue"] path')].map(
            (p) => [p.dataset.series, p.getAttribute("stroke"), p.getAttribute("d")])""")
        assert [q[0] for q in queue] == ["waiting", "in_flight"] and queue[0][1] != queue[1][1], queue
        for _, _, d in queue:
            assert d.startswith("M14.0,") and d.count("L") >= 10, d
        assert errors(browser) == []
        assert errors(browser) == []
        shot = os.environ.get("SFQ_DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png")
        assert browser.save_screenshot(shot)
        page = browser.page_source
        stats = _get(gw.url + "/stats")[2].decode()
        for key in ("sk-alpha-secret", "sk-beta-secret"):
            assert key not in page and key not in stats
        res = alpha.result(LIMIT)
        assert not res.errors["alpha"], res.errors
    finally:
        browser.get("about:blank")  # the page stops polling before its gateway goes
        gw.stop()


def test_org_names_are_text_not_markup(tmp_path: Path, fleet: Fleet, browser: Any) -> None:
    img = "<img src=x onerror=\"window.pwned=1;document.title='pwned'\">"
    script = "<script>window.pwned=2</script>"
    cfg = tmp_path / "policy.yaml"
    text = policy_text([e.url for e in fleet.engines], [OrgLoad("IMG", "sk-img"), OrgLoad("SCRIPT", "sk-script")])
    cfg.write_text(text.replace("  IMG:", f"  {json.dumps(img)}:").replace("  SCRIPT:", f"  {json.dumps(script)}:"))
    gw = Gateway(cfg, extra=("--access-log", "off"))
    try:
        for key in ("sk-img", "sk-script"):
            status, body = gw.post(key, "org=x use=1 | hello")
            assert status == 200, body
        errors(browser)
        browser.get(gw.url + "/dashboard?interval=0.25")
        wait_until(lambda: shares(browser).keys() == {img, script}, "the page to list both orgs")
        cells = shown(browser, """[...document.querySelectorAll('table[data-table="orgs"] tbody tr')].map(
                                    (tr) => [tr.dataset.org, tr.querySelector("td.org").textContent])""")
        assert sorted(cells) == sorted([[img, img], [script, script]]), cells
        assert shown(browser, 'document.querySelectorAll("main img, main script").length') == 0
        assert browser.execute_script("return window.pwned") is None
        assert browser.title == "sfq: fairness"
        assert errors(browser) == []
    finally:
        browser.get("about:blank")
        gw.stop()
