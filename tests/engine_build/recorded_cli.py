"""argparse parsers rebuilt from the recorded TensorRT-LLM 1.2 argument lists (data/*.json).

Used twice: the command tests parse every generated argv with them (an unknown flag or a value
outside the real choices fails the test), and the fake installation's scripts parse their own
argv with them, so the stand-ins reject what the real tools would reject.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, NoReturn

DATA = Path(__file__).parent / "data" / "trtllm_1_2_cli.json"  # same layout in fake_support/
_TYPES: dict[str, Any] = {"str": str, "int": int, "float": float}


class CliError(Exception):
    """The recorded CLI rejected an argv."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(message)


def parser_for(tool: str, data: Path = DATA) -> argparse.ArgumentParser:
    spec = json.loads(data.read_text(encoding="utf-8"))[tool]
    p = _Parser(prog=tool, add_help=False, allow_abbrev=False)
    for arg in spec["arguments"]:
        names = [arg["flag"], *arg.get("aliases", [])]
        kwargs: dict[str, Any] = {}
        if "action" in arg:
            kwargs["action"] = arg["action"]
        else:
            kwargs["type"] = _TYPES[arg["type"]]
        if "choices" in arg:
            kwargs["choices"] = arg["choices"]
        if "nargs" in arg:
            kwargs["nargs"] = arg["nargs"]
        p.add_argument(*names, **kwargs)
    return p


def parse(tool: str, argv: list[str]) -> argparse.Namespace:
    return parser_for(tool).parse_args(argv)
