"""User-facing errors: one clear message, no traceback."""


class MTPError(Exception):
    """A problem with the user's input (files, configs, options).  Its message is one line
    whatever it quotes (mlx's load errors list parameters one per line)."""

    def __str__(self) -> str:
        return " ".join(super().__str__().split())


class CheckpointError(MTPError):
    """A checkpoint directory is missing, corrupt or of an unsupported kind."""


class DrafterMismatchError(MTPError):
    """A drafter does not fit the target it is paired with."""
