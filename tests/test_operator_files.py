"""Files an operator names (configurations, the keys file, certificates, a model repository's
config.pbtxt, secrets) are read only within a bound no real file approaches: a wrong path (a log, a
device that never ends) costs a bounded read and one line naming the file, never memory."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

from appliance import tomlcheck
from appliance.config import ConfigError, ModelConfig, load_config
from appliance.engine.repository import RepositoryError, read_repository
from appliance.gateway.models import StartupError, model_identity
from appliance.security.api_keys import KeysFileError, read_entries
from appliance.security.tls import TlsError, TlsSettings, _load
from appliance.text.tokenizer import ModelText
from appliance.textfile import TextFileError, read_bytes


def _over(path: Path, limit: int, line: bytes = b"#\n") -> Path:
    """`path` filled with `line` repeated past `limit` bytes: text each reader would take."""
    path.write_bytes(line * (limit // len(line) + 1))
    return path


def test_read_bytes_reads_up_to_its_bound_and_refuses_one_more(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\x00" * 6)
    assert read_bytes(path, 6) == b"\x00" * 6
    with pytest.raises(TextFileError, match=r"^more than 5 bytes$"):
        read_bytes(path, 5)


@pytest.mark.parametrize("what", ["configuration", "spec", "profile"])
def test_a_toml_file_past_its_bound_is_one_line_naming_it(tmp_path: Path, what: str) -> None:
    path = _over(tmp_path / "big.toml", tomlcheck.MAX_FILE_BYTES)
    message = f"^{path}: cannot read {what}: more than {tomlcheck.MAX_FILE_BYTES:,} bytes$"
    with pytest.raises(tomlcheck.TomlError, match=message):
        tomlcheck.read(path, what)


def test_serve_config_of_dev_zero_is_refused_after_a_bounded_read() -> None:
    with pytest.raises(ConfigError, match=r"^/dev/zero: cannot read configuration: more than"):
        load_config(Path("/dev/zero"))


def test_a_keys_file_past_its_bound_is_refused(tmp_path: Path) -> None:
    from appliance.security.api_keys import MAX_KEYS_FILE_BYTES

    path = _over(tmp_path / "keys.json", MAX_KEYS_FILE_BYTES, b" " * 4096)
    with pytest.raises(KeysFileError, match=rf"^cannot read keys file {path}: more than"):
        read_entries(path)


def test_a_redis_password_file_past_its_bound_is_refused(tmp_path: Path) -> None:
    password = _over(tmp_path / "password", 64 * 1024, b"x" * 1024)
    (tmp_path / "tok").mkdir()
    config = tmp_path / "g.toml"
    config.write_text(
        f'[cache]\nenabled = true\n[cache.redis]\npassword_file = "{password}"\n'
        f'[models.m]\nbackend = "127.0.0.1:1"\ntokenizer_dir = "tok"\n'
    )
    with pytest.raises(ConfigError, match=r"key 'cache.redis.password_file': .* more than"):
        load_config(config)


def test_a_certificate_file_past_its_bound_is_refused(tmp_path: Path) -> None:
    from appliance.security.tls import MAX_PEM_BYTES

    cert = _over(tmp_path / "c.pem", MAX_PEM_BYTES, b"-" * 4096)
    key = tmp_path / "k.pem"
    key.write_bytes(b"")
    with pytest.raises(TlsError, match=rf"^cannot read {cert}: more than"):
        _load(TlsSettings(cert, key))


def test_a_model_repository_config_past_its_bound_is_refused(tmp_path: Path) -> None:
    from appliance.engine.repository import MAX_CONFIG_BYTES

    model = tmp_path / "m"
    model.mkdir()
    config = _over(model / "config.pbtxt", MAX_CONFIG_BYTES)
    with pytest.raises(RepositoryError, match=rf"^{config}: cannot read: more than"):
        read_repository(tmp_path)


def test_an_engine_fingerprint_past_its_bound_is_refused(tmp_path: Path) -> None:
    fingerprint = _over(tmp_path / "engine_fingerprint", 64 * 1024, b"f" * 1024)
    cfg = ModelConfig("m", "127.0.0.1:1", tmp_path / "tok", fingerprint_file=fingerprint)
    with pytest.raises(StartupError, match=r"engine fingerprint .* unreadable \(more than"):
        model_identity(cfg, cast(ModelText, None), need_fingerprint=True)


def test_engine_build_verify_refuses_a_config_pbtxt_past_its_bound(tmp_path: Path) -> None:
    from engine_build import pbtxt
    from engine_build.verify import MAX_PBTXT_BYTES, verify_repository

    (tmp_path / pbtxt.MODEL_NAME).mkdir()
    config = _over(tmp_path / pbtxt.MODEL_NAME / "config.pbtxt", MAX_PBTXT_BYTES)
    assert verify_repository(tmp_path) == [f"cannot read {config}: more than 1,048,576 bytes"]
