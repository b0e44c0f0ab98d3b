"""oMLX's own MTP switches, read as this package's: from 0.3.9 on oMLX keeps ``mtp_enabled`` and
``mtp_num_draft_tokens`` in each model's settings (admin UI, ``model_settings.json``), and from
0.5.x ``vlm_mtp_enabled`` + ``vlm_mtp_draft_model`` (a separate Gemma 4 assistant).

Where omlx-mtp serves the model's family, turning MTP on there makes omlx-mtp draft (its
``mtp_num_draft_tokens``, oMLX's largest depth, becomes ``auto``'s largest depth; its
``vlm_mtp_draft_model`` becomes ``mtp_drafter``) and oMLX's own MTP stands aside for that model;
elsewhere oMLX's own MTP runs untouched.  ``mtp_engine: omlx`` in the model's YAML hands the model
to oMLX's own MTP explicitly.  The YAML's keys win over oMLX's where both are set."""

from __future__ import annotations

import logging
from pathlib import Path

from ..settings import ENGINE_HOST, MAX_DRAFT_TOKENS

log = logging.getLogger("omlx_mtp")

# The marker oMLX's MTP patches put on a model whose MTP decoding is on for this load (0.4.x-0.6.x);
# its batched step drafts only where the marker is true.
_HOST_MARKER = "_omlx_mtp_decode_enabled"


def merged(plugin_settings: dict | None, host_settings, model_path=None) -> tuple[dict | None, str]:
    """(the settings omlx-mtp decodes with, or None; who turned MTP on: "yaml", "omlx" or "").

    ``host_settings``: oMLX's ``ModelSettings`` for the model (None on oMLX 0.3.8, which has none);
    ``model_path``: where a ``vlm_mtp_draft_model`` given as a model id is looked for beside it."""
    settings = dict(plugin_settings or {})
    if settings.get("mtp_engine") == ENGINE_HOST:
        return None, "yaml"
    if "mtp_enabled" in settings:
        return settings or None, "yaml" if settings["mtp_enabled"] else ""
    if vlm_switch(host_settings) and not getattr(host_settings, "mtp_enabled", False):
        settings["mtp_enabled"] = True
        settings.setdefault("mtp_drafter", drafter_path(host_settings.vlm_mtp_draft_model, model_path))
        return settings, "omlx"
    if not getattr(host_settings, "mtp_enabled", False):
        return settings or None, ""
    settings["mtp_enabled"] = True
    depth = getattr(host_settings, "mtp_num_draft_tokens", None)
    if (isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= MAX_DRAFT_TOKENS
            and settings.get("mtp_draft_tokens", "auto") == "auto" and "mtp_max_draft_tokens" not in settings):
        settings["mtp_max_draft_tokens"] = depth
    return settings, "omlx"


def vlm_switch(host_settings) -> bool:
    """Whether oMLX's VLM MTP switch is on, with the assistant it names."""
    draft_model = getattr(host_settings, "vlm_mtp_draft_model", None)
    return bool(getattr(host_settings, "vlm_mtp_enabled", False)) and isinstance(draft_model, str) and bool(draft_model)


def drafter_path(draft_model: str, model_path) -> str:
    """``vlm_mtp_draft_model`` as a directory: a path as given, or a model id oMLX discovered beside
    the model (its directory's sibling, or under the same models folder for ``org/name`` ids)."""
    path = Path(draft_model).expanduser()
    if path.is_absolute() or model_path is None:
        return str(path)
    model_dir = Path(str(model_path))
    for folder in (model_dir.parent, model_dir.parent.parent):
        if (folder / path).is_dir():
            return str(folder / path)
    return str(model_dir.parent / path)  # not found: the drafter's loader says so, naming it


def host_drafts(model, scheduler=None, host_settings=None) -> bool:
    """Whether oMLX's own MTP is on for this loaded model: its per-load marker (text MTP), or its
    VLM MTP switch on an engine whose scheduler takes the assistant."""
    if any(getattr(part, _HOST_MARKER, False) for part in _parts(model)):
        return True
    return vlm_switch(host_settings) and callable(getattr(scheduler, "set_vlm_mtp_drafter", None))


def stand_aside(model, scheduler=None) -> bool:
    """Turn oMLX's own MTP off for this model (omlx-mtp drafts for it); True where it was on.

    Its text MTP: the per-load marker is cleared.  Its VLM MTP: oMLX loads the assistant after the
    engine starts and hands it to the scheduler, which from now on declines it."""
    was_on = False
    for part in _parts(model):
        if getattr(part, _HOST_MARKER, False):
            setattr(part, _HOST_MARKER, False)
            was_on = True
    take = getattr(scheduler, "set_vlm_mtp_drafter", None)
    if callable(take) and not getattr(take, "declines", False):
        if getattr(scheduler, "_vlm_mtp_drafter", None) is not None:
            take(None)
            was_on = True

        def decline(drafter, draft_block_size=None):
            if drafter is None:
                return take(None, draft_block_size=draft_block_size)
            log.info("omlx-mtp: oMLX's VLM MTP stands aside (omlx-mtp drafts for this model); "
                     "its assistant is not used")

        decline.declines = True
        scheduler.set_vlm_mtp_drafter = decline
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
