"""Classes the configuration names: a built-in name, or `package.module:Class` for one's own.

Cache tiers and inference backends are chosen this way. Importing a module the configuration names
runs its code: the configuration file is the operator's, as trusted as the gateway's own files.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping


class PluginError(ValueError):
    """A name that does not resolve to a class; the message is one line saying what to fix."""


def load_class(spec: str, builtin: Mapping[str, str], what: str) -> type:
    """The class `spec` names: a key of `builtin` (whose value is its `module:Class`), or a
    `package.module:Class` path."""
    path = builtin.get(spec)
    if path is None:
        module_name, sep, attribute = spec.partition(":")
        if not (sep and module_name and attribute.isidentifier()):
            known = ", ".join(repr(name) for name in builtin)
            raise PluginError(
                f"unknown {what} {spec!r}: expected one of {known}, or package.module:Class"
            )
        path = spec
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # whatever the module raises while importing: one line, not a trace
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PluginError(f"{what} {spec!r}: cannot import {module_name} ({why})") from None
    found = getattr(module, attribute, None)
    if not isinstance(found, type):
        raise PluginError(f"{what} {spec!r}: {module_name} has no class {attribute}")
    return found
