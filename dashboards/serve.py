"""Serving the dashboard: a WSGI app (with optional basic auth) for gunicorn, or Dash's own server.

Production runs gunicorn, either through ``ridethrough dashboard`` (``server: gunicorn``) or
gunicorn's own command with this module's factory::

    gunicorn -w 2 --threads 4 -b 0.0.0.0:8050 'ridethrough.dashboards.serve:create_app(config="rt.yaml")'

(config from the file's ``dashboard`` section and ``RIDETHROUGH_DASHBOARD_*``). Demos run
Dash's development server (werkzeug), ``server: dash``. ``/healthz`` answers without
authentication and without touching the store.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, cast

from ridethrough.dashboards.app import HEALTH_PATH, build_app
from ridethrough.dashboards.config import DashboardConfig, load_dashboard_config, read_password
from ridethrough.dashboards.pages_common import Context
from ridethrough.dashboards.queries import EXISTS_TABLE
from ridethrough.exporters.store import Store, StoreError, StoreUnavailable, is_embedded
from ridethrough.settings import load_component, parse_hostport
from ridethrough.signals import wait_for_stop

log = logging.getLogger(__name__)
WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class BasicAuth:
    """WSGI middleware: every request but ``exempt`` paths must carry the user and password (RFC 7617)."""

    def __init__(self, app: WSGIApp, *, user: str, password: str, realm: str = "ridethrough",
                 exempt: Iterable[str] = (HEALTH_PATH,)) -> None:
        self._app = app
        self._user = user.encode()
        self._password = password.encode()
        self._challenge = f'Basic realm="{realm}", charset="UTF-8"'
        self._exempt = frozenset(exempt)

    def allowed(self, header: str) -> bool:
        """Whether an ``Authorization`` header value carries the right credentials."""
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(token.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        # Both compared, always, in constant time: the answer's timing tells nothing about either.
        ok_user = hmac.compare_digest(user, self._user)
        ok_password = hmac.compare_digest(password, self._password)
        return bool(sep) and ok_user and ok_password

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") in self._exempt or self.allowed(environ.get("HTTP_AUTHORIZATION", "")):
            return self._app(environ, start_response)
        body = b"authentication required\n"
        start_response("401 Unauthorized", [("WWW-Authenticate", self._challenge),
                                            ("Content-Type", "text/plain; charset=utf-8"),
                                            ("Content-Length", str(len(body)))])
        return [body]


class CachedStore(Store):
    """A `Store` whose query results are reused for ``ttl_s`` (0: never), shared by every page and viewer.

    Pages compute their time ranges from a clock rounded to ``ttl_s`` (`Context.now_ns`), so the same
    view asked twice within that time is the same query, and so is a query two pages share (the GPU
    states behind the Fleet and GPUs pages). Failures are not cached. A table found to exist is remembered
    for good, whatever ``ttl_s`` (tables are not dropped under a running dashboard).
    """

    def __init__(self, dsn: str, *, ttl_s: float, timeout_s: float = 10.0, max_entries: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(dsn, timeout_s=timeout_s)
        self._ttl_s = ttl_s
        self._max = max_entries
        self._clock = clock
        self._cache: dict[Hashable, tuple[float, tuple[list[str], list[tuple[Any, ...]]]]] = {}
        self._cache_lock = threading.Lock()

    def query(self, sql: str, *, parameters: dict[str, Any] | None = None,
              settings: dict[str, Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        """`Store.query`, answered from the cache while a result for the same text and values is fresh."""
        key = (sql, _frozen(parameters), _frozen(settings))
        now = self._clock()
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
        result = super().query(sql, parameters=parameters, settings=settings)
        found = sql == EXISTS_TABLE and bool(result[1] and result[1][0][0])
        if self._ttl_s <= 0 and not found:
            return result
        with self._cache_lock:
            for k in [k for k, (expires, _) in self._cache.items() if expires <= now]:
                del self._cache[k]
            while len(self._cache) >= self._max:  # the oldest entry goes first (dicts keep insertion order)
                del self._cache[next(iter(self._cache))]
            self._cache[key] = (math.inf if found else now + self._ttl_s, result)
        return result


def _frozen(value: Any) -> Hashable:
    if isinstance(value, Mapping):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return cast(Hashable, value)


def store_dsn(cfg: DashboardConfig, *, config_file: str | os.PathLike[str] | None,
              env: Mapping[str, str] | None) -> str:
    """The DSN the pages read: ``dashboard.store``, else the gateway's store."""
    return cfg.store or load_component("gateway", file=config_file, env=env).config.store


def build_context(cfg: DashboardConfig, *, dsn: str) -> Context:
    """The pages' context: a store client and the fabric map (ValueError for a bad map file)."""
    from ridethrough.detectors.fabric_map import RouteFile

    fabric = RouteFile(cfg.fabric_map_file) if cfg.fabric_map_file else None
    return Context(store=CachedStore(dsn, ttl_s=cfg.cache_s, timeout_s=cfg.store_timeout_s), cfg=cfg, fabric=fabric)


def wsgi_app(ctx: Context, *, env: Mapping[str, str] | None = None) -> WSGIApp:
    """The dashboard as a WSGI app, behind basic auth when the config asks (the password is read here, once)."""
    server = build_app(ctx).server
    # Dash sets itself up (registers the scripts it may serve) on its first request; under a threaded server
    # two first requests race, and one asking for a script before the other has registered it fails. One
    # request here, before any client's, settles it.
    with server.test_client() as warm:
        warm.get(HEALTH_PATH)
    # Learn which host each GPU is on now, in the background, so the first page loads find it (a store that is
    # away only means the first page that needs it reads it).
    threading.Thread(target=_prime, args=(ctx,), name="dashboard-gpu-inventory", daemon=True).start()
    app: WSGIApp = server
    if ctx.cfg.basic_auth_user:
        app = BasicAuth(app, user=ctx.cfg.basic_auth_user, password=read_password(ctx.cfg.basic_auth_password, env))
    return app


def _prime(ctx: Context) -> None:
    try:
        ctx.gpus.prime(ctx.store, now_ns=ctx.now_ns())
    except (StoreUnavailable, StoreError) as exc:
        log.info("GPU inventory not read at start: %s", exc)


def create_app(config: str | None = None) -> WSGIApp:
    """gunicorn's app factory: the config from ``config`` (a YAML file) and ``RIDETHROUGH_DASHBOARD_*``."""
    cfg = load_dashboard_config(file=config, env=os.environ).config
    return wsgi_app(build_context(cfg, dsn=store_dsn(cfg, config_file=config, env=os.environ)))


def _stop_after(duration_s: float | None, stop: Callable[[], None]) -> None:
    if duration_s is not None:
        timer = threading.Timer(duration_s, stop)
        timer.daemon = True
        timer.start()


class DashServer:
    """Dash's own server (werkzeug, threaded) in a daemon thread: for demos, and a process that hosts the
    dashboard beside other components (it shares that process's `Store` through the `Context`)."""

    def __init__(self, app: WSGIApp, *, listen: str) -> None:
        from werkzeug.serving import make_server

        host, port = parse_hostport(listen)
        self._server = make_server(host, port, app, threaded=True)
        self.url = _url(host, self._server.server_port)
        """Where it serves (the bound port, when ``listen`` asked for port 0)."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="dashboard-http", daemon=True)

    def start(self) -> str:
        """Serve in the background; returns `url`."""
        self._thread.start()
        return self.url

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and wait up to ``timeout_s`` for the thread."""
        self._server.shutdown()
        self._thread.join(timeout_s)


def serve_dash(app: WSGIApp, *, listen: str, on_ready: Callable[[str], None],
               duration_s: float | None = None) -> None:
    """Serve with Dash's own server until SIGINT/SIGTERM or ``duration_s``."""
    server = DashServer(app, listen=listen)
    on_ready(server.start())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    wait_for_stop(stop, duration_s)
    server.stop()


def serve_gunicorn(make: Callable[[], WSGIApp], cfg: DashboardConfig, *, embedded: bool,
                   on_ready: Callable[[str], None], duration_s: float | None = None) -> None:
    """Serve with gunicorn (``cfg.workers`` x ``cfg.threads``) until it is stopped; ``make`` runs in each worker."""
    from gunicorn.app.base import BaseApplication

    workers = cfg.workers
    if embedded and workers > 1:
        log.warning("an embedded chdb:// store opens in one process only: serving with 1 gunicorn worker")
        workers = 1

    def when_ready(server: Any) -> None:
        host, port = server.LISTENERS[0].getsockname()[:2]
        on_ready(_url(str(host), int(port)))

    class _App(BaseApplication):  # type: ignore[misc]  # gunicorn ships no type hints
        def load_config(self) -> None:
            options = {"bind": cfg.listen, "workers": workers, "threads": cfg.threads, "worker_class": "gthread",
                       "timeout": 120, "accesslog": None, "when_ready": when_ready}
            # Recent gunicorn opens a control socket at one path per user (~/.gunicorn/gunicorn.ctl): a second
            # dashboard, or any gunicorn app of that user, takes it over, and the first to stop deletes it for
            # the other. Nothing here uses it; older gunicorn has no such setting.
            if "control_socket_disable" in self.cfg.settings:
                options["control_socket_disable"] = True
            for key, value in options.items():
                self.cfg.set(key, value)

        def load(self) -> WSGIApp:
            return make()

    _stop_after(duration_s, lambda: os.kill(os.getpid(), signal.SIGTERM))
    _App().run()


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(cfg: DashboardConfig, *, dsn: str, on_ready: Callable[[str], None] = lambda url: None,
          duration_s: float | None = None) -> None:
    """Serve the dashboard with ``cfg.server`` until it is stopped (config problems raise ValueError first)."""
    # Problems stop the start here, before anything binds (not later, in each gunicorn worker).
    if cfg.basic_auth_user:
        read_password(cfg.basic_auth_password)
    if cfg.fabric_map_file:
        from ridethrough.detectors.fabric_map import RouteMap

        RouteMap.load(cfg.fabric_map_file)

    def make() -> WSGIApp:
        return wsgi_app(build_context(cfg, dsn=dsn))

    if cfg.server == "dash":
        serve_dash(make(), listen=cfg.listen, on_ready=on_ready, duration_s=duration_s)
    else:
        serve_gunicorn(make, cfg, embedded=is_embedded(dsn), on_ready=on_ready, duration_s=duration_s)


def wait_healthy(url: str, *, timeout_s: float = 30.0) -> bool:
    """Poll ``{url}/healthz`` until it answers 200 (for scripts that start a dashboard)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + HEALTH_PATH, timeout=2) as answer:
                if answer.status == 200:
                    return True
        except OSError:
            time.sleep(0.1)
    return False
