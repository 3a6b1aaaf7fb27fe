"""NIC settings for real: a network namespace with a veth pair, changed through pyroute2.

Needs root and iproute2 (tests/prereqs.py stops the run naming what is missing); nothing outside the
test's own namespace is touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from host_tuning.cli import main
from host_tuning.facts.nic import netlink_links
from tests.host_tuning.hostbuilder import Machine


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def link(ns: str, name: str) -> dict[str, Any]:
    data: list[dict[str, Any]] = json.loads(ip("-n", ns, "-j", "link", "show", name).stdout)
    return data[0]


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"htune-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"cannot create a network namespace here: {exc.stderr.strip()}")
    try:
        try:
            ip("-n", name, "link", "add", "htv0", "type", "veth", "peer", "name", "htv1")
        except subprocess.CalledProcessError as exc:
            pytest.fail(f"cannot create a veth pair here: {exc.stderr.strip()}")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=20)


def test_mtu_and_link_apply_verify_revert(
    netns: str,
    box: Machine,
    write_profile: Callable[[str], Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    prof = write_profile(
        f'[serve]\nnics = ["htv0"]\nnetns = "{netns}"\n[nic]\nmtu = 9000\n'
        "[kernel]\nisolate = false\n"
    )
    base = ["--root", str(box.root), "--profile", str(prof), "--json"]
    assert link(netns, "htv0")["mtu"] == 1500
    assert "UP" not in link(netns, "htv0")["flags"]

    assert main(["apply", *base]) == 0
    res = {r["key"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert res["nic htv0 mtu"]["status"] == "changed"
    assert res["nic htv0 link"]["status"] == "changed"
    assert link(netns, "htv0")["mtu"] == 9000
    assert "UP" in link(netns, "htv0")["flags"]
    assert link(netns, "htv1")["mtu"] == 1500  # the peer is not named: untouched

    assert main(["verify", *base]) == 3  # only iommu=pt and the like wait for a reboot
    res = {r["key"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert res["nic htv0 mtu"]["status"] == "ok"

    ip("-n", netns, "link", "set", "htv0", "mtu", "4000")
    assert main(["verify", *base]) == 1
    res = {r["key"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert (res["nic htv0 mtu"]["status"], res["nic htv0 mtu"]["actual"]) == ("drift", "4000")

    assert main(["apply", *base]) == 0
    capsys.readouterr()
    assert link(netns, "htv0")["mtu"] == 9000
    assert main(["revert", "--root", str(box.root), "--json"]) == 0
    capsys.readouterr()
    assert link(netns, "htv0")["mtu"] == 1500
    assert "UP" not in link(netns, "htv0")["flags"]


def test_missing_namespace_is_unsupported_not_created(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"htune-absent-{uuid.uuid4().hex[:8]}"
    prof = write_profile(f'[serve]\nnics = ["htv0"]\nnetns = "{name}"\n[nic]\nmtu = 9000\n')
    assert main(["apply", "--dry-run", "--root", str(box.root), "--profile", str(prof)]) == 0
    assert "unsupported" in capsys.readouterr().out
    assert not os.path.exists(f"/run/netns/{name}")


def test_netlink_facts_read_the_namespace(netns: str) -> None:
    ip("-n", netns, "link", "set", "htv1", "mtu", "2000")
    links = netlink_links(netns)
    assert links["htv1"] == (2000, "down") and links["htv0"][0] == 1500
    assert "htv0" not in netlink_links()  # the host's namespace is separate


def test_mtu_the_kernel_refuses_is_one_failed_setting(
    netns: str,
    box: Machine,
    write_profile: Callable[[str], Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A VXLAN's MTU cannot exceed its lower device's (1500) less the VXLAN headers: EINVAL.
    vxlan = ["type", "vxlan", "id", "5", "dstport", "4789", "dev", "htv0"]
    ip("-n", netns, "link", "add", "htvx", *vxlan)
    prof = write_profile(
        f'[serve]\nnics = ["htvx"]\nnetns = "{netns}"\n[nic]\nmtu = 9000\n'
        "[kernel]\nisolate = false\n"
    )
    base = ["--root", str(box.root), "--profile", str(prof)]
    assert main(["apply", *base, "--json"]) == 1
    res = {r["key"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert res["nic htvx mtu"]["status"] == "failed"
    assert "Invalid argument" in res["nic htvx mtu"]["note"]
    assert res["nic htvx link"]["status"] == "changed"  # the settings after it still apply
    assert main(["revert", "--root", str(box.root)]) == 0
    capsys.readouterr()
    assert "UP" not in link(netns, "htvx")["flags"]
