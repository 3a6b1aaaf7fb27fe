"""The guide types of guided decoding, apart from `pbtxt` so the engine can read them on a host
without tritonclient (whose model-config protobufs `pbtxt` builds on)."""

from __future__ import annotations

# The guide types the tensorrtllm backend maps to a guide.
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
