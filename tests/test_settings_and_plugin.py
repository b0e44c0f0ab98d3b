"""YAML model settings and the pluggy contract (project "omlx")."""

from __future__ import annotations

import json

import pytest

from omlx_mtp.tools.cli import main
from omlx_mtp.decode.requests import Request
from omlx_mtp.hosts.omlx.hookspecs import hookimpl, load_plugin_manager
from omlx_mtp.hosts.settings import PRESET_DIR, SettingsError, load_file, resolve, validate


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("OMLX_BASE_PATH", str(tmp_path / "omlx"))
    (tmp_path / "omlx" / "model_settings").mkdir(parents=True)
    return tmp_path / "omlx" / "model_settings"


PRESETS = {"gemma-4-31b-it", "gemma-4-26b-a4b-it", "gemma-4-e4b-it", "gemma-4-e2b-it", "Qwen3.5-27B", "Qwen3.5-35B-A3B",
           "Qwen3.5-122B-A10B", "Qwen3.5-397B-A17B", "Qwen3.6-27B", "Qwen3.6-35B-A3B", "Qwen3-Next-80B-A3B",
           "GLM-4.5-Air", "GLM-4.6", "GLM-4.7", "GLM-4.7-Flash", "DeepSeek-V3.1", "DeepSeek-V3.2"}


def test_presets_are_valid():
    presets = sorted(PRESET_DIR.glob("*.yaml"))
    assert {p.stem for p in presets} >= PRESETS
    for preset in presets:
        # MTP is turned on by the user's file, never by a preset; the first line names the release
        assert load_file(preset)["mtp_enabled"] is False
        assert preset.read_text().startswith("# omlx-mtp preset for "), preset.name


def test_user_file_overrides_preset(base):
    (base / "gemma-4-31b-it.yaml").write_text("mtp_enabled: true\nmtp_drafter: /models/assistant\n")
    settings, files = resolve("gemma-4-31b-it")
    assert settings.mtp_enabled and settings.mtp_drafter == "/models/assistant"
    assert settings.mtp_draft_tokens == "auto" and settings.mtp_min_acceptance == 0.3  # from the preset
    assert files[0].parent == PRESET_DIR and files[1].parent == base


@pytest.mark.parametrize("text, needle", [
    ("mtp_enabeld: true", "unknown key 'mtp_enabeld'"),
    ("mtp_enabled: yes please", "mtp_enabled: expected true or false"),
    ("mtp_draft_tokens: 0", "mtp_draft_tokens: expected an integer 1..16 or 'auto'"),
    ("mtp_draft_tokens: many", "mtp_draft_tokens: expected an integer 1..16 or 'auto'"),
    ("mtp_query_position: middle", "mtp_query_position: expected 'bonus' or 'last'"),
    ("mtp_min_acceptance: 1.5", "mtp_min_acceptance: expected a number between 0 and 1"),
    ("mtp_draft_tokens: 3\nmtp_max_draft_tokens: 6", "applies only with mtp_draft_tokens: auto"),
    ("- a\n- b", "expected a mapping"),
    ("mtp_enabled: [", "not valid YAML at line"),
])
def test_bad_yaml_names_file_key_and_expectation(tmp_path, capsys, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SettingsError) as error:
        load_file(path)
    assert str(path) in str(error.value) and needle in str(error.value)
    assert main(["settings", "validate", str(path)]) == 2
    assert needle in capsys.readouterr().err


def test_settings_cli(base, capsys):
    (base / "my-model.yaml").write_text("mtp_enabled: true\nmtp_draft_tokens: auto\nmtp_max_draft_tokens: 6\n")
    assert main(["settings", "validate", str(base / "my-model.yaml")]) == 0
    assert main(["settings", "show", "my-model"]) == 0
    out = capsys.readouterr().out
    assert "mtp_draft_tokens: auto" in out and "mtp_max_draft_tokens: 6" in out and str(base) in out


def test_entry_point_registers_our_plugin():
    manager = load_plugin_manager()
    assert "mtp" in dict(manager.list_name_plugin())
    hook = manager.hook
    assert hook.omlx_skip_tensor_in_quantization(name="language_model.mtp.pre_projection.weight", config={}) is False
    assert hook.omlx_skip_tensor_in_quantization(name="model.layers.0.mlp.up_proj.weight", config={}) is None
    assert hook.omlx_tensor_quantization(name="mtp.fc.weight", shape=(8, 8), config={}) is False
    kept = hook.omlx_tensors_to_preserve(weights={"mtp.fc.weight": 1, "model.norm.weight": 2}, config={})
    assert kept == [{"mtp.fc.weight": 1}]
    assert "mtp_enabled" in hook.omlx_model_settings_schema()[0]


def test_drafter_and_strategy_through_hooks(pair_31b, base):
    manager = load_plugin_manager()
    settings = {"mtp_enabled": True, "mtp_drafter": str(pair_31b.drafter_dir), "mtp_draft_tokens": 3}
    drafter = manager.hook.omlx_load_drafter(model_id="tiny", model_path=str(pair_31b.target_dir),
                                             model=pair_31b.model, settings=settings)
    assert drafter is not None
    strategy = manager.hook.omlx_decode_strategy(model_id="tiny", model=pair_31b.model, drafter=drafter,
                                                 settings=settings)
    rows = None
    for rows, _ in strategy.stream([Request([5, 6, 7], max_tokens=8)]):
        pass
    assert len(rows[0].generated) == 8 and rows[0].stats.drafted > 0


@pytest.mark.parametrize("settings", [
    {"mtp_enabled": True, "mtp_drafter": "/does/not/exist"},
    {"mtp_enabled": True},  # no merged assistant in this checkpoint
    {"mtp_enabled": True, "mtp_drafter": "x", "mtp_bogus": 1},
])
def test_bad_drafter_settings_fall_back_to_plain(pair_31b, settings, caplog):
    manager = load_plugin_manager()
    drafter = manager.hook.omlx_load_drafter(model_id="tiny", model_path=str(pair_31b.target_dir),
                                             model=pair_31b.model, settings=settings)
    assert drafter is None
    assert "MTP disabled for tiny" in caplog.text


def test_mismatched_drafter_is_logged_not_raised(pair_31b, tmp_path, caplog):
    from omlx_mtp.fixtures.tiny import TinySpec, write_assistant

    other = write_assistant(tmp_path / "other", TinySpec(hidden_size=96))
    manager = load_plugin_manager()
    drafter = manager.hook.omlx_load_drafter(model_id="tiny", model_path=str(pair_31b.target_dir), model=pair_31b.model,
                                             settings={"mtp_enabled": True, "mtp_drafter": str(other)})
    assert drafter is None and "backbone_hidden_size 96 != target hidden_size 64" in caplog.text


def test_third_party_strategy_takes_over():
    class GreedyEcho:
        name = "echo"

    class ThirdParty:
        @hookimpl
        def omlx_decode_strategy(self, model_id, model, drafter, settings):
            return GreedyEcho() if model_id.startswith("echo/") else None

    manager = load_plugin_manager()
    manager.register(ThirdParty(), name="third-party")
    picked = manager.hook.omlx_decode_strategy(model_id="echo/model", model=None, drafter=None, settings={})
    assert isinstance(picked, GreedyEcho)
    # other models still reach omlx-mtp's own implementation (no drafter -> plain decoding)
    assert manager.hook.omlx_decode_strategy(model_id="other", model=None, drafter=None, settings={}) is None


def test_validate_defaults():
    assert validate({}, "x").mtp_enabled is False
    assert validate(None, "x").mtp_draft_tokens == "auto"  # never slower than not drafting
    assert json.loads(json.dumps(validate({"mtp_draft_tokens": "auto"}, "x").as_dict()))["mtp_draft_tokens"] == "auto"
