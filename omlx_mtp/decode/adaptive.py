"""Choosing the draft depth per round from measured acceptance and measured round cost.

With s_i the chance that draft i is accepted once drafts 1..i-1 were, a round of k drafts emits
E(k) = 1 + sum over i <= k of s_1 ... s_i tokens on average (acceptance is bursty: after an accepted
draft the next is likelier to be, so one rate for all positions would undercount deep rounds), and
costs t(k) seconds (drafting plus one verify of k+1 positions, host work included).
The controller picks the k in 0..max_depth with the most tokens per second, E(k) / t(k); k = 0 is
plain decoding.  The s_i are decayed counts, each position leaning on the one before it while it has
few trials; t(k) for drafting rounds comes from a line fitted to recent rounds of all depths (one
noisy round then moves every estimate a little instead of one estimate a lot), t(0) from plain steps.  Every ``explore_every`` drafting rounds one goes a draft deeper than the best, so deeper
positions get measured.  When plain
decoding wins, MTP steps aside and re-probes after ``probe_every`` rounds — doubling the wait after
each probe whose draft is rejected; an accepted probe opens a trial of a few drafting rounds, so that a
request sent to plain decoding by an unlucky stretch, or whose text becomes predictable later, gets MTP
back on fresh evidence instead of one probe's worth.
Acceptance is counted, not averaged per round, with a prior worth two drafts at 75% (a typical
first-draft acceptance), so one unlucky round does not send a good drafter
away while a few rejected rounds stop a useless one; drafting must promise a margin over plain.
Rounds that compiled a graph are not timed (``observe`` gets None).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DepthController:
    max_depth: int
    min_acceptance: float = 0.0
    probe_every: int = 16
    max_probe_every: int = 128
    start_depth: int = 2
    smoothing: float = 0.2  # for round times
    decay: float = 0.97  # for acceptance counts (an effective window of ~30 drafts)
    margin: float = 1.03  # drafting must promise 3% over plain decoding
    fixed: bool = False  # a fixed depth: always max_depth, except plain rounds below min_acceptance
    prior_successes: float = 1.5
    prior_trials: float = 2.0
    explore_every: int = 8
    trial_rounds: int = 4  # drafting rounds after an accepted probe, before plain may win again
    fit_decay: float = 0.9  # for the line through drafting round times (about ten rounds)
    times: dict = field(default_factory=dict)  # depth -> EMA seconds per round
    _successes: float = 0.0
    _trials: float = 0.0
    _plain_rounds: int = 0
    _wait: int = 0
    _probing: bool = False
    _since_explore: int = 0
    _trial: int = 0
    _fit: list = field(default_factory=lambda: [0.0] * 5)  # decayed sums: weight, k, k^2, t, k*t
    _position_successes: list = field(default_factory=list)  # per draft position, decayed
    _position_trials: list = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return (self._successes + self.prior_successes) / (self._trials + self.prior_trials)

    def position_acceptance(self) -> list[float]:
        """s_i for draft positions 1..max_depth."""
        out, prior = [], self.prior_successes / self.prior_trials
        for i in range(self.max_depth):
            successes = self._position_successes[i] if i < len(self._position_successes) else 0.0
            trials = self._position_trials[i] if i < len(self._position_trials) else 0.0
            prior = (successes + prior * self.prior_trials) / (trials + self.prior_trials)
            out.append(prior)
        return out

    def expected_tokens(self) -> list[float]:
        """E(k) for k = 0..max_depth, in one pass over the draft positions."""
        out = [1.0]
        alive = 1.0
        for s in self.position_acceptance():
            alive *= min(s, 0.999)
            out.append(out[-1] + alive)
        return out

    def _line(self) -> tuple[float, float] | None:
        """(intercept, seconds per draft) fitted to recent drafting rounds, once two depths were seen."""
        w, sk, skk, st, skt = self._fit
        spread = w * skk - sk * sk
        if w <= 0 or spread <= 1e-9 * w * w:
            return None
        slope = max((w * skt - sk * st) / spread, 0.0)
        return (st - slope * sk) / w, slope

    def round_time(self, k: int, line: tuple[float, float] | None) -> float | None:
        """t(k); ``line``: ``_line()``, computed once by the caller for all depths."""
        if k > 0 and line is not None:  # every drafting round informs every depth: one noisy round moves little
            return line[0] + line[1] * k
        if k in self.times:
            return self.times[k]
        points = sorted(self.times.items())
        if len(points) >= 2:
            (k0, t0), (k1, t1) = points[0], points[-1]
            slope = max((t1 - t0) / (k1 - k0), 0.0)
            return t0 + slope * (k - k0)
        if len(points) == 1:  # one measurement: assume each draft adds a third of a plain round
            k0, t0 = points[0]
            base = t0 / (1 + k0 / 3)
            return base * (1 + k / 3)
        return None

    def choose(self) -> int:
        if self.max_depth == 0:
            return 0
        if self.fixed:
            if self.times and self.acceptance < self.min_acceptance:
                return self._plain_or_probe(self.max_depth)
            self._plain_rounds, self._wait = 0, 0
            return self.max_depth
        if not self.times:
            return min(self.start_depth, self.max_depth)
        if self.acceptance < self.min_acceptance:
            return self._plain_or_probe()
        line = self._line()
        rates = {k: expected / t for k, expected in enumerate(self.expected_tokens())
                 if (t := self.round_time(k, line)) is not None}
        if self._trial:  # after an accepted probe: draft a few rounds and let them speak
            self._trial -= 1
            rates.pop(0, None)
        best = max(rates, key=rates.get)
        if best == 0 or (0 in rates and rates[best] < self.margin * rates[0]):
            return self._plain_or_probe()
        self._plain_rounds, self._wait = 0, 0
        self._since_explore += 1
        if self._since_explore >= self.explore_every and best < self.max_depth:
            self._since_explore = 0
            return best + 1
        return best

    def _plain_or_probe(self, probe_depth: int = 1) -> int:
        self._wait = self._wait or self.probe_every
        self._plain_rounds += 1
        if self._plain_rounds >= self._wait:
            self._plain_rounds, self._probing = 0, True
            return probe_depth
        return 0

    def observe(self, k: int, accepted: list[int], seconds: float | None) -> None:
        """After a round of depth k: accepted drafts per row, and the round's wall time (None: not
        representative, e.g. it included compiling a graph)."""
        if seconds is not None:
            previous = self.times.get(k)
            self.times[k] = seconds if previous is None else previous + self.smoothing * (seconds - previous)
            if k > 0:
                self._fit = [self.fit_decay * a + b for a, b in zip(self._fit, (1.0, k, k * k, seconds, k * seconds))]
        if k == 0 or not accepted:
            return
        if self._probing:  # a rejected probe doubles the wait for the next; an accepted one opens a trial
            self._probing = False
            if sum(accepted) == 0:
                self._wait = min(2 * self._wait, self.max_probe_every)
            else:
                self._wait, self._trial = self.probe_every, self.trial_rounds
        self._successes = self.decay * self._successes + sum(accepted)
        self._trials = self.decay * self._trials + sum(n + 1 if n < k else k for n in accepted)
        grow = k - len(self._position_trials)
        if grow > 0:
            self._position_successes += [0.0] * grow
            self._position_trials += [0.0] * grow
        for i in range(len(self._position_trials)):
            tried = sum(1 for n in accepted if i < k and n >= i)  # rows whose draft i was looked at
            kept = sum(1 for n in accepted if n > i)
            self._position_successes[i] = self.decay * self._position_successes[i] + kept
            self._position_trials[i] = self.decay * self._position_trials[i] + tried
