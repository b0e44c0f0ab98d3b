"""oMLX's own MTP switches read as omlx-mtp's (``hosts.omlx.host_switches``), and oMLX's own MTP
standing aside for a model omlx-mtp drafts for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omlx_mtp.hosts.omlx.host_switches import drafter_path, host_drafts, merged, stand_aside
from omlx_mtp.hosts.settings import SettingsError, validate


def host(**kwargs):
    """oMLX's ModelSettings, as far as the switches go."""
    return SimpleNamespace(**{"mtp_enabled": False, "mtp_num_draft_tokens": None, "vlm_mtp_enabled": False,
                              "vlm_mtp_draft_model": None, **kwargs})


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


def test_vlm_switch_names_the_assistant(tmp_path):
    """``vlm_mtp_enabled`` + ``vlm_mtp_draft_model``: omlx-mtp drafts with that assistant; a model id
    is the directory oMLX found beside the model (or under the same folder, ``org/name``)."""
    models = tmp_path / "models"
    (models / "gemma-assistant").mkdir(parents=True)
    (models / "org" / "helper").mkdir(parents=True)
    target = models / "gemma"
    on = host(vlm_mtp_enabled=True, vlm_mtp_draft_model="gemma-assistant")
    assert merged(None, on, target) == ({"mtp_enabled": True, "mtp_drafter": str(models / "gemma-assistant")}, "omlx")
    assert drafter_path("org/helper", models / "org" / "gemma") == str(models / "org" / "helper")
    assert drafter_path("org/helper", target) == str(models / "org" / "helper")
    assert drafter_path(str(tmp_path / "elsewhere"), target) == str(tmp_path / "elsewhere")
    assert drafter_path("missing", target) == str(models / "missing")  # its loader names it
    # the YAML's own choices win; a switch without an assistant is off (oMLX refuses it too)
    assert merged({"mtp_drafter": "/a"}, on, target) == ({"mtp_drafter": "/a", "mtp_enabled": True}, "omlx")
    assert merged({"mtp_enabled": False}, on, target) == ({"mtp_enabled": False}, "")
    assert merged(None, host(vlm_mtp_enabled=True), target) == (None, "")
    settings, _ = merged(None, on, target)
    validate(settings, "merged")


def test_a_scheduler_omlx_mtp_drafts_for_declines_omlx_vlm_assistant():
    taken = []

    class Scheduler:  # oMLX 0.6.2's, as far as its VLM MTP goes
        _vlm_mtp_drafter = None

        def set_vlm_mtp_drafter(self, drafter, draft_block_size=None):
            taken.append(drafter)
            self._vlm_mtp_drafter = drafter

    scheduler, model = Scheduler(), SimpleNamespace()
    on = host(vlm_mtp_enabled=True, vlm_mtp_draft_model="a")
    assert host_drafts(model, scheduler, on) and not host_drafts(model, scheduler, host())
    assert not host_drafts(model, SimpleNamespace(), on)  # an engine without VLM MTP (oMLX's LLM engine)
    assert stand_aside(model, scheduler) is False  # nothing was drafting yet
    scheduler.set_vlm_mtp_drafter("assistant", draft_block_size=4)  # what oMLX's pool does after start
    assert scheduler._vlm_mtp_drafter is None and taken == []
    scheduler.set_vlm_mtp_drafter(None)  # clearing still reaches oMLX
    assert taken == [None]
    stand_aside(model, scheduler)  # once is enough: not wrapped twice
    scheduler.set_vlm_mtp_drafter("assistant")
    assert taken == [None]

    already = Scheduler()
    already.set_vlm_mtp_drafter("assistant")  # a drafter set before omlx-mtp attached
    assert stand_aside(model, already) is True and already._vlm_mtp_drafter is None
