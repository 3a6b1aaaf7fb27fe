"""What an operator copies from the README and docs/ is what the code takes: every option shown
beside a command exists in that command's parser, an option shown in brackets is one the parser
does not require, every option of `appliance engine` has its row in the table the README points
at, and every relative link names a file and heading that exist."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance import cli as appliance_cli
from engine_build import cli as engine_build_cli
from host_tuning import cli as host_tune_cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PARSERS = {
    "appliance": appliance_cli.parser(),
    "engine-build": engine_build_cli.parser(),
    "host-tune": host_tune_cli._parser(),
}
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _commands(doc: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each command of the three CLIs: a code span starting with one, or a line of
    a code block (its `\\` continuations joined) that names one."""
    block, pending, start = False, "", 0
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            block = not block
            continue
        if block:
            start = start or n
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            text, pending, first = pending + line, "", start
            start = 0
            code = text.split(" #", 1)[0]
            for cli in PARSERS:
                at = re.search(rf"(?:^|[\s/]){cli}\s", code + " ")
                if at:
                    yield first, code[at.start() :].strip().removeprefix("/")
        else:
            for span in re.findall(r"`([^`]+)`", line):
                if span.split(" ", 1)[0] in PARSERS:
                    yield n, span


def _parsed(command: str) -> tuple[str, dict[str, argparse.Action]]:
    """The (sub)command `command` names (an `a|b` alternative: its first) and the options it
    takes: its own and those of the parsers above it (`appliance cache --gateway HOST warm`)."""
    words = command.replace("\\|", "|").replace("[", " ").replace("]", " ").split()
    p, path = PARSERS[words[0]], [words[0]]
    known = _options(p)
    for word in words[1:]:
        name = word.split("|")[0]
        sub = _subcommands(p)
        if name in sub:
            p, path = sub[name], [*path, name]
            known |= _options(p)
    # Naming no subcommand of those that take the option (README: `engine-build --spec`).
    below = list(_subcommands(p).values())
    while below:
        known |= _options(below[0])
        below = below[1:] + list(_subcommands(below[0]).values())
    return " ".join(path), known


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in p._actions for o in a.option_strings}


def _shown(command: str) -> Iterator[tuple[str, bool]]:
    """Each option of a usage line and whether it stands inside brackets."""
    depth = 0
    for token in re.findall(r"\[|\]|(?<![\w-])--[a-z][a-z0-9-]*", command):
        depth += {"[": 1, "]": -1}.get(token, 0)
        if token.startswith("--"):
            yield token, depth > 0


def _command_cases() -> list[object]:
    return [
        pytest.param(f"{d.relative_to(ROOT)}:{n}", c, id=f"{d.name}:{n}")
        for d in DOCS
        for n, c in _commands(d)
    ]


@pytest.mark.parametrize(("where", "command"), _command_cases())
def test_a_documented_command_line_is_one_its_parser_takes(where: str, command: str) -> None:
    name, known = _parsed(command)
    for option, optional in _shown(command):
        assert option in known, f"{where}: `{name}` has no option {option}: {command}"
        assert not (optional and known[option].required), (
            f"{where}: `{name}` requires {option}, shown in brackets: {command}"
        )


def test_every_engine_option_has_its_row_in_the_options_table() -> None:
    """The README's `appliance engine` line sends the operator to this table for the options."""
    doc = (ROOT / "docs/MODEL_REPOSITORY.md").read_text()
    section = doc.split("## Engine server options (`appliance engine`)", 1)[1].split("\n## ", 1)[0]
    rows = {
        o
        for line in section.splitlines()
        if line.startswith("| `")
        for o in OPTION.findall(line.split(" | ", 1)[0])
    }
    engine = _subcommands(PARSERS["appliance"])["engine"]
    options = {a.option_strings[-1] for a in engine._actions if a.option_strings} - {"--help"}
    assert sorted(options - rows) == []


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats -N."""
    seen: dict[str, int] = {}
    block = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            block = not block
        heading = re.match(r"#+\s+(.*)", line)
        if heading and not block:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_every_relative_link_names_a_file_and_heading_that_exist() -> None:
    broken = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                file = doc.parent / path if path else doc
                if not file.exists() or (
                    anchor and file.suffix == ".md" and anchor not in _anchors(file)
                ):
                    broken.append(f"{doc.relative_to(ROOT)}:{n}: {target}")
    assert broken == []
