"""Runs the engine's guide compile (appliance.engine.guided, from the installed venv) with a small
memory limit and a short deadline, and prints what it refused as one JSON line. test_e2e.py runs
it inside the booted container in a unit with the engine unit's sandbox. Usage: probe MODELS_DIR
(`make-tiny-model --guided-decoding`'s --dest)."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

# 450 nested objects: minutes of compile (its time grows with the cube of the depth).
SLOW_SCHEMA = '{"type":"object","properties":{"a":' * 450 + '{"type":"integer"}' + "}}" * 450
# 200 nested arrays: more than 1 MiB of memory to compile.
LARGE_SCHEMA = '{"type": "array", "items": ' * 200 + "{}" + "}" * 200


def main(models: Path) -> None:
    from appliance.engine.guided import Grammars, Guide, GuideError

    vocab = json.loads((models / "model" / "config.json").read_text())["vocab_size"]
    info = models / "repo" / "tensorrt_llm" / "tokenizer" / "xgrammar_tokenizer_info.json"
    grammars = Grammars.load(info, vocab)

    def refusal(kind: str, text: str) -> str:
        try:
            grammars.compile(Guide(kind, text))
        except GuideError as exc:
            return str(exc)
        return "compiled"

    memory, deadline = grammars.memory_bytes, grammars.deadline_s
    grammars.memory_bytes = 1 << 20
    past_memory = refusal("json_schema", LARGE_SCHEMA)
    grammars.memory_bytes, grammars.deadline_s = memory, 0.5
    past_deadline = refusal("json_schema", SLOW_SCHEMA)
    grammars.deadline_s = deadline
    print(
        json.dumps(
            {
                "memory": past_memory,
                "deadline": past_deadline,
                "after": refusal("json_schema", '{"enum": ["after"]}'),
                "children": [p.name for p in multiprocessing.active_children()],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
