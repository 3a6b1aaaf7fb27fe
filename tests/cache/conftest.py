"""The semantic tier's embedder, exported once per session (as `appliance semantic-setup` does)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from appliance.cache.embedder_export import export_embedder

    return export_embedder(tmp_path_factory.mktemp("embedder"))
