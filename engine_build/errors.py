"""The one exception type the CLI turns into a one-line message and a non-zero exit.

Every refusal (bad spec, unreadable checkpoint, wrong TensorRT-LLM, failed stage, model that does
not fit) is raised as :class:`BuildError` so ``cli.main`` never prints a traceback for operator
mistakes; anything else escaping is a bug and is allowed to show its traceback.
"""

from __future__ import annotations


class BuildError(Exception):
    """An operator-facing failure; ``str(err)`` is the whole message, one line."""


class SpecError(BuildError):
    """The operator's input is wrong (spec file, command-line value): fix it and rerun; exit 2."""


class DoesNotFit(BuildError):
    """The plan does not fit the GPU; kept apart so ``build`` and ``plan`` can show the table."""
