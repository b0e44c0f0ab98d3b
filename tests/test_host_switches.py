"""oMLX's own MTP switches read as omlx-mtp's (``hosts.omlx.host_switches``), and oMLX's own MTP
standing aside for a model omlx-mtp drafts for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omlx_mtp.hosts.omlx.host_switches import host_drafts, merged, stand_aside
from omlx_mtp.hosts.settings import SettingsError, validate


def host(**kwargs):
    """oMLX's ModelSettings, as far as the switches go."""
    return SimpleNamespace(**{"mtp_enabled": False, "mtp_num_draft_tokens": None, **kwargs})


@pytest.mark.parametrize("plugin, host_settings, expected", [
    (None, None, (None, "")),  # oMLX 0.3.8: no settings of its own
    (None, host(), (None, "")),
    ({"mtp_draft_tokens": 2}, host(), ({"mtp_draft_tokens": 2}, "")),
    (None, host(mtp_enabled=True), ({"mtp_enabled": True}, "omlx")),
    # oMLX's depth is its controller's largest: auto's largest here
    (None, host(mtp_enabled=True, mtp_num_draft_tokens=2), ({"mtp_enabled": True, "mtp_max_draft_tokens": 2}, "omlx")),
    ({"mtp_draft_tokens": 3}, host(mtp_enabled=True, mtp_num_draft_tokens=5), ({"mtp_enabled": True, "mtp_draft_tokens": 3}, "omlx")),
    ({"mtp_max_draft_tokens": 4}, host(mtp_enabled=True, mtp_num_draft_tokens=2), ({"mtp_enabled": True, "mtp_max_draft_tokens": 4}, "omlx")),
    (None, host(mtp_enabled=True, mtp_num_draft_tokens=99), ({"mtp_enabled": True}, "omlx")),  # out of our range
    # the YAML's own switch wins, either way
    ({"mtp_enabled": False}, host(mtp_enabled=True), ({"mtp_enabled": False}, "")),
    ({"mtp_enabled": True}, host(), ({"mtp_enabled": True}, "yaml")),
    # handed to oMLX's own MTP explicitly
    ({"mtp_engine": "omlx"}, host(mtp_enabled=True), (None, "yaml")),
    ({"mtp_engine": "omlx-mtp"}, host(mtp_enabled=True), ({"mtp_engine": "omlx-mtp", "mtp_enabled": True}, "omlx")),
])
def test_merged(plugin, host_settings, expected):
    settings, source = merged(plugin, host_settings)
    assert (settings, source) == expected
    if settings:
        validate(settings, "merged")  # what comes out is always valid settings


def test_mtp_engine_is_checked():
    with pytest.raises(SettingsError, match="mtp_engine: expected 'omlx-mtp' or 'omlx', got 'vllm'"):
        validate({"mtp_engine": "vllm"}, "x.yaml")


def test_stand_aside_turns_off_every_marked_part():
    language = SimpleNamespace(_omlx_mtp_decode_enabled=True)
    adapter = SimpleNamespace(_vlm_model=SimpleNamespace(language_model=language))
    assert host_drafts(adapter)
    assert stand_aside(adapter) is True
    assert language._omlx_mtp_decode_enabled is False and not host_drafts(adapter)
    assert stand_aside(adapter) is False  # nothing left on
    assert not host_drafts(SimpleNamespace()) and stand_aside(SimpleNamespace()) is False
