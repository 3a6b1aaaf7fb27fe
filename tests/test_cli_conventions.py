"""The three CLIs' shared convention: a refused input is one line on stderr naming what to fix, exit 2;
TOML errors read FILE:LINE: key 'TABLE.KEY': ... in all three."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance import cli as appliance_cli
from engine_build import cli as engine_build_cli
from host_tuning import cli as host_tune_cli


def _one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.rstrip("\n")


def test_unknown_key_is_refused_alike_by_all_three(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gateway = tmp_path / "gateway.toml"
    gateway.write_text("[server]\nlisten = '127.0.0.1:1'\nlisten_port = 1\n")
    spec = tmp_path / "spec.toml"
    spec.write_text("[model]\nhf_model_dir = 'm'\nwork_dir = 'w'\nhf_dir = 'x'\n")
    profile = tmp_path / "profile.toml"
    profile.write_text("[cpu]\ngovernor = 'performance'\ngovernour = 'x'\n")
    runs = [
        (
            appliance_cli.main,
            ["serve", "--config", str(gateway)],
            f"{gateway}:3: key 'server.listen_port'",
        ),
        (engine_build_cli.main, ["plan", "--spec", str(spec)], f"{spec}:4: key 'model.hf_dir'"),
        (
            host_tune_cli.main,
            ["plan", "--profile", str(profile)],
            f"{profile}:3: key 'cpu.governour'",
        ),
    ]
    for main, argv, where in runs:
        assert main(argv) == 2
        line = _one_line(capsys.readouterr().err)
        assert f"{where}: unknown key; known keys are " in line, line


# On a machine with CUDA, "cuda" runs; an index past the last device is refused there instead.
NO_CUDA = "CUDA is not available on this machine; use --device cpu"
DEVICES = [
    ("gpu0", "not a device; expected cpu, cuda or cuda:N"),
    ("mps", "not a device; expected cpu, cuda or cuda:N"),
    ("cuda:64", NO_CUDA if not torch.cuda.is_available() else "this machine has "),
]
if not torch.cuda.is_available():
    DEVICES.append(("cuda", NO_CUDA))


@pytest.mark.parametrize(("device", "message"), DEVICES)
def test_engine_refuses_a_device_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], device: str, message: str
) -> None:
    rc = appliance_cli.main(["engine", "--repository", str(tmp_path), "--device", device])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2
    assert line.startswith(f"appliance engine: --device {device}: {message}"), line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["engine", "--repository", "r", "--threads", "0"],
            "argument --threads: must be an integer",
        ),
        (["engine", "--repository", "r", "--listen", "127.0.0.1:99999"], "port of 0 to 65535"),
        (["health", "--wait", "nan"], "argument --wait: must be a number of 0 or more, got nan"),
        (["health", "--wait", "-5"], "argument --wait: must be a number of 0 or more, got -5"),
        (["health", "--gateway", "127.0.0.1:99999"], "argument --gateway: expected HOST:PORT"),
        (["cache", "--timeout", "nan", "stats"], "argument --timeout: must be a number greater"),
        (["demo", "--requests", "0"], "argument --requests: must be an integer greater than 0"),
        (["awq-quantize", "--model", "m", "--text", "t", "--out", "o", "--threads", "0"], "0"),
        (["engine", "--repository", "r", "--listen", "127.0.0.1"], "expected HOST:PORT"),
        (["engine", "--repository", "r", "--threads", "1" + "0" * 20], "at most 1024"),
        (["semantic-eval", "--pairs", "p", "--threads", "1" + "0" * 20], "at most 1024"),
        (["engine", "--repository", "r", "--metrics", "garbage"], "argument --metrics: expected"),
        (["engine", "--repository", "r", "--metrics", "127.0.0.1:99999"], "port of 0 to 65535"),
        (
            ["cache", "warm", "--prompts", "p", "--model", "m", "--max-tokens", "1" + "0" * 20],
            "argument --max-tokens: must be an integer greater than 0 and at most",
        ),
        (
            ["cache", "warm", "--prompts", "p", "--model", "m", "--max-tokens", "0"],
            "argument --max-tokens: must be an integer greater than 0",
        ),
        (
            ["cache", "warm", "--prompts", "p", "--model", "m", "--ttft-budget-ms", "1" + "0" * 20],
            "argument --ttft-budget-ms: must be an integer greater than 0 and at most",
        ),
        (["health", "--service", "\udcff"], "argument --service: not UTF-8 text"),
        (["cache", "invalidate", "--namespace", "\udcff"], "argument --namespace: not UTF-8"),
        (["cache", "invalidate", "--model", "\udcff"], "argument --model: not UTF-8"),
        (["cache", "warm", "--prompts", "p", "--model", "\udcff"], "argument --model: not UTF-8"),
        (["keys", "add", "--namespace", "n" * 65], "argument --namespace: is longer than 64"),
        (["keys", "add", "--namespace", "a\nb"], "argument --namespace: holds a control"),
        (
            ["keys", "add", "--namespace", "a", "--identity", "c\x1b[2K"],
            "argument --identity: holds a control",
        ),
        (["keys", "add", "--namespace", "\udcff"], "argument --namespace: not UTF-8"),
    ],
)
def test_an_option_out_of_its_range_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as stopped:
        appliance_cli.main(argv)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.rstrip("\n").splitlines()[-1]
    # The prog named is that of the (sub)command whose option was wrong.
    assert error.startswith(f"appliance {argv[0]}") and ": error: " in error, error
    assert says in error, error


def test_files_the_cache_command_cannot_use_are_one_line_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(128, 256)))
    for option, says in (
        ("--api-key-file", f"--api-key-file {garbage}: not an API key"),
        ("--ca-file", f"--ca-file {garbage}: holds no PEM certificate"),
    ):
        rc = appliance_cli.main(
            ["cache", "--gateway", "127.0.0.1:1", option, str(garbage), "stats"]
        )
        assert (rc, _one_line(capsys.readouterr().err)) == (2, f"appliance cache: {says}")


def test_make_tiny_model_onto_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("")
    rc = appliance_cli.main(["make-tiny-model", "--dest", str(taken)])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and line.startswith(f"appliance make-tiny-model: --dest {taken}: "), line


@pytest.mark.parametrize(
    ("main", "argv", "says"),
    [
        (appliance_cli.main, ["engine"], "appliance engine: error: the following arguments are"),
        (appliance_cli.main, ["engine", "--repository"], "appliance engine: error: argument"),
        (appliance_cli.main, ["bench", "--adress", "x"], "appliance bench: error: unrecognized"),
        (
            appliance_cli.main,
            ["engine", "--repository", "r", "--nope"],
            "appliance engine: error: unrecognized",
        ),
        (appliance_cli.main, ["cache", "stats", "--nope"], "appliance cache stats: error: unr"),
        (appliance_cli.main, ["servee"], "appliance: error: argument command: invalid choice"),
        (engine_build_cli.main, ["plan"], "engine-build plan: error: the following arguments"),
        (
            engine_build_cli.main,
            ["plan", "--spec", "s", "--nope"],
            "engine-build plan: error: unrecognized",
        ),
        (host_tune_cli.main, ["plan", "--profile", "p", "-x"], "host-tune plan: error: unrecog"),
        (
            host_tune_cli.main,
            ["apply", "--profile", "p", "--nope"],
            "host-tune apply: error: unrecognized",
        ),
    ],
)
def test_a_usage_error_is_one_line_naming_the_help(
    capsys: pytest.CaptureFixture[str], main: Any, argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    line = _one_line(capsys.readouterr().err)
    # The help named is that of the command whose option was wrong.
    prog = says.split(": error: ")[0]
    assert line.startswith(says) and line.endswith(f" (see {prog} --help)"), line


def test_ctrl_c_while_a_command_waits_is_one_line_and_130() -> None:
    # A listener that accepts and never answers: health is inside its wait once it connects.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        health = ["health", "--gateway", f"127.0.0.1:{port}", "--wait", "600"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "appliance", *health],
            stderr=subprocess.PIPE,
            text=True,
            # A shell's background job starts with SIGINT ignored; a terminal's Ctrl-C does not.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            silent.settimeout(60)
            connection, _ = silent.accept()
            with connection:
                proc.send_signal(signal.SIGINT)
                _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert (proc.returncode, err) == (130, "appliance health: interrupted\n")


@pytest.mark.parametrize("argv", [["make-model", "--dest"], ["demo", "--workdir"]])
def test_an_output_folder_the_system_refuses_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("")
    for where, why in ((taken, "File exists"), (taken / "sub", "Not a directory")):
        rc = appliance_cli.main([*argv, str(where)])
        line = _one_line(capsys.readouterr().err)
        assert (rc, line) == (1, f"appliance {argv[0]}: {where}: {why}"), line


@pytest.mark.parametrize("package", ["appliance", "engine_build", "host_tuning"])
def test_each_command_runs_as_python_dash_m(package: str) -> None:
    """Where a console script is not on PATH, `python -m PACKAGE` is the same command."""
    done = subprocess.run(
        [sys.executable, "-m", package, "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ")


# A path or value holding a line break (or another control character) is shown escaped, as
# Python writes it in a string: the error stays one line, and what was given can be read back.
NL = "bad\nname"


@pytest.mark.parametrize(
    ("main", "argv", "prog"),
    [
        (appliance_cli.main, ["serve", "--config", "{dir}/" + NL], "appliance serve"),
        (appliance_cli.main, ["engine", "--repository", "{dir}/" + NL], "appliance engine"),
        (
            appliance_cli.main,
            ["bench", "--address", "127.0.0.1:1", "--model", "m", "--prompts", "{dir}/" + NL],
            "appliance bench",
        ),
        (
            appliance_cli.main,
            ["cache", "warm", "--prompts", "{dir}/" + NL, "--model", "m"],
            "appliance cache warm",
        ),
        (appliance_cli.main, ["cache", "--ca-file", "{dir}/" + NL, "stats"], "appliance cache"),
        (appliance_cli.main, ["keys", "--keys-file", "{dir}/" + NL, "list"], "appliance keys"),
        (appliance_cli.main, ["keys", "secret", "{dir}/" + NL + "/s"], "appliance keys"),
        (appliance_cli.main, ["make-tiny-model", "--dest", "{dir}/taken/" + NL], "appliance"),
        (engine_build_cli.main, ["plan", "--spec", "{dir}/" + NL], "engine-build"),
        (host_tune_cli.main, ["plan", "--profile", "{dir}/" + NL], "host-tune"),
        (appliance_cli.main, ["health", "--gateway", NL], "appliance health"),
        (
            appliance_cli.main,
            ["keys", "add", "--namespace", "n", "--burst", "a\x1b[2Jb"],
            "appliance keys add",
        ),
    ],
)
def test_a_value_with_a_line_break_stays_on_the_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], main: Any, argv: list[str], prog: str
) -> None:
    (tmp_path / "taken").write_text("")
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as stopped:
        rc = stopped.code
    assert rc not in (0, None)
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"{prog}"), line
    assert "bad\\nname" in line or "a\\x1b[2Jb" in line, line
