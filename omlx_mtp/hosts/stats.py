"""Per-model MTP counters for a host's stats (oMLX: ``Scheduler.get_stats()``, ``/v1/models/status``,
the admin dashboard).

The strategy owns them, so they outlive the generators a host throws away and makes again;
the generator reports into them as requests are admitted, run rounds and finish.  The engine's
thread writes and the server's threads read, so every access holds the lock.
"""

from __future__ import annotations

import threading

from ..decode.requests import DecodeStats

# Why a request decoded plain instead of running MTP rounds.
CACHE = "cache"  # a cache this loop can't read: the host's own BatchGenerator runs it
SAMPLER = "sampler"  # a host sampler that is not a distribution this loop rebuilds (XTC)
LOGITS_PROCESSOR = "logits_processor"  # a processor whose state can't be rolled back
FALLBACK_REASONS = (CACHE, SAMPLER, LOGITS_PROCESSOR)


class MTPCounters:
    def __init__(self):
        self._lock = threading.Lock()
        self._generator = 0  # serial of the host's current generator
        self._requests = 0  # requests admitted to MTP rounds
        self._running = 0  # of those, running in the current generator
        self._totals = DecodeStats()
        self._fallbacks = dict.fromkeys(FALLBACK_REASONS, 0)
        self._unavailable: str | None = None  # why the last generator could not be made
        self._settings: dict = {}  # host settings that bear on MTP (e.g. TurboQuant KV), as noted at start

    def generator_started(self) -> int:
        """A new generator for the host; returns its serial.  A host makes one after throwing the
        previous one away with whatever ran in it (oMLX re-runs those requests), so nothing runs now."""
        with self._lock:
            self._generator += 1
            self._running = 0
            self._unavailable = None
            return self._generator

    def generator_failed(self, reason: str) -> None:
        with self._lock:
            self._running = 0
            self._unavailable = reason

    def admitted(self, generator: int) -> None:
        with self._lock:
            self._requests += 1
            if generator == self._generator:
                self._running += 1

    def finished(self, generator: int) -> None:
        """A request admitted to MTP finished or was aborted."""
        with self._lock:
            if generator == self._generator and self._running:
                self._running -= 1

    def add(self, rounds: DecodeStats) -> None:
        """Rounds just run (one step's rows added together), so counters move during a request."""
        with self._lock:
            self._totals = DecodeStats.pooled([self._totals, rounds])

    def note(self, name: str, value) -> None:
        """A host setting that bears on MTP, reported beside the counters."""
        with self._lock:
            self._settings[name] = value

    def fell_back(self, reason: str) -> None:
        with self._lock:
            self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1

    def snapshot(self) -> dict:
        """A plain, JSON-able copy."""
        with self._lock:
            out = {"enabled": self._unavailable is None}
            if self._unavailable is not None:
                out["reason"] = self._unavailable
            out.update(requests=self._requests, running=self._running)
            out.update({k: round(v, 4) if isinstance(v, float) else v for k, v in self._totals.as_dict().items()})
            out["fallbacks"] = dict(self._fallbacks)
            out.update(self._settings)
            return out
