"""The errors of talking to the Kubernetes API that code outside ``kubeapi`` handles.

They live apart from ``drasil.driver.kubeapi`` so that code which only names them (the
prepare path, which the GPU check runs with no API server and no ``kubernetes``
client installed) does not import the client. ``kubeapi`` raises them.
"""

from __future__ import annotations


class ConflictError(Exception):
    """The object changed under us (409/412): re-read and try again."""


class InvalidName(ValueError):
    """A namespace or object name that Kubernetes could not have stored."""


class ApiUnavailable(Exception):
    """The API server did not answer: refused, unreachable, or no answer in time."""


def http_answer(err: BaseException) -> tuple[int, str] | None:
    """(status, reason) of an API call the server answered with an error, else None.

    The client's exception carries both; read by attribute so that naming it needs
    no import of the client.
    """
    status, reason = getattr(err, "status", None), getattr(err, "reason", None)
    if isinstance(status, int) and isinstance(reason, str):
        return status, reason
    return None
