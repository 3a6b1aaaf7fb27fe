"""The README's configuration sample is a file the gateway loads: an operator copies it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from appliance.config import load_config
from tests.security.certs import CA

README = Path(__file__).resolve().parents[2] / "README.md"


def _sample() -> str:
    section = README.read_text().split("## Configuration (`appliance serve --config FILE`, TOML)")[
        1
    ]
    return section.split("```toml\n", 1)[1].split("```", 1)[0]


def test_the_readme_configuration_sample_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sample's absolute paths are moved under tmp_path, where the files it names are made.
    etc, srv, credentials = tmp_path / "etc", tmp_path / "srv", tmp_path / "credentials"
    text = _sample().replace("/etc/appliance/", f"{etc}/").replace("/srv/", f"{srv}/")
    (etc / "tls").mkdir(parents=True)
    credentials.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    ca = CA(tmp_path, "ca")
    issued = ca.issue("server", "gateway")
    shutil.copy(issued.cert, etc / "tls" / "server.crt")
    shutil.copy(issued.key, etc / "tls" / "server.key")
    shutil.copy(ca.path, etc / "tls" / "client-ca.crt")
    for name in ("api-key-pepper", "cache-mac-key"):
        (credentials / name).write_bytes(b"k" * 32)
    path = tmp_path / "gateway.toml"
    path.write_text(text)

    config = load_config(path)

    assert list(config.models) == ["tiny-llama"]
