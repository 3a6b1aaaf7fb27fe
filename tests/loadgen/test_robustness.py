"""The bench against targets that misbehave (answers held forever, streams cut short, a gateway
that goes away) and the ways a run is stopped: every request is counted, nothing hangs."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from appliance import cli
from appliance.loadgen import report
from appliance.loadgen.options import settings
from appliance.loadgen.progress import Progress
from appliance.loadgen.runner import UNAVAILABLE_FOR_S, UNAVAILABLE_RUN, LoadRunner
from appliance.loadgen.stats import INTERRUPTED
from appliance.v1 import inference_pb2 as pb
from tests.loadgen.fakes import FakeGateway, answers_at_once, fake_gateway, final_answer
from tests.loadgen.test_bench_cli import interrupted_run


def bench(address: str, out: Path, *args: str) -> int:
    base = ["bench", "--address", address, "--model", "m", "--warmup", "0", "--out", str(out)]
    return cli.main([*base, *args])


def levels(out: Path) -> list[dict[str, Any]]:
    document = json.loads((out / "bench.json").read_text())
    # One row per arrival: those sent, and those over --max-in-flight (NOT_SENT).
    arrivals = sum(lv["sent"] + lv["errors"].get("NOT_SENT", 0) for lv in document["levels"])
    assert len(document["requests"]) == arrivals
    return list(document["levels"])


def held(
    fake: FakeGateway, request: pb.GenerateRequest, context: grpc.ServicerContext
) -> Iterator[pb.GenerateResponse]:
    fake.hold(context)
    yield from ()


def test_open_loop_arrivals_over_max_in_flight_are_counted_not_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    with fake_gateway(held) as (address, _, _):
        rc = bench(
            address,
            out,
            *("--rate", "10000", "--requests", "10", "--max-in-flight", "3", "--timeout", "1"),
            *("--stop-after-timeouts", "0"),  # the 3 held requests time out in a row
        )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "3 sent, 0 ok, 3 errors, 7 not sent (over --max-in-flight)" in printed
    assert "errors: DEADLINE_EXCEEDED 3, NOT_SENT 7" in printed
    (level,) = levels(out)
    assert (level["sent"], level["ok"]) == (3, 0)  # the 7 over the cap were never sent
    assert level["errors"] == {"DEADLINE_EXCEEDED": 3, "NOT_SENT": 7}


@pytest.mark.timeout(30)
def test_an_open_loop_level_ends_at_its_duration_not_at_the_next_arrival(tmp_path: Path) -> None:
    # At 0.001/s the first arrival is due (for this seed) long after the level's 0.2 s.
    out = tmp_path / "run"
    with fake_gateway(held) as (address, _, _):
        rc = bench(address, out, "--rate", "0.001", "--duration", "0.2")
    assert rc == 0
    (level,) = levels(out)
    assert (level["sent"], level["wall_s"], level["request_throughput"]) == (0, 0.0, 0.0)


def test_a_stream_without_its_final_message_is_a_counted_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def cut_short(
        fake: FakeGateway, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(request_id="cut", text="x", token_ids=[1])

    out = tmp_path / "run"
    with fake_gateway(cut_short) as (address, _, _):
        rc = bench(address, out, "--requests", "3")
    assert rc == 0
    assert "errors: NO_FINAL 3" in capsys.readouterr().out
    (level,) = levels(out)
    assert (level["ok"], level["errors"]) == (0, {"NO_FINAL": 3})
    assert all(d is None for d in level["metrics"].values())


def test_a_gateway_that_goes_away_ends_the_run_with_what_was_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    answered = 0
    lock = threading.Lock()

    def then_gone(
        fake: FakeGateway, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        nonlocal answered
        with lock:
            answered += 1
            if answered == 3:
                threading.Thread(target=server.stop, args=(None,)).start()
        yield final_answer()

    out = tmp_path / "run"
    with fake_gateway(then_gone) as (address, _, server):
        rc = bench(address, out, "--duration", "60")
    err = capsys.readouterr().err.splitlines()
    assert rc == 1
    assert err[-1].startswith(f"appliance bench: {address} became unreachable: "), err[-1]
    assert err[-1].endswith(f"what was measured before is printed above and written to {out}")
    (level,) = levels(out)
    assert 2 <= level["ok"] <= 3 and set(level["errors"]) == {"UNAVAILABLE"}
    assert json.loads((out / "bench.json").read_text())["run"]["unreachable"].startswith(address)


async def test_an_rpc_cancelled_by_the_bench_itself_is_interrupted_not_an_error() -> None:
    class CancelledStub:
        def Generate(
            self, request: pb.GenerateRequest, timeout: float, metadata: object
        ) -> AsyncIterator[pb.GenerateResponse]:
            async def stream() -> AsyncIterator[pb.GenerateResponse]:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "Cancelled"
                )
                yield pb.GenerateResponse()

            return stream()

    args = cli.parser().parse_args(["bench", "--address", "h:1", "--model", "m"])
    stub: Any = CancelledStub()
    runner = LoadRunner(settings(args), None, stub, Progress(sys.stderr))
    runner.interrupt()  # the RPC saw the cancellation before the task
    record = await runner._one("concurrency 1", 0, pb.GenerateRequest(model="m", max_tokens=4))
    assert record.status == INTERRUPTED
    assert runner.level_errors == 0


def test_sigterm_writes_what_was_measured_and_exits_143(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with fake_gateway(answers_at_once) as (address, _, _):
        returncode, stdout, stderr = interrupted_run(address, "m", out, signal.SIGTERM)
    assert returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted: ending the requests in flight" in stderr
    assert "| concurrency 1 | " in stdout
    document = json.loads((out / "bench.json").read_text())
    assert document["run"]["interrupted"] is True
    (level,) = document["levels"]
    assert level["ok"] >= 1 and level["errors"] == {}


def test_the_table_says_how_many_values_each_row_is_over() -> None:
    from appliance.loadgen.options import Level
    from appliance.loadgen.report import level_table
    from appliance.loadgen.stats import Record, summarize

    answered = Record("concurrency 1", 0, 0.0, ttft_s=0.1, latency_s=0.5, output_tokens=5)
    answered.cache_tier = "MISS"
    empty = Record("concurrency 1", 1, 0.5, latency_s=0.2, output_tokens=0, cache_tier="MISS")
    table = level_table(summarize(Level("concurrency", 1), [answered, empty]))
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in table.splitlines()
        if line.startswith("| ")
    }
    assert rows["metric"] == "n"
    assert rows["Time to first token (ms)"] == "1"  # the empty answer has no first token
    assert rows["Request latency (ms)"] == "2"
    assert rows["Request throughput (requests/s)"] == "2"


def test_an_error_message_is_shown_once_per_status_escaped_and_cut() -> None:
    """The server's words are not trusted on the terminal: control characters are escaped and
    a long message is cut."""
    from appliance.loadgen.options import Level
    from appliance.loadgen.report import MAX_ERROR_SHOWN, level_table
    from appliance.loadgen.stats import Record, summarize

    records = []
    for index, text in enumerate(("over its rate \x1b[2J\nlimit", "second", "x" * 2000)):
        record = Record("concurrency 1", index, float(index), latency_s=0.1)
        record.status = "RESOURCE_EXHAUSTED" if index < 2 else "INTERNAL"
        record.error = text
        records.append(record)
    lines = level_table(summarize(Level("concurrency", 1), records)).splitlines()
    shown = [line for line in lines if line.startswith("  ")]
    assert shown[0] == "  INTERNAL, the first: " + "x" * MAX_ERROR_SHOWN + "..."
    assert shown[1] == "  RESOURCE_EXHAUSTED, the first: over its rate \\x1b[2J\\nlimit"
    assert len(shown) == 2


def test_a_full_disk_under_out_is_one_line_and_leaves_no_cut_off_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(path: Path, *args: object) -> None:
        path.write_text('{"run": ')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(report, "write_json", full_disk)
    out = tmp_path / "run"
    with fake_gateway(answers_at_once) as (address, _, _):
        rc = bench(address, out, "--requests", "2")
    captured = capsys.readouterr()
    assert rc == 1
    assert captured.err.splitlines()[-1] == (
        f"appliance bench: --out {out}: writing bench.json failed: No space left on device; "
        "the tables are printed above"
    )
    assert "concurrency 1: 2 sent, 2 ok" in captured.out
    assert not (out / "bench.json").exists()


def test_ctrl_c_while_the_results_are_written_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def ctrl_c(path: Path, *args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "write_json", ctrl_c)
    out = tmp_path / "run"
    with fake_gateway(answers_at_once) as (address, _, _):
        rc = bench(address, out, "--requests", "2")
    assert rc == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"appliance bench: interrupted while writing the results; the files in {out} may be "
        "incomplete"
    )


def test_ctrl_c_in_the_middle_of_a_file_leaves_no_cut_off_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = 0
    record_dict = report.record_dict

    def ctrl_c_at_the_fourth_row(r: Any) -> dict[str, Any]:
        # bench.json takes the first two, requests.csv is cut after its first row.
        nonlocal rows
        rows += 1
        if rows == 4:
            raise KeyboardInterrupt
        return record_dict(r)

    monkeypatch.setattr(report, "record_dict", ctrl_c_at_the_fourth_row)
    out = tmp_path / "run"
    with fake_gateway(answers_at_once) as (address, _, _):
        rc = bench(address, out, "--requests", "2")
    assert rc == 130
    assert len(json.loads((out / "bench.json").read_text())["requests"]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["bench.json"]


def test_an_answer_the_server_cancelled_is_counted_as_its_own_outcome(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def cancelled(
        fake: FakeGateway, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        answer = final_answer()
        answer.final.finish_reason = pb.FINISH_REASON_CANCELLED
        answer.final.usage.completion_tokens = 1
        yield answer

    out = tmp_path / "run"
    with fake_gateway(cancelled) as (address, _, _):
        rc = bench(address, out, "--requests", "3")
    assert rc == 0
    printed = capsys.readouterr().out
    assert "concurrency 1: 3 sent, 0 ok, 3 errors" in printed
    assert "errors: CANCELLED_BY_SERVER 3" in printed
    (level,) = levels(out)
    assert (level["ok"], level["errors"]) == (0, {"CANCELLED_BY_SERVER": 3})
    rows = json.loads((out / "bench.json").read_text())["requests"]
    assert {(r["finish_reason"], r["output_tokens"]) for r in rows} == {("CANCELLED", 1)}
    assert all("FINISH_REASON_CANCELLED" in r["error"] for r in rows), rows


def unavailable_after(
    answers: int, then: float, why: str
) -> Callable[
    [FakeGateway, pb.GenerateRequest, grpc.ServicerContext], Iterator[pb.GenerateResponse]
]:
    """A fake gateway's answer: the first `answers` requests answered, the `then` after them
    refused UNAVAILABLE (`why` says what of model 'm'), the rest answered again."""
    answered = 0
    lock = threading.Lock()

    def answer(
        fake: FakeGateway, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        nonlocal answered
        with lock:
            answered += 1
            refused = answers < answered <= answers + then
        if refused:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"model 'm' is unavailable: {why}")
        yield final_answer()

    return answer


@pytest.mark.timeout(60)
def test_a_deployment_answering_only_unavailable_ends_the_run_with_what_was_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine_gone_after_three = unavailable_after(3, math.inf, "engine down")
    out = tmp_path / "run"
    with fake_gateway(engine_gone_after_three) as (address, _, _):
        rc = bench(address, out, "--concurrency", "2", "--duration", "120")
    err = capsys.readouterr().err.splitlines()
    assert rc == 1
    said = re.match(
        rf"appliance bench: {address}: the last (\d+) answers, over ([\d.]+) s, were UNAVAILABLE "
        r"\(model 'm' is unavailable: engine down\)",
        err[-1],
    )
    assert said, err[-1]
    assert int(said[1]) >= UNAVAILABLE_RUN and float(said[2]) >= UNAVAILABLE_FOR_S
    assert err[-1].endswith(f"what was measured before is printed above and written to {out}")
    (level,) = levels(out)
    assert level["ok"] == 3 and level["errors"]["UNAVAILABLE"] >= UNAVAILABLE_RUN
    run = json.loads((out / "bench.json").read_text())["run"]
    assert run["unreachable"].startswith(f"{address}: the last ")


@pytest.mark.timeout(60)
def test_a_short_run_of_unavailable_answers_does_not_end_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_blip = unavailable_after(3, 2 * UNAVAILABLE_RUN, "restarting")
    out = tmp_path / "run"
    with fake_gateway(a_blip) as (address, _, _):
        rc = bench(address, out, "--concurrency", "2", "--requests", str(3 * UNAVAILABLE_RUN))
    assert rc == 0, capsys.readouterr().err
    (level,) = levels(out)
    assert level["errors"]["UNAVAILABLE"] == 2 * UNAVAILABLE_RUN
    assert level["ok"] == 3 * UNAVAILABLE_RUN - 2 * UNAVAILABLE_RUN


@pytest.mark.timeout(120)
def test_the_answers_in_flight_when_the_gateway_goes_away_are_still_measured(
    tmp_path: Path,
) -> None:
    answered = 0
    lock = threading.Lock()

    def then_draining(
        fake: FakeGateway, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        nonlocal answered
        with lock:
            answered += 1
            drain = answered == 4
        if drain:
            # A gateway that drains: no new connection, the answers in flight still come.
            threading.Thread(target=server.stop, args=(60,)).start()
            fake.hold(context)
        yield final_answer("drained" if drain else "fake")

    out = tmp_path / "run"
    with fake_gateway(then_draining) as (address, fake, server):
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "appliance", "bench", "--address", address, "--model", "m"),
                *("--concurrency", "2", "--duration", "60", "--warmup", "0", "--out", str(out)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stderr is not None
        try:
            for line in proc.stderr:
                if line.startswith("stopped sending ("):
                    break
            fake.released.set()  # the held answer ends now, after the bench stopped sending
            _, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 1, stderr
    assert f"{address} became unreachable: " in stderr.splitlines()[-1]
    (level,) = levels(out)
    # A call that reaches the stopping server before its transport closes may be CANCELLED by it.
    assert level["interrupted"] == 0, level
    assert "UNAVAILABLE" in level["errors"] and set(level["errors"]) <= {"UNAVAILABLE", "CANCELLED"}
    rows = json.loads((out / "bench.json").read_text())["requests"]
    assert [r["status"] for r in rows if r["request_id"] == "drained"] == ["OK"]


def answering_then_held(
    answers: int, every: int = 0, first_message: bool = False
) -> Callable[
    [FakeGateway, pb.GenerateRequest, grpc.ServicerContext], Iterator[pb.GenerateResponse]
]:
    """A fake gateway's answer: the first `answers` requests answered, the rest held until the
    client's deadline (every `every`-th of them still answered, when set); `first_message`: a
    held request gets its first message before it is held (an answer slower than --timeout)."""
    count = 0
    lock = threading.Lock()

    def answer(
        fake: FakeGateway, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        nonlocal count
        with lock:
            count += 1
            answered = count <= answers or (every and count % every == 0)
        if not answered:
            if first_message:
                yield pb.GenerateResponse(request_id="slow", text="x", token_ids=[1])
            fake.hold(context)
            return
        yield final_answer()

    return answer


@pytest.mark.timeout(60)
def test_a_gateway_that_stops_answering_ends_the_run_after_a_few_timeouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    with fake_gateway(answering_then_held(2)) as (address, _, _):
        rc = bench(address, out, "--requests", "1000", "--timeout", "0.5")
    err = capsys.readouterr().err.splitlines()
    assert rc == 1
    assert err[-1] == (
        f"appliance bench: {address}: the last 3 requests got no answer within --timeout 0.5 s: "
        "the gateway stopped answering (see --stop-after-timeouts); what was measured before is "
        f"printed above and written to {out}"
    ), err[-1]
    (level,) = levels(out)
    assert (level["sent"], level["ok"], level["errors"]) == (5, 2, {"DEADLINE_EXCEEDED": 3})
    run = json.loads((out / "bench.json").read_text())["run"]
    assert run["unreachable"].startswith(f"{address}: the last 3 requests got no answer")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("answer", "option"),
    [
        (answering_then_held(0, every=2), ("--stop-after-timeouts", "2")),  # an answer between
        (answering_then_held(0, first_message=True), ()),  # answering, slower than --timeout
        (answering_then_held(0), ("--stop-after-timeouts", "0")),  # never stop
    ],
    ids=["answer-between", "slow-answers", "option-0"],
)
def test_timeouts_that_are_not_a_silent_gateway_do_not_end_the_run(
    tmp_path: Path, answer: Any, option: tuple[str, ...]
) -> None:
    out = tmp_path / "run"
    with fake_gateway(answer) as (address, _, _):
        rc = bench(address, out, "--requests", "4", "--timeout", "0.3", *option)
    assert rc == 0
    (level,) = levels(out)
    assert level["sent"] == 4 and level["errors"]["DEADLINE_EXCEEDED"] >= 2
