"""KubeApi's guards: names checked before they reach a URL, a timeout on every request."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kubernetes import client

from drasil.driver import kubeapi
from drasil.driver.kubeapi import ApiUnavailable, InvalidName, KubeApi, checked_name


@pytest.mark.parametrize(
    "name", ["good?watch=true", "", "a/b", "../evil", "UPPER", "a" * 254, "-a", "a b", "ü"]
)
def test_names_no_object_can_have_are_refused(name: str) -> None:
    with pytest.raises(InvalidName, match="is not a valid name: a DNS subdomain"):
        checked_name(name, what="ResourceClaim name")


@pytest.mark.parametrize("name", ["a", "train-0", "a.b-c", "x" * 253])
def test_valid_names_pass(name: str) -> None:
    assert checked_name(name, what="ResourceClaim name") == name


def test_namespaces_are_dns_labels() -> None:
    with pytest.raises(InvalidName, match=r"namespace 'a\.b' is not a valid name: a DNS label"):
        checked_name("a.b", what="namespace", label=True)


@dataclass
class HungServer:
    url: str
    accepted: list[socket.socket]


@pytest.fixture
def hung_server() -> Iterator[HungServer]:
    """A TCP server that accepts connections and never answers (a SIGSTOPped API server
    looks like this to a client whose connection is already open)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield HungServer(f"http://127.0.0.1:{listener.getsockname()[1]}", accepted)
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


def test_every_request_times_out_against_a_hung_server(
    hung_server: HungServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kubeapi, "API_TIMEOUT", (1.0, 0.5))
    configuration = client.Configuration()
    configuration.host = hung_server.url
    api = KubeApi(client.ApiClient(configuration))

    for call in (
        lambda: api.get_claim("default", "train"),
        lambda: api.list_slices(driver="gpu.drasil.dev", pool="node-a"),
    ):
        before = len(hung_server.accepted)
        with pytest.raises(Exception, match=r"timed out|did not answer within 0\.5 s"):
            call()
        # One connection, not four: a timed-out read is not retried.
        assert len(hung_server.accepted) - before == 1


def test_the_claim_read_says_which_api_server_did_not_answer(
    hung_server: HungServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kubeapi, "API_TIMEOUT", (1.0, 0.5))
    configuration = client.Configuration()
    configuration.host = hung_server.url
    api = KubeApi(client.ApiClient(configuration))
    with pytest.raises(ApiUnavailable, match=f"the API server at {hung_server.url} did not answer"):
        api.get_claim("default", "train")


def test_a_refused_connection_is_unavailable() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    api = KubeApi(client.ApiClient(configuration))
    with pytest.raises(ApiUnavailable, match="cannot be reached"):
        api.get_claim("default", "train")
