"""The pluggy contract (project name ``omlx``): what a host such as oMLX calls, and plugins answer.

Hooks marked ``firstresult`` stop at the first plugin that returns something other than None; a
plugin registered later is asked first, so a third-party plugin can take over a model from ours.
"""

from __future__ import annotations

import sys

import pluggy

PROJECT = "omlx"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(firstresult=True)
def omlx_skip_tensor_in_quantization(name: str, config: dict) -> bool | None:
    """True: the quantizer drops this tensor; False: it must keep it; None: no opinion."""


@hookspec(firstresult=True)
def omlx_tensor_quantization(name: str, shape: tuple, config: dict) -> dict | bool | None:
    """A per-tensor override: {"bits", "group_size", "mode"}, False to leave it unquantized, None: default."""


@hookspec
def omlx_tensors_to_preserve(weights: dict, config: dict) -> dict:
    """Tensors a model's ``sanitize()`` would drop but the checkpoint must keep (name -> array).
    The host calls this on the weights before sanitizing and puts the result back afterwards."""


@hookspec
def omlx_model_settings_schema() -> dict:
    """Extra model-settings keys this plugin understands: key -> one-line description."""


@hookspec(firstresult=True)
def omlx_model_settings(model_id: str, model_path: str | None, base_path: str | None) -> dict | None:
    """This plugin's validated settings for a model (e.g. from YAML under the host's base path;
    None: the plugin's default), or None."""


@hookspec(firstresult=True)
def omlx_load_drafter(model_id: str, model_path: str, model, settings: dict):
    """A drafter for the loaded target ``model``, or None.  Must not raise for user errors:
    log why and return None so the model still serves without MTP."""


@hookspec(firstresult=True)
def omlx_decode_strategy(model_id: str, model, drafter, settings: dict):
    """A decode strategy for this model, or None for plain decoding.  A strategy has a ``name``
    and ``batch_generator(plain_factory, **batch_generator_kwargs)`` returning an object with
    the host's BatchGenerator API (see ``omlx_mtp.hosts.strategy.MTPStrategy``).  A ``batch_generator``
    that names a ``snapshot_interval`` parameter gets the host's paged-cache block size when the
    host snapshots running requests' caches at block boundaries."""


def load_plugin_manager() -> pluggy.PluginManager:
    """A manager for project "omlx" with this contract and every installed plugin (entry point
    group "omlx", omlx-mtp's own included)."""
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(sys.modules[__name__])
    manager.load_setuptools_entrypoints(PROJECT)
    return manager
