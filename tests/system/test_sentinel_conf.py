"""The redis role's edit of Debian's sentinel.conf leaves a file a Sentinel starts with."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from appliance.tools.processes import free_port

TASKS = Path(__file__).resolve().parents[2] / "ansible/roles/redis/tasks/sentinel.yml"

# The example monitor's lines in Debian's sentinel.conf as the package ships it (bookworm,
# redis 7.0): a Sentinel that never ran has not yet rewritten them in lower case.
SHIPPED = """\
sentinel monitor mymaster 127.0.0.1 6379 2
sentinel down-after-milliseconds mymaster 30000
sentinel parallel-syncs mymaster 1
sentinel failover-timeout mymaster 180000
SENTINEL master-reboot-down-after-period mymaster 0
# sentinel auth-pass mymaster MySUPER--secret-0123passw0rd
"""


def _example_monitor_regexp() -> re.Pattern[str]:
    text = TASKS.read_text()
    task = re.search(
        r"- name: Drop the package's example monitor\n(?:.*\n)*?\s+regexp: \"(.+)\"", text
    )
    assert task is not None
    return re.compile(task.group(1).replace("\\\\", "\\"))


def test_every_line_of_the_example_monitor_is_dropped(tmp_path: Path) -> None:
    """lineinfile drops each line the regexp finds (Python's re.search); what is left starts."""
    regexp = _example_monitor_regexp()
    kept = [line for line in SHIPPED.splitlines() if not regexp.search(line)]
    assert kept == ["# sentinel auth-pass mymaster MySUPER--secret-0123passw0rd"]
    conf = tmp_path / "sentinel.conf"
    conf.write_text("\n".join([f"port {free_port()}", *kept]) + "\n")
    sentinel = subprocess.Popen(
        ["redis-server", str(conf), "--sentinel"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert sentinel.stdout is not None
        said = []
        for line in sentinel.stdout:  # ends when it exits (a config error) or says it runs
            said.append(line)
            if "Sentinel ID is" in line:
                break
        assert "Sentinel ID is" in said[-1], "".join(said)
    finally:
        sentinel.kill()
        sentinel.wait(timeout=10)
