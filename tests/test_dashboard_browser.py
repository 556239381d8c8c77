"""The dashboard in a real browser: Debian's chromium driven by Playwright, against a generated fleet.

The fleet (8 hosts x 4 hours, `ridethrough.dashboards.fake_fleet`) lives in a chDB store this module owns;
the dashboard reads it through the store's read-only HTTP endpoint, as it does beside `ridethrough server`.
Every page must render figures that hold data (an empty figure says why it is empty, so it fails
here); screenshots go to tests/artifacts/ (git-ignored). The last test serves through gunicorn behind
basic auth, started by the real command.

Chromium runs in a network namespace of its own where this process can make one (`tests.browser_netns`):
a lab test beside these ones changes the host's addresses, and Chromium aborts requests in flight when
they change. A page that does not render says what its tab saw (`tests.browser_watch`).
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ridethrough.dashboards.app import FIGURE_POINTS_JS, RENDERED_JS
from ridethrough.dashboards.config import DashboardConfig
from ridethrough.dashboards.fake_fleet import FakeFleet, FleetSpec, fabric_map, generate
from ridethrough.dashboards.serve import DashServer, build_context, wsgi_app
from ridethrough.exporters.store import Store
from ridethrough.exporters.store_http import StoreHttpEndpoint
from tests.browser_netns import BrowserNetns
from tests.browser_watch import seen, watch
from tests.conftest import ROOT, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "tests" / "artifacts"
TIMEOUT_MS = 90_000
READY, POINTS = RENDERED_JS, FIGURE_POINTS_JS


def _sync_api() -> Any:
    api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed "
                                                             "(pip install playwright; make test installs it)")
    if not CHROMIUM.exists():
        pytest.skip(f"Debian chromium is not installed at {CHROMIUM} (apt-get install chromium; make test "
                    "installs it)")
    return api


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Store, str, FakeFleet, Path]]:
    _sync_api()
    where = tmp_path_factory.mktemp("dashboard_browser")
    st = Store(f"chdb://{where / 'store'}")
    fleet = generate(st, FleetSpec(hosts=8, hours=4), end_ns=time.time_ns())
    fabric = where / "fabric.json"
    fabric.write_text(json.dumps(fabric_map(fleet.spec).to_json()))
    with StoreHttpEndpoint(client=st.client(), host="127.0.0.1", port=0, lock=st.lock) as endpoint:
        yield st, "http://{}:{}".format(*endpoint.address), fleet, fabric
    st.close()


def serve(dsn: str, fabric: Path, reach: Callable[[str], str], **overrides: Any) -> Iterator[str]:
    """The dashboard on Dash's own server (werkzeug) in a thread, on a free port, reachable from the browser."""
    cfg = DashboardConfig(store=dsn, fabric_map_file=str(fabric), agent_stale_s=90, **overrides)
    server = DashServer(wsgi_app(build_context(cfg, dsn=dsn)), listen="127.0.0.1:0")
    yield reach(server.start())
    server.stop()


@pytest.fixture(scope="module")
def netns() -> Iterator[BrowserNetns | None]:
    """Chromium's own network namespace (None where none can be made): see `tests.browser_netns`."""
    _sync_api()
    ns = BrowserNetns.start()
    yield ns
    if ns is not None:
        ns.close()


@pytest.fixture(scope="module")
def reach(netns: BrowserNetns | None) -> Callable[[str], str]:
    """Make a server's URL reachable from the browser (in its namespace, at the same address and port)."""
    return (lambda url: url) if netns is None else netns.expose


@pytest.fixture(scope="module")
def base(store: tuple[Store, str, FakeFleet, Path], reach: Callable[[str], str]) -> Iterator[str]:
    yield from serve(store[1], store[3], reach, refresh_s=0)


@pytest.fixture(scope="module")
def fleet(store: tuple[Store, str, FakeFleet, Path]) -> FakeFleet:
    return store[2]


@pytest.fixture(scope="module")
def browser(netns: BrowserNetns | None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    api = _sync_api()
    executable = CHROMIUM if netns is None else netns.launcher(CHROMIUM, tmp_path_factory.mktemp("chromium"))
    with api.sync_playwright() as pw:
        # Chromium's sandbox needs user namespaces a root test run does not have.
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        chromium = pw.chromium.launch(executable_path=str(executable), headless=True, args=args)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    tab = context.new_page()
    tab.set_default_timeout(TIMEOUT_MS)
    watch(tab)
    yield tab
    context.close()


def load(page: Any, url: str) -> None:
    page.goto(url)
    rendered(page)


def rendered(page: Any) -> None:
    try:
        page.wait_for_function(READY, timeout=TIMEOUT_MS, polling=50)
    except _sync_api().Error as exc:  # a timeout, mostly: what the tab saw says why
        raise AssertionError(f"{page.url} did not render: {exc}\n--- what the tab saw ---\n{seen(page)}") from exc


def points(page: Any, graph_id: str) -> int:
    return int(page.evaluate(POINTS, graph_id))


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}.png"), full_page=True)


def click_first(page: Any, selector: str) -> None:
    """Click the middle of the first matching plot element (Plotly listens on the layer above it)."""
    target = page.locator(selector).first
    target.scroll_into_view_if_needed()
    box = target.bounding_box()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)


def test_fleet_page(page: Any, base: str, fleet: FakeFleet) -> None:
    load(page, base + "/")
    shot(page, "fleet")
    assert points(page, "fleet-health") == 8
    incidents = page.inner_text("#fleet-incidents-table")
    assert "gpu_failed:gpu:h2/gpu5" in incidents and "link_down" not in incidents  # that one resolved
    assert "reroute" in page.inner_text("#fleet-actions")
    assert re.search(r"8 hosts, 3 with a red cell", page.inner_text("#fleet-status"))


def test_fabric_page_and_a_links_history(page: Any, base: str) -> None:
    load(page, base + "/fabric")
    for graph in ("fabric-topology", "fabric-owd", "fabric-errors"):
        assert points(page, graph) > 0, graph
    click_first(page, "#fabric-errors g.trace.bars path")
    page.wait_for_function(f"() => ({POINTS})('fabric-link-history') > 0", timeout=TIMEOUT_MS)
    assert "History of h" in page.inner_text("#fabric-link-history")
    page.get_by_label("reverse (dst→src)").check()
    page.wait_for_function("() => document.querySelector('#fabric-owd').textContent.includes('reverse')")
    rendered(page)
    shot(page, "fabric")
    assert points(page, "fabric-owd") > 0


def test_gpus_page(page: Any, base: str, fleet: FakeFleet) -> None:
    load(page, base + "/gpus")
    rows = page.locator("#gpu-rows tbody tr")
    assert rows.count() == 64 and "failed" in rows.nth(0).inner_text()
    assert points(page, "gpu-detail") > 0  # the worst GPU, charted until another is clicked
    failing = f"h{fleet.roles['gpu_failing']}/gpu2"
    page.get_by_role("link", name=failing, exact=True).click()
    page.wait_for_url(re.compile(r"gpu=h\d+%2Fgpu2"))
    page.wait_for_function(f"() => document.querySelector('#gpu-detail').textContent.includes('{failing}')")
    rendered(page)
    shot(page, "gpus")
    assert points(page, "gpu-detail") > 0


def test_incident_click_through_to_its_trace(page: Any, base: str, fleet: FakeFleet) -> None:
    load(page, base + "/incidents")
    assert points(page, "incidents-timeline") == len(fleet.incidents)
    shot(page, "incidents")
    incident_id = fleet.incidents["link_down"]
    page.locator(f"#incidents-list a[href='/incidents/{incident_id}']").click()
    page.wait_for_url(f"**/incidents/{incident_id}")
    rendered(page)
    shot(page, "incident")
    assert "link_down on h3-leaf3r1" in page.inner_text("#incident-title")
    assert points(page, "incident-evidence") > 0
    assert points(page, "incident-waterfall") >= 7  # root, decide, apply, three steps, verify (and resolved)
    assert "reroute" in page.inner_text("#incident-actions-table")
    page.locator("#incident-trace-link").click()
    page.wait_for_url(f"**/traces/{fleet.traces['link_down']}")
    rendered(page)
    shot(page, "trace")
    assert "link_down on h3-leaf3r1" in page.inner_text("#incident-title")
    assert points(page, "incident-waterfall") >= 7


def test_pagerduty_links_open_directly_and_unknown_ids_say_so(page: Any, base: str, fleet: FakeFleet) -> None:
    load(page, f"{base}/traces/{fleet.traces['gpu_failed']}")
    assert "gpu_failed on h2/gpu5" in page.inner_text("#incident-title")
    assert points(page, "incident-evidence") > 0 and points(page, "incident-waterfall") > 0
    load(page, f"{base}/incidents/{'0' * 32}")
    assert f"no incident {'0' * 32} in the store" in page.inner_text("#incident-status")


def test_goodput_page(page: Any, base: str) -> None:
    load(page, base + "/goodput")
    shot(page, "goodput")
    assert points(page, "goodput-jobs") > 0 and points(page, "goodput-timeline") > 0
    assert re.search(r"\d+\.\d%", page.inner_text("#goodput-cards"))
    assert "llama-70b-pretrain" in page.inner_text("#goodput-jobs-table")


def test_figures_refresh_without_reloading_the_page(page: Any, store: tuple[Store, str, FakeFleet, Path],
                                                    reach: Callable[[str], str]) -> None:
    # A refresh supersedes a callback still in flight: the period leaves a loaded machine time to answer.
    for url in serve(store[1], store[3], reach, refresh_s=3, cache_s=0):
        load(page, url + "/")
        page.evaluate("() => { window.__not_reloaded = true; }")
        before = page.inner_text("#fleet-status")
        page.wait_for_function("(t) => document.querySelector('#fleet-status').innerText !== t", arg=before)
        assert page.evaluate("() => window.__not_reloaded") is True


def test_gunicorn_with_basic_auth(browser: Any, store: tuple[Store, str, FakeFleet, Path], tmp_path: Path,
                                  reach: Callable[[str], str]) -> None:
    ready = tmp_path / "ready.json"
    env = {**os.environ, "RIDETHROUGH_DASHBOARD_BASIC_AUTH_USER": "sre", "RT_TEST_PW": "s3cret",
           "RIDETHROUGH_DASHBOARD_BASIC_AUTH_PASSWORD": "env:RT_TEST_PW", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-c", "import typer; from ridethrough.dashboards.dashboard_cli import dashboard; "
               "typer.run(dashboard)", "--store", store[1], "--listen", "127.0.0.1:0", "--server", "gunicorn",
               "--workers", "2", "--fabric-map-file", str(store[3]), "--ready-file", str(ready)]
    log_path = tmp_path / "gunicorn.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        url = str(wait_for(lambda: ready.exists() and json.loads(ready.read_text())["url"], timeout_s=60,
                           what="the dashboard's ready file"))
        wait_for(lambda: _status(url + "/healthz") == 200, timeout_s=60, what="gunicorn's workers")
        assert _status(url + "/") == 401
        assert _status(url + "/", ("sre", "wrong")) == 401
        assert _status(url + "/", ("sre", "s3cret")) == 200
        context = browser.new_context(http_credentials={"username": "sre", "password": "s3cret"})
        try:
            tab = context.new_page()
            tab.set_default_timeout(TIMEOUT_MS)
            watch(tab)
            load(tab, reach(url) + "/")
            assert points(tab, "fleet-health") == 8
        finally:
            context.close()
    except BaseException as exc:  # gunicorn's own account belongs with any failure here
        proc.terminate()
        proc.wait(30)
        exc.add_note("--- the dashboard's log (gunicorn) ---\n" + log_path.read_text(errors="replace")[-6000:])
        raise
    proc.terminate()
    code = proc.wait(30)
    log_text = log_path.read_text(errors="replace")
    assert code == 0, log_text
    # No control socket: its one path per user is not this dashboard's to take from another gunicorn.
    assert "Control socket listening" not in log_text, log_text


def _status(url: str, auth: tuple[str, str] | None = None) -> int:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0
