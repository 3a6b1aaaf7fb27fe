"""Backends and cache tiers of one's own (`package.module:Class`): what a class must define is
checked when the configuration names it, in one line naming what is missing; a subclass of the base
defines the members the base has no default for and inherits the rest, and is served end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from appliance.backends.base import Backend, backend_kind
from appliance.cache.tiers import CacheTier, tier_class
from appliance.config import CacheConfig
from appliance.plugins import PluginError, members
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Tiny
from tests.gateway.plugin_classes import plugin_gateway
from tests.gateway.test_config import GOOD

PLUGINS = "tests.gateway.plugin_classes"
REQUIRED, DEFAULTED = members(Backend)


def _refusal(load: object, spec: str) -> str:
    assert callable(load)
    with pytest.raises(PluginError) as refused:
        load(spec)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_the_backend_members_without_a_default_are_the_ones_the_gateway_cannot_guess() -> None:
    assert REQUIRED == [
        "address",
        "cancel_all",
        "close",
        "max_batch_size",
        "readiness",
        "stream",
        "wait_ready",
    ]
    assert DEFAULTED == ["engine_limits", "guided", "max_top_logprobs", "speculation", "unserved"]


def test_a_backend_that_is_not_a_subclass_and_lacks_members_is_refused() -> None:
    message = _refusal(backend_kind, f"{PLUGINS}:EchoBackend")
    assert message.endswith(
        "EchoBackend lacks members: subclass appliance.backends.base.Backend to inherit its "
        f"defaults for {', '.join(DEFAULTED)}"
    )


def test_a_backend_subclass_missing_required_members_is_refused_naming_them() -> None:
    message = _refusal(backend_kind, f"{PLUGINS}:StreamOnly")
    missing = ", ".join(m for m in REQUIRED if m != "stream")
    assert f"StreamOnly does not define {missing} " in message


def test_a_cache_tier_must_subclass_cache_tier_and_define_lookup() -> None:
    message = _refusal(tier_class, f"{PLUGINS}:LookupOnly")
    assert "LookupOnly is not a subclass of appliance.cache.tiers.CacheTier: subclass it" in message
    assert message.endswith(f"define {', '.join(members(CacheTier)[0])}")
    assert "Unnamed does not define lookup" in _refusal(tier_class, f"{PLUGINS}:Unnamed")


def test_serve_refuses_the_class_in_one_line_and_exits_non_zero(tmp_path: Path) -> None:
    kind = f'backend_kind = "{PLUGINS}:EchoBackend"'
    config = tmp_path / "gateway.toml"
    config.write_text(GOOD.replace('tokenizer_dir = "tok"', f'tokenizer_dir = "tok"\n{kind}'))
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "key 'models.tiny.backend_kind'" in lines[0]
    assert "EchoBackend lacks members: subclass appliance.backends.base.Backend" in lines[0]


async def test_a_minimal_subclass_and_tier_are_served_end_to_end(tiny: Tiny) -> None:
    tiers = (f"{PLUGINS}:MemoTier",)
    cache = CacheConfig(tiers=tiers)
    async with (
        plugin_gateway(tiny.tokenizer_dir, "EchoSubclass", cache=cache) as gateway,
        grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel,
    ):
        stub = pb_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        first = await stub.Complete(request)
        assert first.final.finish_reason == pb.FINISH_REASON_LENGTH
        assert first.final.usage.completion_tokens == 4
        assert first.final.cache_tier == pb.CACHE_TIER_MISS
        # The defaults it inherits refuse what it does not serve, with the right status.
        for refused in (
            pb.GenerateRequest(model="tiny", prompt="hello", top_logprobs=2, logprobs=True),
            pb.GenerateRequest(model="tiny", prompt="hello", speculation=True),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Complete(refused)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        again = await stub.Complete(request)
        assert again.text == first.text
        assert again.final.cache_tier == pb.CACHE_TIER_OTHER
        assert again.final.cache_tier_name == "memo"
    backend = gateway.models["tiny"].backend
    assert backend.streams == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["InstanceAttributes", "DataclassBackend"])
async def test_a_backend_with_every_member_as_an_instance_attribute_is_served(
    tiny: Tiny, kind: str
) -> None:
    """A class that is not a subclass has every member when its instances do: set in __init__,
    or a dataclass's fields, as well as on the class."""
    backend_kind(f"{PLUGINS}:{kind}")  # accepted when the configuration is read
    async with (
        plugin_gateway(tiny.tokenizer_dir, kind) as gateway,
        grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel,
    ):
        stub = pb_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        answer = await stub.Complete(request)
        assert answer.final.usage.completion_tokens == 4


@pytest.mark.parametrize("kind", ["SetsGuided", "GuidedField"])
def test_a_backend_subclass_setting_a_read_only_member_on_instances_is_refused(
    kind: str,
) -> None:
    """Backend's `guided` is a read-only property: a subclass that sets it on its instances (in
    its __init__, or as a dataclass field without a default) would fail with an AttributeError
    when from_config makes it; it is refused when configured, in one line saying what to do."""
    message = _refusal(backend_kind, f"{PLUGINS}:{kind}")
    assert message.endswith(
        f"{kind} sets guided on its instances, a read-only property of "
        "appliance.backends.base.Backend: define it as a property or a class attribute (a "
        "dataclass field with a default)"
    )


async def test_a_backend_whose_from_config_fails_is_one_start_up_line(tiny: Tiny) -> None:
    """An exception a plugin's from_config raises is the gateway's StartupError (exit 2), one
    line naming the model, the class and the exception's first line; not a traceback."""
    from appliance.gateway.models import StartupError, load_models
    from tests.support import gateway_config

    spec = f"{PLUGINS}:FailsToStart"
    config = gateway_config(tiny.tokenizer_dir, "engine.invalid:1", backend_kind=spec)
    with pytest.raises(StartupError) as failed:
        await load_models(config)
    assert str(failed.value) == (
        f"model 'tiny': backend kind '{spec}': from_config failed: RuntimeError: "
        "no device /dev/accel0"
    )
    assert failed.value.exit_status == 2
