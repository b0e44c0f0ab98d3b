"""YAML model settings for MTP, beside oMLX's own JSON settings (which stay unchanged).

A file is a mapping of these keys (all optional, only ``mtp_enabled: true`` turns MTP on):

    mtp_enabled: true              # bool
    mtp_drafter: ../gemma-4-31b-it-assistant   # drafter directory; omit for a merged checkpoint
    mtp_draft_tokens: auto         # "auto" (the default: depth chosen per round from measured acceptance
                                   # and cost, plain decoding where drafting would lose), or a fixed 1..16
    mtp_max_draft_tokens: 8        # only with mtp_draft_tokens: auto
    mtp_query_position: bonus      # "bonus" (N) or "last" (N-1)
    mtp_min_acceptance: 0.3        # below this measured rate a request falls back to plain decoding
    mtp_engine: omlx-mtp           # where oMLX has MTP of its own (0.3.9 on): "omlx" hands the model to it

Where they are read from: the presets shipped in ``model_settings/<model-id>.yaml`` first, then the
user's ``<base>/model_settings/<model-id>.yaml`` on top, where ``<base>`` is ``$OMLX_BASE_PATH`` or
``~/.omlx`` (oMLX's base path).  Unknown keys, wrong types and impossible combinations are refused
with the file, the key and the expected value.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from ..errors import MTPError

def _preset_dir() -> Path:
    """``model_settings/`` of the source tree, installed as the ``omlx_mtp.model_settings`` package
    (editable installs map it back to the source tree)."""
    from importlib.resources import files

    try:
        return Path(str(files("omlx_mtp.model_settings")))
    except ModuleNotFoundError:  # running from a source tree that is not installed
        return Path(__file__).resolve().parent.parent / "model_settings"


PRESET_DIR = _preset_dir()
MAX_DRAFT_TOKENS = 16
QUERY_POSITIONS = ("bonus", "last")
ENGINE_PLUGIN, ENGINE_HOST = "omlx-mtp", "omlx"  # who drafts where the host has MTP of its own


class SettingsError(MTPError):
    pass


@dataclass
class MTPSettings:
    mtp_enabled: bool = False
    mtp_drafter: str | None = None
    mtp_draft_tokens: int | str = "auto"  # plain decoding where drafting would lose; a fixed depth drafts whatever it costs
    mtp_max_draft_tokens: int = 8
    mtp_query_position: str = "bonus"
    mtp_min_acceptance: float = 0.3
    mtp_engine: str = ENGINE_PLUGIN

    def as_dict(self) -> dict:
        return asdict(self)


DESCRIPTIONS = {
    "mtp_enabled": "turn MTP speculative decoding on for this model (bool)",
    "mtp_drafter": "drafter checkpoint directory, absolute or relative to the model (omit for a merged checkpoint)",
    "mtp_draft_tokens": f"drafts per round, 1..{MAX_DRAFT_TOKENS} or 'auto'",
    "mtp_max_draft_tokens": f"largest depth 'auto' may choose, 1..{MAX_DRAFT_TOKENS}",
    "mtp_query_position": "drafter query position: 'bonus' (N) or 'last' (N-1)",
    "mtp_min_acceptance": "acceptance rate below which a request falls back to plain decoding, 0..1",
    "mtp_engine": f"who drafts where oMLX has MTP of its own: {ENGINE_PLUGIN!r} (this package, where it serves "
                  f"the family) or {ENGINE_HOST!r} (oMLX's own MTP)",
}


def _int_in_range(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def validate(data, where: str) -> MTPSettings:
    """A mapping read from YAML -> MTPSettings, or SettingsError naming file, key and expectation."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SettingsError(f"{where}: expected a mapping of settings, got {type(data).__name__}")
    unknown = sorted(set(data) - set(DESCRIPTIONS))
    if unknown:
        raise SettingsError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(DESCRIPTIONS)})")

    def bad(key, expected):
        return SettingsError(f"{where}: {key}: expected {expected}, got {data[key]!r}")

    if "mtp_enabled" in data and not isinstance(data["mtp_enabled"], bool):
        raise bad("mtp_enabled", "true or false")
    if "mtp_drafter" in data and data["mtp_drafter"] is not None and not isinstance(data["mtp_drafter"], str):
        raise bad("mtp_drafter", "a directory path")
    if "mtp_draft_tokens" in data:
        value = data["mtp_draft_tokens"]
        if value != "auto" and not _int_in_range(value, 1, MAX_DRAFT_TOKENS):
            raise bad("mtp_draft_tokens", f"an integer 1..{MAX_DRAFT_TOKENS} or 'auto'")
    if "mtp_max_draft_tokens" in data:
        if not _int_in_range(data["mtp_max_draft_tokens"], 1, MAX_DRAFT_TOKENS):
            raise bad("mtp_max_draft_tokens", f"an integer 1..{MAX_DRAFT_TOKENS}")
        if data.get("mtp_draft_tokens", MTPSettings.mtp_draft_tokens) != "auto":
            raise SettingsError(f"{where}: mtp_max_draft_tokens: applies only with mtp_draft_tokens: auto")
    if "mtp_query_position" in data and data["mtp_query_position"] not in QUERY_POSITIONS:
        raise bad("mtp_query_position", " or ".join(repr(p) for p in QUERY_POSITIONS))
    if "mtp_min_acceptance" in data:
        value = data["mtp_min_acceptance"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise bad("mtp_min_acceptance", "a number between 0 and 1")
    if "mtp_engine" in data and data["mtp_engine"] not in (ENGINE_PLUGIN, ENGINE_HOST):
        raise bad("mtp_engine", f"{ENGINE_PLUGIN!r} or {ENGINE_HOST!r}")
    return MTPSettings(**data)


def load_file(path: str | Path) -> dict:
    """Read and validate one YAML file; returns the keys it sets."""
    path = Path(path)
    try:
        # UTF-8 whatever the locale: YAML files are UTF-8, and the same file must read the same everywhere
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingsError(f"{path}: cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                            "save it as UTF-8") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SettingsError(f"{path}: not valid YAML{where} ({getattr(exc, 'problem', exc)})") from None
    validate(data, str(path))
    return data or {}


def base_path() -> Path:
    return Path(os.environ.get("OMLX_BASE_PATH") or Path.home() / ".omlx")


def _file_name(model_id: str) -> str:
    return model_id.replace("/", "--") + ".yaml"


def settings_files(model_id: str, base: str | Path | None = None) -> list[Path]:
    """The files that apply to a model, lowest precedence first; ``base`` overrides the base path
    (a host passes its own, e.g. oMLX's --base-path)."""
    base = Path(base) if base is not None else base_path()
    candidates = [PRESET_DIR / _file_name(model_id), base / "model_settings" / _file_name(model_id)]
    return [p for p in candidates if p.is_file()]


def file_values(model_id: str, base: str | Path | None = None) -> tuple[dict, list[Path]]:
    """The keys the model's files set (later files win), each file validated, and the files."""
    merged: dict = {}
    files = settings_files(model_id, base)
    for path in files:
        merged.update(load_file(path))
    return merged, files


def resolve(model_id: str, base: str | Path | None = None) -> tuple[MTPSettings, list[Path]]:
    merged, files = file_values(model_id, base)
    return validate(merged, " + ".join(str(p) for p in files) or model_id), files
