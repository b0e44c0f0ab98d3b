"""oMLX's TurboQuant KV setting, as it meets MTP.

oMLX 0.3.8 turns ``turboquant_kv_enabled`` into two things at engine start: mlx-lm's attention is
patched to read ``TurboQuantKVCache`` layers, and the bits are recorded on the scheduler
(``_turboquant_kv_bits``).  Its converters into TurboQuant caches are never called (they are left
out of prefill, #771), so every request — plain or MTP — decodes on float K/V under the patch, and
MTP with TurboQuant on answers exactly as TurboQuant with MTP off.  A host that does hand a request
quantized caches gets it decoded by its own loop: the MTP loop reads float K/V only, and its
fallback counters and log say so.
"""

from __future__ import annotations

import logging

log = logging.getLogger("omlx_mtp.hosts.omlx")


def turboquant_bits(scheduler) -> float | None:
    """The TurboQuant KV bits oMLX set on this scheduler, or None when it is off."""
    bits = getattr(scheduler, "_turboquant_kv_bits", None)
    return float(bits) if bits else None


def note_turboquant(scheduler, model_id: str) -> dict | None:
    """Log, once at engine start, what TurboQuant KV means for this model's MTP requests; returns
    the stats entry ({"bits": ...}) or None when TurboQuant is off."""
    bits = turboquant_bits(scheduler)
    if bits is None:
        return None
    log.info("omlx-mtp: %s has TurboQuant KV (%g bits) on: requests whose caches arrive quantized decode "
             "in oMLX's own loop; oMLX 0.3.8 hands every request float caches (its TurboQuant converters "
             "are not called), so MTP requests keep float K/V exactly as plain ones do", model_id, bits)
    return {"bits": bits}
