"""Choosing the draft depth per round from measured acceptance and measured round cost.

With s_i the chance that draft i is accepted once drafts 1..i-1 were, a round of k drafts emits
E(k) = 1 + sum over i <= k of s_1 ... s_i tokens on average (acceptance is bursty: after an accepted
draft the next is likelier to be, so one rate for all positions would undercount deep rounds), and
costs t(k) seconds (drafting plus one verify of k+1 positions, host work included).  The controller
picks the k in 0..max_depth with the most tokens per second, E(k) / t(k); k = 0 is plain decoding.

What drafting is compared against matters most.  t(0) is the *measured* cost of a step in the loop's
pipelined plain stretch (no host sync per step), never a guess from the drafting rounds: a line
through those rounds meets k = 0 well above a pipelined step, and a controller that believes it
keeps drafting where drafting loses.  So plain steps are measured before the first drafting round
and again every ``refresh_every`` drafting rounds; the costs (``RoundCosts``) belong to a batch size
and a context length (``context_bucket``), not a request, so every request of a server shares what
earlier ones measured, and costs measured on short requests are not applied to long ones.

t(k) for drafting rounds comes from a line fitted to recent rounds of all depths, kept in plain
steps (one noisy round then moves every estimate a little instead of one estimate a lot); a round
slower than three times its estimate is taken for a stall elsewhere on the machine and counted as
three times its estimate, unless several come in a row (then the machine did get slower).  Stalls are
counted, not left out: they strike plain stretches and drafting rounds alike, and a stretch absorbs
its stall into the mean of its steps, so leaving out only drafting rounds' stalls made drafting look
cheaper than it was.  Three rounds in a row 25% off their
estimate ask for plain steps to be measured again.  The s_i are decayed counts,
each position leaning on the one before it while it has few trials, with a prior worth two drafts at
75%, so one unlucky round does not send a good drafter away while a few rejected rounds stop a
useless one.  Once requests of the same kind (greedy, or one sampled distribution) have decoded,
a new request's prior is their recent acceptance instead (``AcceptanceMemory``, worth four drafts
per position), and its probes start from the wait they reached: a server's requests are short, and
learning acceptance again in each one costs drafting rounds where drafting loses.  Every
``explore_every`` drafting rounds one goes a draft deeper than the best, so deeper positions get
measured.  Drafting must promise ``margin`` over plain.

When plain wins, MTP steps aside and probes after ``probe_every`` rounds, doubling the wait after
each rejected probe.  Where drafts lost on acceptance, an accepted probe that brings the estimate
within ``trial_gap`` of plain opens a trial of a few drafting rounds (text that became predictable
gets MTP back on fresh evidence, a drafter that merely loses does not get rounds to lose); where even perfect
drafts could not beat plain steps (a verify that costs too much on this machine), probes only keep
the costs fresh, at the longest wait, and open no trial.  Rounds that compiled a graph are not
timed (``observe`` gets None).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundCosts:
    """What rounds cost at one batch size: seconds per plain step, and a line through drafting
    rounds kept in plain steps (a round's seconds over the plain step's at the time).  A machine
    whose speed swings (other work on it) moves both alike, so their ratio is what stays true
    between a plain stretch and drafting rounds measured minutes apart; a run of drafting rounds
    off their estimate says the speed moved, and asks for plain steps to be measured again."""

    smoothing: float = 0.2  # EMA weight of a new round time
    fit_decay: float = 0.95  # for the line through drafting round times (about twenty rounds)
    outlier: float = 3.0  # a round slower than this many times its estimate is a stall, counted as this...
    max_stalls: int = 3  # ... unless it is the fourth such round in a row
    drift: float = 1.25  # drafting rounds this far off their estimate, three in a row: the speed moved
    times: dict = field(default_factory=dict)  # depth -> EMA (0: seconds per plain step; k > 0: plain steps)
    plain_age: int = 0  # drafting rounds timed since plain steps were
    stale: bool = False  # plain steps should be measured again (the machine's speed moved)
    _fit: list = field(default_factory=lambda: [0.0] * 5)  # decayed sums: weight, k, k^2, t, k*t
    _stalls: list = field(default_factory=lambda: [0, 0])  # in a row: plain steps, drafting rounds
    _drifted: int = 0

    @property
    def plain(self) -> float | None:
        return self.times.get(0)

    def observe(self, k: int, seconds: float) -> None:
        if k == 0:
            if self.plain is None and self.drafting_known:  # those rounds were kept in seconds: start over
                self.times = {}
                self._fit = [0.0] * 5
            value, expected = seconds, self.plain
        else:
            value, expected = seconds / (self.plain or 1.0), self._relative(k, self.line())
        kind = int(k > 0)
        if expected and value > self.outlier * expected and self._stalls[kind] < self.max_stalls:
            self._stalls[kind] += 1  # a stall elsewhere on the machine: counted, but at most this much
            value = self.outlier * expected
        else:
            self._stalls[kind] = 0  # (several in a row: the machine did get slower, and the estimates follow)
        if k and expected:
            off = value > self.drift * expected or value * self.drift < expected
            self._drifted = self._drifted + 1 if off else 0
            if self._drifted >= 3:
                self.stale, self._drifted = True, 0
        previous = self.times.get(k)
        self.times[k] = value if previous is None else previous + self.smoothing * (value - previous)
        if k == 0:
            self.plain_age, self.stale = 0, False
            return
        self.plain_age += 1
        self._fit = [self.fit_decay * a + b for a, b in zip(self._fit, (1.0, k, k * k, value, k * value))]

    def line(self) -> tuple[float, float] | None:
        """(intercept, cost per draft), in plain steps, fitted to recent drafting rounds once two
        depths were seen."""
        w, sk, skk, st, skt = self._fit
        spread = w * skk - sk * sk
        if w <= 0 or spread <= 1e-9 * w * w:
            return None
        slope = max((w * skt - sk * st) / spread, 0.0)
        return (st - slope * sk) / w, slope

    def round_time(self, k: int, line: tuple[float, float] | None) -> float | None:
        """t(k) in seconds; ``line``: ``line()``, computed once by the caller for all depths."""
        if k == 0:
            return self.plain
        relative = self._relative(k, line)
        return None if relative is None else relative * (self.plain or 1.0)

    def _relative(self, k: int, line) -> float | None:
        """t(k) in plain steps (k = 0: 1 by definition, once known)."""
        if k == 0:
            return 1.0 if self.plain else None
        if line is not None:  # every drafting round informs every depth: one noisy round moves little
            return max(line[0] + line[1] * k, 0.1)  # (a noisy fit's intercept can fall below zero)
        if k in self.times:
            return self.times[k]
        drafting = sorted((d, t) for d, t in self.times.items() if d > 0)
        points = drafting if len(drafting) >= 2 else ([(0, 1.0)] if self.plain else []) + drafting
        if len(points) >= 2:
            (k0, t0), (k1, t1) = points[0], points[-1]
            return t0 + max((t1 - t0) / (k1 - k0), 0.0) * (k - k0)
        if len(points) == 1:  # one measurement: assume each draft adds a third of a plain round
            k0, t0 = points[0]
            return t0 / (1 + k0 / 3) * (1 + k / 3)
        return None

    @property
    def drafting_known(self) -> bool:
        return any(k > 0 for k in self.times)

    def carried(self) -> "RoundCosts":
        """A copy to start another context length or batch size from: its drafting line is a first
        guess, and its plain step is measured again before it is trusted."""
        copy = RoundCosts(self.smoothing, self.fit_decay, self.outlier, self.max_stalls, self.drift,
                          dict(self.times), _fit=list(self._fit))
        copy.stale = True
        return copy


def context_bucket(tokens: int) -> int:
    """Which costs a row of this many tokens shares: one set below 2k tokens, then one per doubling.
    Attention's share of a step grows with the context, and a verify's share faster (K + 1 queries
    over the whole K/V) or slower (one read of K/V for all of them) than a plain step's, so costs
    measured on short requests do not hold for long ones."""
    return max(0, int(tokens).bit_length() - 11)


@dataclass
class PositionCounts:
    """Decayed counts, per draft position, of drafts looked at and drafts kept."""

    decay: float
    successes: list = field(default_factory=list)
    trials: list = field(default_factory=list)

    def observe(self, k: int, accepted: list[int]) -> None:
        """A round of k drafts in which row r kept accepted[r] of them."""
        grow = k - len(self.trials)
        if grow > 0:
            self.successes += [0.0] * grow
            self.trials += [0.0] * grow
        for i in range(len(self.trials)):
            tried = sum(1 for n in accepted if i < k and n >= i)  # rows whose draft i was looked at
            kept = sum(1 for n in accepted if n > i)
            self.successes[i] = self.decay * self.successes[i] + kept
            self.trials[i] = self.decay * self.trials[i] + tried

    def rates(self, depth: int, prior: float, weight: float, priors: list[float] | None = None) -> list[float]:
        """s_i for positions 1..depth: each position's counts against a prior worth ``weight`` drafts,
        ``priors[i]`` where given, else the estimate of the position before (``prior`` for the first),
        so a position with few trials leans on its neighbour."""
        out = []
        for i in range(depth):
            successes, trials = (self.successes[i], self.trials[i]) if i < len(self.trials) else (0.0, 0.0)
            base = priors[i] if priors is not None else prior
            prior = (successes + base * weight) / (trials + weight)
            out.append(prior)
        return out


@dataclass
class AcceptanceMemory:
    """Per draft position, how often drafts were accepted in the recent rounds of every request of
    one kind (greedy, or one sampled distribution) on one decoder.  A new request's controller
    starts from it instead of a generic prior: requests of a server are short, and learning the
    drafter's acceptance again in each one costs rounds that lose where drafting does not pay."""

    counts: PositionCounts = field(default_factory=lambda: PositionCounts(decay=0.99))  # a few requests' rounds
    probe_wait: int = 0  # plain rounds between probes that earlier requests reached (0: none rejected)

    def observe(self, k: int, accepted: list[int]) -> None:
        self.counts.observe(k, accepted)

    def rates(self, depth: int, prior: float, weight: float) -> list[float] | None:
        """s_i for draft positions 1..depth once any round was seen (None before)."""
        if not self.counts.trials or self.counts.trials[0] < 1.0:
            return None
        return self.counts.rates(depth, prior, weight)


@dataclass
class DepthController:
    max_depth: int
    min_acceptance: float = 0.0
    probe_every: int = 16
    max_probe_every: int = 128
    start_depth: int = 2
    decay: float = 0.97  # for acceptance counts (an effective window of ~30 drafts)
    margin: float = 1.03  # drafting must promise 3% over plain decoding
    fixed: bool = False  # a fixed depth: always max_depth, except plain rounds below min_acceptance
    prior_successes: float = 1.5
    prior_trials: float = 2.0
    explore_every: int = 8
    reach: int = 2  # depths chosen at most this many drafts past the deepest one measured
    trial_rounds: int = 4  # drafting rounds after an accepted probe, before plain may win again
    trial_gap: float = 0.9  # ... opened only where drafting's estimated rate is within this of plain's
    plain_steps: int = 4  # plain steps measured before the first drafting round, and at each refresh
    refresh_every: int = 64  # drafting rounds between measurements of plain steps
    costs: RoundCosts = field(default_factory=RoundCosts)  # shared by the controllers of one batch size
    memory: AcceptanceMemory | None = None  # acceptance of earlier requests of this kind: the prior
    memory_weight: float = 4.0  # ... worth this many drafts per position
    _successes: float = 0.0
    _trials: float = 0.0
    _plain_rounds: int = 0
    _wait: int = 0
    _probing: bool = False
    _hopeless: bool = False  # plain won even against perfect drafts
    _since_explore: int = 0
    _trial: int = 0
    _measure: int = 0  # plain steps still to take for a measurement
    _measurements: int = 0  # plain measurements started while no plain time was known
    _untimed_plain: bool = False  # a plain step came back untimed (it compiled its graph)
    _positions: PositionCounts | None = None  # this request's acceptance per draft position

    def __post_init__(self):
        self._positions = PositionCounts(self.decay)

    @property
    def times(self) -> dict:
        return self.costs.times

    @property
    def acceptance(self) -> float:
        return (self._successes + self.prior_successes) / (self._trials + self.prior_trials)

    def position_acceptance(self) -> list[float]:
        """s_i for draft positions 1..max_depth."""
        prior = self.prior_successes / self.prior_trials
        remembered = self.memory.rates(self.max_depth, prior, self.prior_trials) if self.memory is not None else None
        if remembered is None:  # a generic prior, each position leaning on the one before
            return self._positions.rates(self.max_depth, prior, self.prior_trials)
        return self._positions.rates(self.max_depth, prior, self.memory_weight, priors=remembered)

    def expected_tokens(self) -> list[float]:
        """E(k) for k = 0..max_depth, in one pass over the draft positions."""
        out = [1.0]
        alive = 1.0
        for s in self.position_acceptance():
            alive *= min(s, 0.999)
            out.append(out[-1] + alive)
        return out

    def choose(self) -> int:
        if self.max_depth == 0:
            return 0
        if self.fixed:
            if self.times and self.acceptance < self.min_acceptance:
                return self._plain_or_probe(self.max_depth)
            self._plain_rounds, self._wait = 0, 0
            return self.max_depth
        if self._measure_plain():
            return 0
        if not self.costs.drafting_known:
            return min(self.start_depth, self.max_depth)
        if self.acceptance < self.min_acceptance:
            return self._plain_or_probe()
        rates = self._rates()
        trial = self._trial > 0
        if trial:  # after an accepted probe: draft a few rounds and let them speak
            self._trial -= 1
            rates.pop(0, None)
        best = max(rates, key=rates.get)
        if best == 0 or (0 in rates and rates[best] < self.margin * rates[0]):
            self._hopeless = self._perfect_rate() < self.margin * rates[0]
            return self._plain_or_probe()
        self._plain_rounds, self._wait, self._hopeless = 0, 0, False
        if self.memory is not None and not trial:  # drafting won on evidence, not on a trial's credit
            self.memory.probe_wait = 0
        self._since_explore += 1
        if self._since_explore >= self.explore_every and best < self.max_depth:
            self._since_explore = 0
            return best + 1
        return best

    def _times(self, deepest: int) -> dict:
        """t(k) for k in 0..deepest whose time is known or can be estimated."""
        line = self.costs.line()
        return {k: t for k in range(deepest + 1) if (t := self.costs.round_time(k, line)) is not None}

    def _rates(self) -> dict:
        """E(k) / t(k) for the depths whose time is known or can be estimated — at most ``reach``
        drafts deeper than any depth measured: a line through shallow rounds says little far beyond them."""
        measured = max((k for k in self.costs.times if k > 0), default=self.start_depth - 1)
        times = self._times(min(self.max_depth, measured + self.reach))
        return {k: expected / times[k] for k, expected in enumerate(self.expected_tokens()) if k in times}

    def _perfect_rate(self) -> float:
        """Tokens per second were every draft right, at the best depth up to ``max_depth`` (the
        line extrapolated: whether drafting could ever win here, not which depth to try next)."""
        return max(((k + 1) / t for k, t in self._times(self.max_depth).items() if k > 0 and t), default=0.0)

    def _within_reach(self) -> bool:
        """Whether drafting, at the acceptance now estimated, comes within ``trial_gap`` of plain."""
        rates = self._rates()
        drafting = max((r for k, r in rates.items() if k > 0), default=0.0)
        return 0 not in rates or drafting >= self.trial_gap * rates[0]

    def _measure_plain(self) -> bool:
        """True while plain steps are being measured: before any drafting round when no plain time
        is known (a second try when the first stretch compiled its graph and so went untimed), and
        again when the last measurement is ``refresh_every`` drafting rounds old."""
        if not self._measure:
            unknown = self.costs.plain is None and (self._measurements == 0 or self._untimed_plain)
            if unknown and self._measurements >= 2:  # never timed (compiles every time): draft without it
                unknown = False
            if unknown or self.costs.stale or self.costs.plain_age >= self.refresh_every:
                self._measure = self.plain_steps
                self._measurements += unknown
                self._untimed_plain = False
                self.costs.plain_age, self.costs.stale = 0, False  # one controller measures; the others need not
        if self._measure:
            self._measure -= 1
            return True
        return False

    def _plain_or_probe(self, probe_depth: int = 1) -> int:
        # A request starts from the wait earlier ones reached, up to twice the first: its text may
        # be likelier to draft well than theirs.
        inherited = min(self.memory.probe_wait, 2 * self.probe_every) if self.memory is not None else 0
        first_wait = inherited or self.probe_every
        self._wait = self.max_probe_every if self._hopeless else (self._wait or first_wait)
        self._plain_rounds += 1
        if self._plain_rounds >= self._wait:
            self._plain_rounds, self._probing = 0, True
            return probe_depth
        return 0

    def observe(self, k: int, accepted: list[int], seconds: float | None) -> None:
        """After a round of depth k: accepted drafts per row, and the round's wall time (None: not
        representative, e.g. it included compiling a graph)."""
        if seconds is not None:
            self.costs.observe(k, seconds)
        elif k == 0:
            self._untimed_plain = True
        if k == 0 or not accepted:
            return
        if self.memory is not None:
            self.memory.observe(k, accepted)
        probe_accepted = self._probing and sum(accepted) > 0
        if self._probing:  # a rejected probe doubles the wait; an accepted one may open a trial (below)
            self._probing = False
            if not probe_accepted:
                self._wait = min(2 * self._wait, self.max_probe_every)
                if self.memory is not None:  # the next request does not start its probes over
                    self.memory.probe_wait = self._wait
        self._successes = self.decay * self._successes + sum(accepted)
        self._trials = self.decay * self._trials + sum(n + 1 if n < k else k for n in accepted)
        self._positions.observe(k, accepted)
        if probe_accepted and not self._hopeless and self._within_reach():
            self._wait, self._trial = self.probe_every, self.trial_rounds
