"""The limits on untrusted input, in one place: configs, config files and quantities.

Opaque configs come from users through the API server, which stores them without
looking inside, and the controller, the node plugin and ``drasil validate-config``
all decode them. Every limit below is checked at the boundary, before the work it
bounds (parsing, recursion, Decimal arithmetic, pydantic), so that no input of any
shape costs more than a few milliseconds or escapes as anything but ``ConfigError``
(``drasil.api.config``) or ``QuantityError`` (``drasil.api.quantity``).

Our configs are a few hundred bytes, about 5 levels deep, with a handful of values;
the limits leave ample room for real ones and none for hostile ones.
"""

from __future__ import annotations

import sys
from typing import Final

MAX_PARAMETERS_BYTES: Final = 10 * 1024
"""The API server's limit on ``opaque.parameters`` (OpaqueParametersMaxLength), as
compact JSON; text is counted as it is (UTF-8 bytes)."""

MAX_FILE_BYTES: Final = 1024 * 1024
"""A file of YAML/JSON documents (``drasil validate-config``): 1 MiB. The API server
stores no object larger than 1.5 MiB, and a claim with its config is a few KiB."""

MAX_DEPTH: Final = 32
"""Objects and lists nested in one another, in any document (a config needs 5, a
ResourceClaimTemplate with its config 12). Measured without recursion before parsing
or validating, so deep input cannot exhaust Python's stack."""

MAX_VALUES: Final = 2048
"""Values in one config: every object, list, key's value and list item, counted as
they are reached (shared references count each time), so a structure that repeats
a part exponentially often is refused after 2048 steps."""

MAX_INTEGER_DIGITS: Final = 20
"""Digits of an integer in JSON or YAML (int64 has 19): longer ones are refused before
Python converts them, which is quadratic in their length and fails past 4300."""

MAX_QUANTITY_CHARS: Final = 64
"""Characters of a quantity string such as ``40Gi`` (with sign, point and suffix)."""

QUANTITY_EXPONENTS: Final = range(-64, 64)
"""Where the leading digit of a non-zero quantity may be: ``10**e`` for ``e`` in this
range, so its magnitude is at least 1e-64 and below 1e64. Checked on the text before
any arithmetic: ``1e999999`` is refused at once instead of computing a million digits.
Kubernetes itself keeps a quantity's exponent in an int32 and caps binary ones at
2^63-1; 1e64 holds every value Kubernetes' own examples use (CEL's ``quantity()``
included) and keeps exact arithmetic on quantities small."""

MAX_BYTES: Final = 2**63 - 1
"""A byte count (a memory limit): Kubernetes' int64 bound, 8Ei minus one byte."""

MAX_OBJECT_NESTING: Final = 5_200
"""How deep a Kubernetes object a user wrote can nest: 10 KiB of ``opaque.parameters``
hold 5,120 levels of ``[[[…]]]``, and the API server stores them without looking
inside. Every daemon must at least decode such an object (and then refuse it, per
object): JSON and YAML decoders, kopf's and the kubernetes client's included, recurse
once per level."""

RECURSION_LIMIT: Final = 12_000
"""Python frames allowed: room for MAX_OBJECT_NESTING levels of decoding (about two
frames each) and for CEL selectors nested as deep as cel-go's parser allows."""


def allow_nesting() -> None:
    """Raise Python's recursion limit to ``RECURSION_LIMIT`` (never lower it).

    Called where every process starts (both daemons, the CLI, the benchmarks that
    compile CEL, the test session), never on import: a module that changes the whole
    process's limit when imported would do it for whoever imports it. The C stack it
    needs, a few MiB at most, fits the 8 MiB main and thread stacks of Linux.
    """
    if sys.getrecursionlimit() < RECURSION_LIMIT:
        sys.setrecursionlimit(RECURSION_LIMIT)


MAX_BINDING_CONDITIONS: Final = 4
"""Condition types in a device's ``bindingConditions`` (KEP-5007,
BindingConditionsMaxSize); each is a label name (``drasil.dev/Attached``)."""

MAX_BINDING_FAILURE_CONDITIONS: Final = 4
"""Condition types in a device's ``bindingFailureConditions``
(BindingFailureConditionsMaxSize)."""

MAX_SIMULATED_ATTACH_SECONDS: Final = 3600
"""The simulated fabric's attach delay: an hour is far past kube-scheduler's default
binding timeout (600 s) and keeps a typo from parking a claim for days."""
