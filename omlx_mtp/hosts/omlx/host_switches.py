"""oMLX's own MTP switches, read as this package's: from 0.3.9 on oMLX keeps ``mtp_enabled`` and
``mtp_num_draft_tokens`` in each model's settings (admin UI, ``model_settings.json``).

Where omlx-mtp serves the model's family, turning MTP on there makes omlx-mtp draft (its
``mtp_num_draft_tokens``, oMLX's largest depth, becomes ``auto``'s largest depth) and oMLX's own
MTP stands aside for that model; elsewhere oMLX's own MTP runs untouched.  ``mtp_engine: omlx``
in the model's YAML hands the model to oMLX's own MTP explicitly.  The YAML's keys win over
oMLX's where both are set."""

from __future__ import annotations

from ..settings import ENGINE_HOST, MAX_DRAFT_TOKENS

# The marker oMLX's MTP patches put on a model whose MTP decoding is on for this load (0.4.x-0.6.x);
# its batched step drafts only where the marker is true.
_HOST_MARKER = "_omlx_mtp_decode_enabled"


def merged(plugin_settings: dict | None, host_settings) -> tuple[dict | None, str]:
    """(the settings omlx-mtp decodes with, or None; who turned MTP on: "yaml", "omlx" or "").

    ``host_settings``: oMLX's ``ModelSettings`` for the model (None on oMLX 0.3.8, which has none)."""
    settings = dict(plugin_settings or {})
    if settings.get("mtp_engine") == ENGINE_HOST:
        return None, "yaml"
    if "mtp_enabled" in settings:
        return settings or None, "yaml" if settings["mtp_enabled"] else ""
    if not getattr(host_settings, "mtp_enabled", False):
        return settings or None, ""
    settings["mtp_enabled"] = True
    depth = getattr(host_settings, "mtp_num_draft_tokens", None)
    if (isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= MAX_DRAFT_TOKENS
            and settings.get("mtp_draft_tokens", "auto") == "auto" and "mtp_max_draft_tokens" not in settings):
        settings["mtp_max_draft_tokens"] = depth
    return settings, "omlx"


def host_drafts(model) -> bool:
    """Whether oMLX's own MTP is on for this loaded model (its per-load marker)."""
    return any(getattr(part, _HOST_MARKER, False) for part in _parts(model))


def stand_aside(model) -> bool:
    """Turn oMLX's own MTP off for this model (omlx-mtp drafts for it); True where it was on."""
    was_on = False
    for part in _parts(model):
        if getattr(part, _HOST_MARKER, False):
            setattr(part, _HOST_MARKER, False)
            was_on = True
    return was_on


def _parts(model) -> list:
    """The model and the wrapped models oMLX may have marked (an adapter's VLM, its language model)."""
    parts, seen = [], set()
    queue = [model]
    while queue:
        part = queue.pop()
        if part is None or id(part) in seen:
            continue
        seen.add(id(part))
        parts.append(part)
        queue.extend(getattr(part, name, None) for name in ("_vlm_model", "language_model", "model"))
    return parts
