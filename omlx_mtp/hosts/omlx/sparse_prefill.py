"""Requests that oMLX's SpecPrefill prefilled sparsely, taken over by the MTP loop.

SpecPrefill keeps only the prompt tokens a small scorer found important and prefills them at their
true RoPE positions, so the cache holds N entries of an M-token prompt.  For decoding it wraps the
RoPE of every attention layer of the *shared* model with a constant adjustment A (oMLX's
``_OffsetAdjustedRoPE``: ``rope(x, offset + A)``), the next token's position being the cache's
length plus A, and unwraps at the request's end.

The MTP loop reads positions per row from its own cache tables (the target's verify and the
drafter's query both), so at admission the wrappers come off the model and A becomes that row's
RoPE shift: the request sits at the positions plain decoding after the same sparse prefill uses,
nothing is added twice, and other rows of the batch keep their own positions.  Should the request
run in the host's own loop after all, the wrappers go back on (``put_back``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import MTPError

# The class oMLX 0.3.8 (omlx/patches/specprefill.py) installs; matched by name and by the two
# attributes it is read through, so this module never imports oMLX.
WRAPPER = "_OffsetAdjustedRoPE"


def _is_wrapper(rope) -> bool:
    return type(rope).__name__ == WRAPPER and hasattr(rope, "_original") and hasattr(rope, "_adjustment")


def _attention_modules(model) -> list:
    """The attention modules oMLX's sparse prefill wraps: ``self_attn`` (or a hybrid's ``*``
    mixer) of each of the model's layers."""
    out = []
    for layer in getattr(model, "layers", None) or []:
        if hasattr(layer, "self_attn"):
            out.append(layer.self_attn)
        elif getattr(layer, "block_type", None) == "*":
            out.append(layer.mixer)
    return out


@dataclass
class SparsePrefill:
    """The wrappers taken off a model (to put back if need be) and what they adjusted by."""

    wrapped: list = field(default_factory=list)  # (attention module, wrapper)
    shared: bool = False  # several requests came with the wrappers (oMLX inserts one): whose they are is unknown

    def __bool__(self) -> bool:
        return bool(self.wrapped)

    @property
    def adjustment(self) -> int:
        if self.shared:  # stays so after put_back: every one of those requests runs in the host's loop
            raise MTPError("SpecPrefill's RoPE wrappers came with several requests inserted together")
        found = {int(wrapper._adjustment) for _, wrapper in self.wrapped}
        if len(found) > 1:
            raise MTPError(f"SpecPrefill's RoPE adjustments differ between layers: {sorted(found)}")
        return found.pop() if found else 0

    def put_back(self) -> None:
        for attention, wrapper in self.wrapped:
            attention.rope = wrapper
        self.wrapped = []


def take_sparse_prefill(model, requests: int = 1) -> SparsePrefill:
    """Take SpecPrefill's RoPE wrappers off ``model`` (the host's model), inserted with ``requests``
    requests; an empty result when none are installed.  With several requests the wrappers can't be
    given to one of them: every one runs in the host's loop, the wrappers back on, as the host would."""
    wrapped = [(attention, attention.rope) for attention in _attention_modules(model)
               if _is_wrapper(getattr(attention, "rope", None))]
    for attention, wrapper in wrapped:
        attention.rope = wrapper._original
    return SparsePrefill(wrapped, shared=bool(wrapped) and requests > 1)
