"""The gateway process stays light: nothing it loads imports torch (only the engine server does)."""

from __future__ import annotations

import subprocess
import sys

GATEWAY_MODULES = [
    "appliance.cli",
    "appliance.gateway.server",
    "appliance.gateway.pipeline",
    "appliance.gateway.http_api",
    "appliance.gateway.openai_wire",
    "appliance.client",
    "appliance.tools.processes",
    "appliance.loadgen.command",
    "appliance.loadgen.plots",
]


def test_the_gateway_never_imports_torch() -> None:
    imports = "; ".join(f"import {m}" for m in GATEWAY_MODULES)
    check = (
        f"{imports}; import sys; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')); "
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == ""


def test_the_engine_server_does_import_torch() -> None:
    """The check above can fail: the same probe sees torch where it is imported."""
    check = "import appliance.engine.server, sys; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "True"
