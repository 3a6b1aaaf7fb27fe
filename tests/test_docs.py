"""What an operator copies from the README and docs/ is what the code takes: every option shown
beside a command exists in that command's parser, an option shown in brackets is one the parser
does not require, every option of `appliance engine` has its row in the table the README points
at, and every relative link names a file and heading that exist."""

from __future__ import annotations

import argparse
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
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


@pytest.mark.parametrize(("where", "command"), _command_cases())
def test_an_option_stands_where_its_parser_reads_it(where: str, command: str) -> None:
    """argparse reads a parser's options before the subcommand word, a subcommand's after it:
    `appliance cache --gateway H warm`, never `appliance cache warm --gateway H`."""
    words = command.replace("\\|", "|").replace("[", " ").replace("]", " ").split()
    p = PARSERS[words[0]]
    for n, word in enumerate(words[1:], 1):
        sub = _subcommands(p)
        if word.split("|")[0] in sub:
            p = sub[word.split("|")[0]]
            continue
        option = OPTION.match(word)
        if option is None or option.group(0) in _options(p):
            continue
        # A usage line that names no subcommand shows the options of those below (`--spec`).
        later = any(w.split("|")[0] in sub for w in words[n + 1 :])
        below, known = ([] if later else list(sub.values())), False
        while below and not known:
            known = option.group(0) in _options(below[0])
            below = below[1:] + list(_subcommands(below[0]).values())
        assert known, f"{where}: {option.group(0)} is not read where it stands: {command}"


@pytest.mark.parametrize(("where", "command"), _command_cases())
def test_a_value_shown_for_an_option_is_one_it_takes(where: str, command: str) -> None:
    """A literal value (not a placeholder such as FILE or N) is in the option's choices and
    passes its type; `a|b` alternatives each."""
    _, known = _parsed(command)
    words = command.replace("\\|", "|").replace("[", " ").replace("]", " ").split()
    for option, value in itertools.pairwise(words):
        action = known.get(option)
        value = value.strip("'\"")
        if action is None or action.nargs == 0 or value.startswith("-"):
            continue
        if re.match(r"[A-Z]", value):
            continue
        for alternative in value.split("|"):
            if action.choices is not None:
                assert alternative in action.choices, f"{where}: {option} {alternative}"
            elif callable(action.type):
                try:
                    action.type(alternative)
                except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
                    pytest.fail(f"{where}: {option} {alternative}: {exc}")


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


def test_the_http_statuses_the_readme_names_as_grpc_are_the_ones_reported() -> None:
    """README: an HTTP error answer refused before its model was known is reported under the
    gRPC status it names for each HTTP status; the HTTP API reports them by WIRE_STATUS."""
    from appliance.gateway.http_api import WIRE_STATUS

    text = " ".join((ROOT / "README.md").read_text().split())
    sentence = text.split("its HTTP status named as gRPC's: ", 1)[1].split(". ", 1)[0]
    named = {}
    for statuses, code in re.findall(r"((?:\d{3}(?:, | and )?)+) `([A-Z_]+)`", sentence):
        for status in re.findall(r"\d{3}", statuses):
            named[int(status)] = code
    # A status missing from WIRE_STATUS is reported INVALID_ARGUMENT (417, an unmet Expect).
    reported = {s: WIRE_STATUS.get(s, grpc.StatusCode.INVALID_ARGUMENT).name for s in named}
    assert named == reported
    # No request ends in 500: the table's 500 is what a fault of the gateway itself would be.
    assert sorted(set(WIRE_STATUS) - set(named)) == [500]


def test_the_host_tuning_profile_table_has_every_key_with_its_default() -> None:
    """docs/HOST_TUNING.md: "All keys are optional; defaults shown"."""
    import dataclasses
    import tomllib

    from host_tuning import profile

    doc = (ROOT / "docs/HOST_TUNING.md").read_text()
    section = doc.split("## Profile (TOML)", 1)[1].split("\n#", 1)[0]
    defaults = {f.name: f.default for f in dataclasses.fields(profile.Profile)}
    shown, wrong = set(), []
    table = ""
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[1].startswith("`"):
            continue
        table = cells[0].strip("`[]") or table
        for key in re.findall(r"`([a-z_0-9]+)`", cells[1]):
            shown.add((table, key))
            field = profile._RENAMED.get((table, key), key)
            if field not in defaults:
                wrong.append(f"[{table}] {key}: no such key")
                continue
            text = cells[2].strip("`")
            value = None if text == "none" else tomllib.loads(f"v = {text}")["v"]
            default = defaults[field]
            if value != (list(default) if isinstance(default, tuple) else default):
                wrong.append(f"[{table}] {key}: shown {text}, default {default!r}")
    assert wrong == []
    assert sorted({(t, k) for t, keys in profile._SECTIONS.items() for k in keys} - shown) == []


# `key = value`, or a commented-out `# key = value`, of a TOML sample.
SETTING = re.compile(r"^(?P<off># ?)?(?P<key>[a-z_0-9]+)\s*=\s*(?P<value>[^#\s][^#]*?)\s*(?:#.*)?$")


def test_the_build_spec_sample_is_a_spec_and_shows_the_defaults(tmp_path: Path) -> None:
    """docs/ENGINE_BUILD.md's spec: it parses, each value but the paths is the default (leaving
    its line out changes nothing), and each commented-out key is one the spec takes."""
    import tomllib

    from engine_build.errors import SpecError
    from engine_build.spec import parse_spec

    doc = (ROOT / "docs/ENGINE_BUILD.md").read_text()
    sample = doc.split("## The build spec (TOML)", 1)[1].split("```toml\n", 1)[1]
    lines = sample.split("```", 1)[0].splitlines()
    source = tmp_path / "spec.toml"

    def parse(kept: list[str]) -> object:
        text = "\n".join(kept)
        return parse_spec(text, tomllib.loads(text), source)

    whole = parse(lines)
    table, keys, not_default = "", set[str](), list[str]()
    paths = {"model.hf_model_dir", "model.work_dir", "trtllm.venv", "trtllm.quantize_script"}
    for n, line in enumerate(lines):
        if header := re.match(r"^\[([^\]]+)\]", line):
            table = header.group(1)
        setting = SETTING.match(line)
        if setting is None:
            continue
        key = f"{table}.{setting.group('key')}"
        if not setting.group("off"):
            keys.add(key)
            if key not in paths and parse(lines[:n] + lines[n + 1 :]) != whole:
                not_default.append(line)
        elif key not in keys and not setting.group("value").endswith(("[", ",")):
            try:
                parse([*lines[:n], line.split(" ", 1)[1], *lines[n + 1 :]])
            except SpecError as exc:
                # Read and judged by its value (opt_num_tokens beside multiple_profiles).
                assert f"key '{key}': " in str(exc) and "unknown key" not in str(exc), str(exc)
    assert not_default == []


def test_the_fleet_service_config_shown_is_the_one_shipped() -> None:
    import json

    doc = (ROOT / "docs/OPERATIONS.md").read_text()
    shown = doc.split("### Clients: balancing on health", 1)[1].split("```json\n", 1)[1]
    shipped = (ROOT / "appliance/data/fleet-service-config.json").read_text()
    assert json.loads(shown.split("```", 1)[0]) == json.loads(shipped)


def test_the_hardening_table_gives_the_exposures_the_unit_tests_hold() -> None:
    from tests.system.test_units import EXPOSURE_LIMITS

    doc = (ROOT / "docs/OPERATIONS.md").read_text()
    section = doc.split("## Hardening", 1)[1].split("\n## ", 1)[0]
    shown = {
        unit: float(exposure)
        for unit, exposure in re.findall(r"^\| `([\w.-]+)` \| (\d+\.\d+)", section, re.M)
    }
    assert {u: shown.get(u) for u in EXPOSURE_LIMITS} == EXPOSURE_LIMITS
