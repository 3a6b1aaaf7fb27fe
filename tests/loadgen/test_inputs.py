"""What the bench refuses before sending anything (one line, exit 2), and the requests it makes."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from appliance import cli
from appliance.grpc_limits import MAX_REQUEST_BYTES
from appliance.loadgen.options import Lengths, parse_lengths
from appliance.loadgen.workload import (
    MAX_PROMPT_BYTES,
    MAX_SYNTHETIC_WORDS,
    WORDS,
    Workload,
    load_prompts,
)
from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb


def one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.rstrip("\n")


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    base = ["--address", "127.0.0.1:1", "--model", "m"]
    rc = cli.main(["bench", *base, *args])
    return rc, one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "1,0"], "--concurrency '1,0': expected a comma-separated list of whole"),
        (["--concurrency", "two"], "--concurrency 'two': expected a comma-separated list"),
        (
            ["--rate", "5,-1"],
            "--rate '5,-1': expected a comma-separated list of requests per second",
        ),
        (["--rate", "1e6"], "--rate '1e6': expected a comma-separated list of requests per second"),
        (["--rate", "nan"], "--rate 'nan': expected"),
        (["--prompt-tokens", "normal:128"], "--prompt-tokens 'normal:128': expected N, normal:"),
        (["--output-tokens", "uniform:9,3"], "--output-tokens 'uniform:9,3': expected N,"),
        (["--output-tokens", "0"], "--output-tokens '0': expected N"),
        (["--requests", "5", "--duration", "2"], "--requests and --duration: give one of them"),
        (["--requests", "0"], "--requests 0: expected 1 to 1000000 per level"),
        (["--duration", "0"], "--duration 0.0: expected seconds in (0, 86400]"),
        (["--cache-policy", "only"], "--cache-policy 'only': expected one of bypass, default"),
        (["--timeout", "-1"], "--timeout -1.0: expected seconds"),
        (["--prompts", "/nonexistent/p.txt"], "--prompts /nonexistent/p.txt: No such file"),
        (["--model", " "], "--model: give the model name the deployment serves"),
        (["--max-in-flight", "0"], "--max-in-flight 0: expected 1 to 100000 outstanding"),
        (["--stop-after-timeouts", "-1"], "--stop-after-timeouts -1: expected 0 (never) to"),
        (["--stop-after-timeouts", "2.5"], "--stop-after-timeouts: expected an integer, got 2.5"),
        (["--warmup", "1e3"], "--warmup: expected an integer, got 1e3"),
        (["--duration", "5s"], "--duration: expected a number, got 5s"),
        (["--connect-timeout", "soon"], "--connect-timeout: expected a number, got soon"),
        (["--api-key-file", "/nonexistent/k"], "--api-key-file /nonexistent/k: No such file"),
        (["--api-key-file", "/dev/zero"], "--api-key-file /dev/zero: not an API key"),
        (["--ca-file", "/nonexistent/ca.pem"], "--ca-file /nonexistent/ca.pem: No such file"),
        (["--ca-file", "/dev/zero"], "--ca-file /dev/zero: more than 4,194,304 bytes"),
        (["--cert-file", "c.pem", "--key-file", "k.pem"], "--cert-file: a TLS option; give --ca"),
        (["--server-name", "gateway"], "--server-name: a TLS option; give --ca-file too"),
        (
            ["--prompt-tokens", "uniform:1,1000000"],
            f"--prompt-tokens 'uniform:1,1000000': expected N, normal:MEAN,STDDEV or "
            f"uniform:LOW,HIGH with lengths from 1 to {MAX_SYNTHETIC_WORDS} (the most words a "
            "request of 4 MiB carries)",
        ),
    ],
)
def test_bad_options_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    rc, line = bench(capsys, *args)
    assert rc == 2
    assert line.startswith(f"appliance bench: {message}"), line


def test_an_address_without_a_port_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["bench", "--address", "localhost", "--model", "m"])
    assert rc == 2
    assert one_line(capsys.readouterr().err) == (
        "appliance bench: --address 'localhost': expected HOST:PORT, e.g. 127.0.0.1:50051"
    )


def test_an_address_where_nothing_listens_is_refused_after_the_connect_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = f"127.0.0.1:{processes.free_port()}"
    rc = cli.main(["bench", "--address", address, "--model", "m", "--connect-timeout", "0.5"])
    assert rc == 2
    assert one_line(capsys.readouterr().err) == (
        f"appliance bench: --address {address}: nothing answered within 0.5 s "
        "(is the gateway running there? see --connect-timeout)"
    )


def test_a_server_that_is_not_the_gateway_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=1))  # serves no method at all
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        rc = cli.main(["bench", "--address", f"127.0.0.1:{port}", "--model", "m"])
    finally:
        server.stop(grace=None)
    assert rc == 2
    assert one_line(capsys.readouterr().err) == (
        f"appliance bench: 127.0.0.1:{port}: UNIMPLEMENTED: Method not found! "
        "(nothing there serves appliance.v1.Inference: is it the gateway?)"
    )


def test_an_output_directory_that_is_a_file_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "out"
    blocker.write_text("")
    rc, line = bench(capsys, "--out", str(blocker / "run"))
    assert rc == 2
    assert line == f"appliance bench: --out {blocker / 'run'}: Not a directory", line


def test_a_prompt_file_and_synthetic_lengths_exclude_each_other(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    rc, line = bench(capsys, "--prompts", str(prompts), "--prompt-tokens", "64")
    assert rc == 2
    assert line.startswith("appliance bench: --prompts and --prompt-tokens:"), line


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "--prompts {}: no prompts (the file is empty)"),
        ('{"prompt": "a"}\n{"prompt": 3}\n', "{}:2: 'prompt' must be a non-empty string"),
        ('{"prompt": "a"}\n\n{"promt": "b"}\n', "{}:3: unknown key 'promt'; known keys are prompt"),
        ('{"prompt": "a", "messages": []}\n', "{}:1: give exactly one of 'prompt' and 'messages'"),
        ('{"messages": [{"role": "bot", "content": "x"}]}\n', '{}:1: each message is {{"role"'),
        (
            '{"prompt": "a", "max_tokens": 0}\n',
            "{}:1: 'max_tokens' must be a whole number from 1 to",
        ),
        ('{"prompt": "a"}\n{oops\n', "{}:2: not JSON ("),
        ('{"prompt": "a"}\n' + "[" * 100_000 + "\n", "{}:2: not JSON (nested too deeply)"),
        (
            '{"prompt": "a", "max_tokens": 99999999999999999999}\n',
            "{}:1: 'max_tokens' must be a whole number from 1 to 1000000",
        ),
        ('{"prompt": "\\ud800"}\n', "{}:1: '\\ud800' at character 1 is a lone UTF-16 surrogate"),
        (
            '{"messages": [{"role": "user", "content": "ok \\udfff"}]}\n',
            "{}:1: '\\udfff' at character 4 is a lone UTF-16 surrogate",
        ),
    ],
)
def test_a_bad_prompt_file_names_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, message: str
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    rc, line = bench(capsys, "--prompts", str(prompts))
    assert rc == 2
    assert line.startswith("appliance bench: " + message.format(prompts)), line


def test_length_distributions_draw_whole_numbers_in_range() -> None:
    rng = np.random.default_rng(0)
    assert {parse_lengths("-", "7").draw(rng) for _ in range(10)} == {7}
    uniform = [parse_lengths("-", "uniform:3,5").draw(rng) for _ in range(300)]
    assert set(uniform) == {3, 4, 5}
    normal = [parse_lengths("-", "normal:128,32").draw(rng) for _ in range(2000)]
    assert min(normal) >= 1 and abs(np.mean(normal) - 128) < 4 and abs(np.std(normal) - 32) < 4
    assert Lengths("normal", 1, 100).draw(rng) >= 1


def test_prompt_files_plain_and_jsonl(tmp_path: Path) -> None:
    plain = tmp_path / "p.txt"
    plain.write_text("first question\n\n  second one  \n")
    assert [p.text for p in load_prompts(plain)] == ["first question", "  second one  "]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        '{"prompt": "hi", "max_tokens": 3}\n'
        '{"messages": [{"role": "system", "content": "be brief"}, '
        '{"role": "user", "content": "why?"}]}\n'
    )
    first, second = load_prompts(jsonl)
    assert (first.text, first.max_tokens) == ("hi", 3)
    assert second.messages == (("system", "be brief"), ("user", "why?"))


def test_the_same_seed_makes_the_same_requests(tmp_path: Path) -> None:
    from appliance.loadgen.options import settings

    def requests(seed: int, level: int) -> list[pb.GenerateRequest]:
        lengths = ["--prompt-tokens", "uniform:4,12", "--output-tokens", "normal:16,4"]
        args = cli.parser().parse_args(
            ["bench", "--address", "h:1", "--model", "m", *lengths, "--seed", str(seed)]
        )
        s = settings(args)
        workload = Workload(s, None, level)
        return [workload.next() for _ in range(5)]

    a, b, c = requests(1, 0), requests(1, 0), requests(2, 0)
    assert a == b and a != c and requests(1, 1) != a
    for r in a:
        assert 4 <= len(r.prompt.split()) <= 12
        assert r.cache_policy == pb.CACHE_POLICY_BYPASS and r.temperature == 0.0


def test_a_prompt_over_the_grpc_message_limit_is_refused_when_the_file_is_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a short one\n" + "word " * (MAX_REQUEST_BYTES // 5 + 1) + "\n")
    rc, line = bench(capsys, "--prompts", str(prompts))
    assert rc == 2
    assert line.startswith(f"appliance bench: {prompts}:2: the prompt is 4.0 MiB"), line
    assert "at most 4 MiB" in line


def test_chat_messages_over_the_grpc_message_limit_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    content = "x" * (MAX_REQUEST_BYTES // 2)
    message = json.dumps({"role": "user", "content": content})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(f'{{"messages": [{message}, {message}]}}\n')
    rc, line = bench(capsys, "--prompts", str(prompts))
    assert rc == 2
    assert line.startswith(f"appliance bench: {prompts}:1: the prompt is 4.0 MiB"), line


@pytest.mark.parametrize(
    ("argv", "missing"),
    [
        ([], "--address"),
        (["--address", "127.0.0.1:1"], "--model"),
        (["--model", "m"], "--address"),
    ],
)
def test_a_missing_required_option_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], missing: str
) -> None:
    rc = cli.main(["bench", *argv])
    line = one_line(capsys.readouterr().err)
    assert rc == 2
    assert line.startswith(f"appliance bench: {missing}: "), line


def test_a_malformed_key_in_the_environment_is_refused_without_echoing_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APPLIANCE_API_KEY", "ak_0123456789ab secret-part")
    rc, line = bench(capsys)
    assert (rc, line) == (2, "appliance bench: $APPLIANCE_API_KEY: not an API key")


def test_the_longest_synthetic_prompt_fits_a_request() -> None:
    longest = " ".join([max(WORDS, key=len)] * MAX_SYNTHETIC_WORDS)
    assert len(longest.encode()) <= MAX_PROMPT_BYTES
    lengths = parse_lengths("--prompt-tokens", "normal:100,1000000", MAX_SYNTHETIC_WORDS)
    rng = np.random.default_rng(0)
    assert max(lengths.draw(rng) for _ in range(100)) == MAX_SYNTHETIC_WORDS


def test_a_prompt_file_is_split_at_newlines_only(tmp_path: Path) -> None:
    # JSON strings may hold U+2028, U+0085 or a form feed unescaped (json.dumps with
    # ensure_ascii=False writes them so); str.splitlines would cut the line there.
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        '{"prompt": "a\u2028b"}\r\n{"prompt": "c\u0085d"}\n\n{"prompt": "e"}\n', newline=""
    )
    assert [p.text for p in load_prompts(jsonl)] == ["a\u2028b", "c\u0085d", "e"]
    plain = tmp_path / "p.txt"
    plain.write_text("page\x0cbreak\r\nsecond\n", newline="")
    assert [p.text for p in load_prompts(plain)] == ["page\x0cbreak", "second"]


def test_a_prompt_file_with_a_byte_order_mark_is_read_as_jsonl(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 3}\n')
    [prompt] = load_prompts(jsonl)
    assert (prompt.text, prompt.max_tokens) == ("hi", 3)
