"""omlx-mtp: lossless multi-token-prediction speculative decoding for oMLX and mlx-lm."""

__version__ = "0.1.0"


def get_plugin_manager():
    """A pluggy manager for project "omlx" with the hook contract and every installed plugin
    (entry point group "omlx", omlx-mtp's own included)."""
    import pluggy

    from . import hookspecs

    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.load_setuptools_entrypoints(hookspecs.PROJECT)
    return manager
