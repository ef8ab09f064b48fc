"""The daemons' HTTP side: /metrics, /healthz, /readyz over a real socket."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter

from drasil.driver.endpoints import HealthCheck, parse_addr, serve_http


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        (":9400", ("0.0.0.0", 9400)),
        ("127.0.0.1:9401", ("127.0.0.1", 9401)),
        ("9402", ("0.0.0.0", 9402)),
        ("", None),
        ("0", None),
    ],
)
def test_parse_addr(addr: str, expected: tuple[str, int] | None) -> None:
    assert parse_addr(addr) == expected


@pytest.mark.parametrize("addr", ["localhost", "127.0.0.1:", ":http", "host:94x0", ":-1"])
def test_parse_addr_errors_say_what_is_expected(addr: str) -> None:
    with pytest.raises(ValueError, match=r"expected \[host\]:port, e\.g\. :9400") as err:
        parse_addr(addr)
    assert repr(addr) in str(err.value)


def test_disabled_address_serves_nothing() -> None:
    assert serve_http("") is None
    assert serve_http("0", health=lambda: (True, "")) is None


@contextmanager
def served(
    *, registry: CollectorRegistry | None = None, health: HealthCheck | None = None
) -> Iterator[str]:
    server = serve_http("127.0.0.1:0", registry=registry, health=health)
    assert isinstance(server, ThreadingHTTPServer)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers["Content-Type"], err.read().decode()


def test_metrics_are_served_from_the_registry() -> None:
    registry = CollectorRegistry()
    Counter("drasil_test_things", "Things.", registry=registry).inc(3)
    with served(registry=registry) as base:
        status, content_type, body = get(f"{base}/metrics")
        assert status == 200
        assert content_type.startswith("text/plain; version=")
        assert "drasil_test_things_total 3.0" in body
        assert get(f"{base}/metrics?debug=1")[0] == 200  # query strings are ignored
        # No health check configured: the health paths do not exist here.
        assert get(f"{base}/healthz")[0] == 404


def test_healthz_reports_the_check() -> None:
    state: dict[str, tuple[bool, str]] = {"now": (True, "ok (registered)")}
    with served(health=lambda: state["now"]) as base:
        assert get(f"{base}/healthz") == (200, "text/plain", "ok (registered)\n")
        assert get(f"{base}/readyz")[0] == 200

        state["now"] = (False, "plugin sockets do not answer")
        assert get(f"{base}/healthz") == (503, "text/plain", "plugin sockets do not answer\n")
        assert get(f"{base}/readyz")[0] == 503

        state["now"] = (True, "")
        assert get(f"{base}/healthz") == (200, "text/plain", "ok\n")


def test_unknown_paths_are_404() -> None:
    with served(registry=CollectorRegistry(), health=lambda: (True, "")) as base:
        assert get(f"{base}/") == (404, "text/plain", "not found\n")
        assert get(f"{base}/metricsx")[0] == 404
        assert get(f"{base}/healthz/more")[0] == 404


@pytest.mark.parametrize("addr", [":70000", "127.0.0.1:65536"])
def test_parse_addr_refuses_ports_out_of_range(addr: str) -> None:
    with pytest.raises(ValueError, match="port"):
        parse_addr(addr)
