"""docker/: the Dockerfiles pass hadolint, the compose file is a valid Compose file that hangs together,
and ridethrough-leader (the controller image's Lease elector) keeps exactly one command running.

No Docker engine here: images are not built. The elector runs against an in-memory Lease store
with the API server's optimistic concurrency, and its HTTP client against a small fake of the
Kubernetes Lease endpoint.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
HADOLINT = Path(sys.executable).parent / "hadolint"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))


def _leader_module() -> Any:
    spec = importlib.util.spec_from_file_location("leader_elect", DOCKER / "leader_elect.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["leader_elect"] = module
    spec.loader.exec_module(module)
    return module


le = _leader_module()


def hadolint(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HADOLINT), "--no-color", "--config", str(DOCKER / "hadolint.yaml"), *map(str, files)],
                          capture_output=True, text=True, timeout=60)


def test_dockerfiles_pass_hadolint_which_does_flag_bad_ones(tmp_path: Path) -> None:
    assert [p.name for p in DOCKERFILES] == ["agent.Dockerfile", "server.Dockerfile"]
    result = hadolint(*DOCKERFILES)
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    flagged = hadolint(bad)
    assert flagged.returncode == 1 and "DL3007" in flagged.stdout and "DL3042" in flagged.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_are_multi_stage_pinned_and_non_root(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base[1])
    assert len(re.findall(r"^FROM ", text, re.M)) == 2 and "COPY --from=build /opt/venv /opt/venv" in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] == "10001:10001"
    assert re.search(r'^ENTRYPOINT \["ridethrough"\]$', text, re.M)
    ignore = (DOCKER / f"{dockerfile.name}.dockerignore").read_text().splitlines()
    assert ignore[1] == "*"  # the build context is the package sources only, never .venv or stores
    for copied in re.findall(r"^COPY (?!--)(\S+) ", text, re.M):
        if copied not in ("pyproject.toml",):
            assert f"!{copied}/" in ignore or f"!{copied}" in ignore, copied


def test_compose_file_is_valid_and_consistent() -> None:
    doc = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    spec = json.loads(resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
                      .read_text())
    errors = [f"{list(e.path)}: {e.message}" for e in jsonschema.Draft202012Validator(spec).iter_errors(doc)]
    assert errors == []
    services = doc["services"]
    assert re.fullmatch(r"clickhouse/clickhouse-server:\d+\.\d+", services["clickhouse"]["image"])
    for name, service in services.items():
        for dep in service.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            assert source.startswith("/") or source in doc["volumes"], volume
        if "build" in service:
            assert (ROOT / service["build"]["dockerfile"]).exists()
        store = service.get("environment", {}).get("RIDETHROUGH_GATEWAY_STORE", "")
        assert not store or "${CLICKHOUSE_PASSWORD:?" in store  # never a password in the file
    agent = services["agent"]
    assert agent["network_mode"] == "host" and agent["cap_add"] == ["NET_ADMIN"] and agent["cap_drop"] == ["ALL"]
    assert "/sys:/host/sys:ro" in agent["volumes"] and agent["profiles"] == ["agent"]
    assert services["gateway"]["depends_on"]["store-init"] == {"condition": "service_completed_successfully"}


class FakeLeases:
    """Leases as the API server keeps them: every write bumps resourceVersion; a stale one is a conflict."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.down = False
        self._version = 0

    def _check(self) -> None:
        if self.down:
            raise ConnectionRefusedError("API server away")

    def get(self) -> dict[str, Any] | None:
        self._check()
        return json.loads(json.dumps(self.lease)) if self.lease else None

    def create(self, lease: dict[str, Any]) -> dict[str, Any]:
        self._check()
        if self.lease is not None:
            raise le.Conflict("exists")
        return self._store(lease)

    def update(self, lease: dict[str, Any]) -> dict[str, Any]:
        self._check()
        assert self.lease is not None
        if lease["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise le.Conflict("stale")
        return self._store(lease)

    def _store(self, lease: dict[str, Any]) -> dict[str, Any]:
        self._version += 1
        self.lease = {**lease, "metadata": {**lease["metadata"], "resourceVersion": str(self._version)}}
        return self.lease


def test_a_standby_takes_the_lease_only_after_it_saw_no_renewal_for_its_duration() -> None:
    api, now = FakeLeases(), [1000.0]
    a = le.Elector(api, "ctl", "pod-a", 15.0, monotonic=lambda: now[0], wall=lambda: now[0])
    b = le.Elector(api, "ctl", "pod-b", 15.0, monotonic=lambda: now[0] + 5e6, wall=lambda: now[0])
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    now[0] += 10
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()  # renewed: b starts counting again
    now[0] += 14
    assert not b.try_acquire_or_renew()
    now[0] += 2  # 16 s without a renewal seen by b
    assert b.try_acquire_or_renew() and not a.try_acquire_or_renew()
    spec = api.lease["spec"] if api.lease else {}
    assert spec["holderIdentity"] == "pod-b" and spec["leaseTransitions"] == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", spec["renewTime"])
    b.release()
    assert api.lease and api.lease["spec"]["holderIdentity"] == "" and a.try_acquire_or_renew()


def test_an_attempt_that_loses_the_race_is_not_leadership() -> None:
    class Racing(FakeLeases):
        def update(self, lease: dict[str, Any]) -> dict[str, Any]:
            raise le.Conflict("someone wrote first")

    api = Racing()
    api.lease = {"metadata": {"name": "ctl", "resourceVersion": "7"}, "spec": {"holderIdentity": ""}}
    assert not le.Elector(api, "ctl", "pod-a", 15.0).try_acquire_or_renew()


def _leader(api: FakeLeases, command: list[str], identity: str = "pod-a") -> Any:
    timing = le.Timing(lease_duration_s=1.0, renew_deadline_s=0.4, retry_period_s=0.05)
    return le.Leader(le.Elector(api, "ctl", identity, timing.lease_duration_s), command, timing)


def test_the_leader_runs_the_command_and_releases_the_lease_when_it_ends() -> None:
    api = FakeLeases()
    assert _leader(api, [sys.executable, "-c", "raise SystemExit(3)"]).run() == 3
    assert api.lease and api.lease["spec"]["holderIdentity"] == ""  # a standby need not wait for expiry


def test_a_leader_that_cannot_renew_stops_its_command(tmp_path: Path) -> None:
    api, marker = FakeLeases(), tmp_path / "still-running"
    script = f"import pathlib, time\nwhile True:\n    pathlib.Path({str(marker)!r}).touch()\n    time.sleep(0.02)\n"
    leader = _leader(api, [sys.executable, "-c", script])
    threading.Timer(0.5, lambda: setattr(api, "down", True)).start()
    assert leader.run() == 1
    marker.unlink(missing_ok=True)
    threading.Event().wait(0.2)
    assert not marker.exists()  # the command is gone, not orphaned


def test_a_standby_stopped_by_its_pod_never_runs_the_command(tmp_path: Path) -> None:
    api, marker = FakeLeases(), tmp_path / "ran"
    le.Elector(api, "ctl", "pod-a", 15.0).try_acquire_or_renew()
    standby = _leader(api, [sys.executable, "-c", f"open({str(marker)!r}, 'w')"], identity="pod-b")
    server = le.serve_health(standby, "127.0.0.1:0")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
        threading.Timer(0.3, standby.stop.set).start()
        assert urllib.request.urlopen(url, timeout=5).read() == b"standby"
        assert standby.run() == 0
    finally:
        server.shutdown()
    assert not marker.exists()


class _FakeApiServer(BaseHTTPRequestHandler):
    leases: FakeLeases
    auth: list[str]

    def _answer(self, code: int, body: dict[str, Any] | None = None) -> None:
        data = json.dumps(body or {"kind": "Status", "code": code}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.auth.append(self.headers["Authorization"])
        lease = self.leases.get()
        if lease:
            self._answer(200, lease)
        else:
            self._answer(404)

    def do_POST(self) -> None:
        assert self.path.endswith("/namespaces/gpu/leases")
        self.auth.append(self.headers["Authorization"])
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            self._answer(201, self.leases.create(body))
        except le.Conflict:
            self._answer(409)

    def do_PUT(self) -> None:
        assert self.path.endswith("/namespaces/gpu/leases/ctl")
        self.auth.append(self.headers["Authorization"])
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            self._answer(200, self.leases.update(body))
        except le.Conflict:
            self._answer(409)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[tuple[str, FakeLeases, list[str], Path]]:
    leases, auth = FakeLeases(), []
    handler = type("Handler", (_FakeApiServer,), {"leases": leases, "auth": auth})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    yield f"http://127.0.0.1:{server.server_address[1]}", leases, auth, token
    server.shutdown()


def test_the_kubernetes_client_speaks_the_lease_api(api_server: tuple[str, FakeLeases, list[str], Path]) -> None:
    url, leases, auth, token = api_server
    api = le.KubeLeaseApi(url, "gpu", "ctl", token_file=token, ca_file=None)
    assert api.get() is None
    a = le.Elector(api, "ctl", "pod-a", 15.0)
    assert a.try_acquire_or_renew() and a.try_acquire_or_renew()  # POST, then GET + PUT
    assert leases.lease and leases.lease["metadata"]["resourceVersion"] == "2"
    token.write_text("tok-2\n")  # a rotated service-account token is picked up
    assert not le.Elector(api, "ctl", "pod-b", 15.0).try_acquire_or_renew()
    stale = {**leases.lease, "metadata": {**leases.lease["metadata"], "resourceVersion": "1"}}
    with pytest.raises(le.Conflict):
        api.update(stale)
    assert auth[0] == "Bearer tok-1" and auth[-1] == "Bearer tok-2"


def test_the_command_line_needs_a_command_and_an_identity() -> None:
    with pytest.raises(SystemExit) as info:
        le.main(["--lease", "ctl", "--namespace", "gpu", "--identity", "pod-a"])
    assert info.value.code == 2
    with pytest.raises(ValueError, match="retry_period_s < renew_deadline_s < lease_duration_s"):
        le.Timing(lease_duration_s=10, renew_deadline_s=10, retry_period_s=2)
