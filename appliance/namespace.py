"""A namespace: the tenant whose cached answers a request shares and whose API keys may name it.

One rule for every place a namespace comes from (a request, a cache administration call, the keys
file, `appliance keys add`): at most MAX_LENGTH characters, each printable (Python's
`str.isprintable`: no control, format or line-breaking characters; the plain space is allowed). A
namespace is part of Redis keys and of log lines, where such characters cannot travel unquoted.
"""

from __future__ import annotations

MAX_LENGTH = 64


def problem(name: str) -> str | None:
    """What is wrong with `name` as a namespace, as the end of a sentence; None: nothing."""
    if len(name) > MAX_LENGTH:
        return f"is longer than {MAX_LENGTH} characters"
    if not name.isprintable():
        return "holds a control or other unprintable character"
    return None
