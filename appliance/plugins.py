"""Classes the configuration names: a built-in name, or `package.module:Class` for one's own.

Cache tiers and inference backends are chosen this way. Importing a module the configuration names
runs its code: the configuration file is the operator's, as trusted as the gateway's own files.

What such a class must define is checked when the configuration is read (`check_members`), against
its base class alone: the base's abstract members have no default and must be defined; its other
public members have a default that a subclass inherits. A class missing one is refused at start-up
in one line naming the members, never by an AttributeError on the first request.
"""

from __future__ import annotations

import dataclasses
import dis
import importlib
import inspect
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


def members(base: type) -> tuple[list[str], list[str]]:
    """The public members `base` declares: (those without a default, its abstract ones; those
    with one, which a subclass inherits)."""
    required = sorted(getattr(base, "__abstractmethods__", ()))
    defaulted = sorted(n for n in vars(base) if not n.startswith("_") and n not in required)
    return required, defaulted


def _init_sets(klass: type, name: str) -> bool:
    """Whether the `__init__` `klass` defines itself sets the attribute `name` on the instance."""
    code = getattr(vars(klass).get("__init__"), "__code__", None)
    return code is not None and any(
        i.opname == "STORE_ATTR" and i.argval == name for i in dis.get_instructions(code)
    )


def _has_member(found: type, name: str) -> bool:
    """Whether instances of `found` have the attribute `name`: on the class, declared in its
    annotations (a dataclass's fields among them), or set by an `__init__` of its MRO."""
    if hasattr(found, name):
        return True
    return any(
        name in inspect.get_annotations(klass) or _init_sets(klass, name) for klass in found.__mro__
    )


def _sets_read_only(found: type, base: type, name: str) -> bool:
    """Whether `found`, a subclass of `base`, sets on its instances (an `__init__` of a class
    below `base`, or a dataclass field's) a member `base` defines as a property without a setter
    that `found` leaves in place: Python refuses that assignment when the instance is made."""
    member = inspect.getattr_static(base, name, None)
    if not isinstance(member, property) or member.fset is not None:
        return False
    if inspect.getattr_static(found, name, None) is not member:
        return False  # the class overrides it (a property, a class attribute, a field's default)
    if dataclasses.is_dataclass(found) and name in {f.name for f in dataclasses.fields(found)}:
        return True
    below = found.__mro__[: found.__mro__.index(base)]
    return any(_init_sets(klass, name) for klass in below)


def check_members(found: type, base: type, spec: str, what: str, *, structural: bool) -> None:
    """Refuses, in one PluginError line naming the members and saying what to do, a class the
    configuration names (`spec`) that lacks a member of `base`: a subclass must define the members
    `base` has no default for; a class that is not one (accepted only where `structural`) must have
    every member of `base`, as a method, property or class attribute, or as an attribute its
    instances have (`_has_member`).

    A class that is not a subclass gets no defaults: they would have to be set on a class the
    gateway does not own (changing it for every other user of it), or on a subclass made here
    (which a `from_config` that names its own class would bypass). One line saying to subclass
    `base` says how to inherit them instead."""
    name = found.__qualname__
    path = f"{base.__module__}.{base.__qualname__}"
    required, defaulted = members(base)
    if base in found.__mro__:
        if shadowed := [m for m in (*required, *defaulted) if _sets_read_only(found, base, m)]:
            them = "it" if len(shadowed) == 1 else "them"
            raise PluginError(
                f"{what} {spec!r}: {name} sets {', '.join(shadowed)} on its instances, "
                f"{'a read-only property' if len(shadowed) == 1 else 'read-only properties'} "
                f"of {path}: define {them} as a property or a class attribute (a dataclass "
                "field with a default)"
            )
        if missing := sorted(getattr(found, "__abstractmethods__", ())):
            raise PluginError(
                f"{what} {spec!r}: {name} does not define {', '.join(missing)} "
                f"({path} has no default for them)"
            )
        return
    if not structural:
        raise PluginError(
            f"{what} {spec!r}: {name} is not a subclass of {path}: subclass it to inherit its "
            f"defaults, and define {', '.join(required)}"
        )
    lacking = [m for m in (*required, *defaulted) if not _has_member(found, m)]
    if not lacking:
        return
    undefined = [m for m in lacking if m in required]
    inherited = [m for m in lacking if m not in required]
    fix = [f"define {', '.join(undefined)}"] if undefined else []
    if inherited:
        fix.append(f"subclass {path} to inherit its defaults for {', '.join(inherited)}")
    raise PluginError(f"{what} {spec!r}: {name} lacks members: {'; '.join(fix)}")
