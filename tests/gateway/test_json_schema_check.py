"""A guide's or a tool's JSON Schema checked against the metaschema of the draft it names, and
nothing fetched: a "$schema" other than a known draft's is refused, whatever its URL."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from appliance.gateway.errors import RequestError
from appliance.gateway.request import MAX_REGEX_GUIDE_BYTES, MAX_SCHEMA_DEPTH, check_json_schema

DRAFT_7 = "http://json-schema.org/draft-07/schema#"


@pytest.fixture
def web() -> Iterator[tuple[str, list[str]]]:
    """A local web server's address and the paths asked of it."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"type": "object"}')

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", asked
    server.shutdown()
    thread.join()


@pytest.mark.parametrize(
    "meta",
    [
        None,
        DRAFT_7,
        "http://json-schema.org/draft-04/schema#",
        "https://json-schema.org/draft/2019-09/schema",
        "https://json-schema.org/draft/2020-12/schema",
    ],
)
def test_a_schema_of_a_known_draft_is_accepted(meta: str | None) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    check_json_schema(json.dumps(schema if meta is None else {"$schema": meta, **schema}))


def test_a_schema_its_draft_refuses_is_refused_with_the_place() -> None:
    # Draft 7's "dependencies" takes schemas or arrays of names, not numbers.
    with pytest.raises(RequestError) as refused:
        check_json_schema(json.dumps({"$schema": DRAFT_7, "dependencies": {"a": 5}}))
    assert refused.value.message.startswith("the JSON Schema is not valid at dependencies/a: ")


@pytest.mark.parametrize(
    "text",
    ['{"properties": {"\\ud800": {}}}'],  # a lone surrogate: no UTF-8 text holds it
    ids=["surrogate"],
)
def test_a_schema_the_checker_cannot_walk_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(RequestError) as refused:
        check_json_schema(text)
    assert refused.value.message == (
        "the JSON Schema is nested too deeply or holds text that is not valid Unicode"
    )


def _nested(levels: int) -> str:
    """A schema whose JSON is `levels` deep: objects nested in "properties" (two levels each)."""
    objects, odd = divmod(levels - 1, 2)
    inner = '{"enum": [1]}' if odd else '{"type": "integer"}'
    return '{"type": "object", "properties": {"a": ' * objects + inner + "}}" * objects


def test_a_schema_nested_past_the_limit_is_refused_before_its_compile() -> None:
    """xgrammar's compile time grows with the cube of the nesting (127 nested objects, which the
    metaschema check takes, compile for seconds); no real schema nests 64 levels of JSON."""
    check_json_schema(_nested(MAX_SCHEMA_DEPTH))
    for levels in (MAX_SCHEMA_DEPTH + 1, 254):
        with pytest.raises(RequestError) as refused:
            check_json_schema(_nested(levels))
        assert refused.value.message == (
            f"the JSON Schema is nested {levels} levels deep (objects and arrays); the limit is "
            f"{MAX_SCHEMA_DEPTH}: flatten it, or name repeated parts in $defs and $ref them"
        )
        assert refused.value.field == "guide"


LONG = "a" * (MAX_REGEX_GUIDE_BYTES + 1)


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "string", "pattern": LONG}, "pattern"),
        ({"properties": {"x": {"items": {"pattern": LONG}}}}, "properties/x/items/pattern"),
        ({"patternProperties": {LONG: {}}}, "patternProperties"),
    ],
)
def test_a_pattern_longer_than_a_regex_guide_is_refused(schema: object, where: str) -> None:
    """A schema's regular expressions are bounded as a regex guide is: xgrammar compiles each
    (60 KB of nested groups overflow its stack)."""
    with pytest.raises(RequestError) as refused:
        check_json_schema(json.dumps(schema))
    assert refused.value.message == (
        f"the JSON Schema's regular expression at {where} is {len(LONG)} bytes; the limit is "
        f"{MAX_REGEX_GUIDE_BYTES}"
    )
    assert refused.value.field == "guide"


def test_a_long_pattern_as_instance_data_or_at_the_limit_is_accepted() -> None:
    check_json_schema(json.dumps({"pattern": "a" * MAX_REGEX_GUIDE_BYTES}))
    for data in ("enum", "const", "default", "examples"):
        value = [{"pattern": LONG}] if data in ("enum", "examples") else {"pattern": LONG}
        check_json_schema(json.dumps({data: value}))


def test_an_unknown_metaschema_is_refused_and_never_fetched(web: tuple[str, list[str]]) -> None:
    address, asked = web
    with pytest.raises(RequestError) as refused:
        check_json_schema(json.dumps({"$schema": f"{address}/meta", "type": "object"}))
    assert refused.value.message == (
        f"the JSON Schema's $schema '{address}/meta' is not a draft checked here: name "
        "draft 4, 6, 7, 2019-09 or 2020-12, or leave $schema out"
    )
    # References are the engine's to resolve (or refuse); checking the schema fetches none.
    check_json_schema(json.dumps({"$ref": f"{address}/ref"}))
    check_json_schema(json.dumps({"properties": {"a": {"$schema": f"{address}/nested"}}}))
    assert asked == []
