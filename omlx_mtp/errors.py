"""User-facing errors: one clear message, no traceback."""


class MTPError(Exception):
    """A problem with the user's input (files, configs, options)."""


class CheckpointError(MTPError):
    """A checkpoint directory is missing, corrupt or of an unsupported kind."""


class DrafterMismatchError(MTPError):
    """A drafter does not fit the target it is paired with."""
