"""Each round's draft depth: plain decoding (k = 0) or k drafts, whichever gives tokens soonest.

Costs are counted in plain steps (t(0) = 1: a step of the loop's pipelined plain stretch, timed
before the first drafting round and again now and then).  A round of k drafts costs t(k), a line
through recent drafting rounds, and emits E(k) = 1 + s_1 + s_1 s_2 + ... tokens, s_i being the
chance that draft i is kept once drafts 1..i-1 were: counts of drafts looked at and kept, started
from what earlier requests of the same kind accepted.  A depth whose graphs were never traced at
these shapes also pays the trace, spread over the tokens it can serve.  A depth's price is

    tau(k) = t(k) / E(k) + trace(k) / tokens it serves      (plain steps per token; plain: 1)

1. Draft when the lowest price, from the means, beats plain by ``margin``; leaving plain steps
   adds the switch (below) over the next ``horizon`` tokens.  One depth past the deepest run may
   be chosen, its cost and acceptance extrapolated from its neighbours.
2. Otherwise probe only where finding out pays: read every s_i one standard deviation up and
   every t(k) one standard error down, and run the probe whose expected saving (the knowledge
   gradient: how far one round may move the price below plain, over the next ``horizon``
   tokens the request has left) exceeds what the round loses, the switch included.  Where even
   perfect drafts lose, or few tokens are left, nothing is probed.
3. While plain steps run, the counts fade (their means kept, their weight shrinking), so the
   uncertainty grows back and a long request eventually looks again; evidence against drafting
   makes that take longer.  What earlier requests of the kind showed (the prior) fades too, more
   slowly, so a few unlucky rounds do not keep a whole process plain.

A round right after plain steps may run with caches they left cold.  It is held: followed by a
round at its depth, what it took over that one is the switch (so a first round that struck a stall
costs the line nothing); followed by anything else, it joins the line less the switch.  Times are
robust to stalls elsewhere on the machine: a plain step's estimate moves down faster than up, a step
over 2.5 times its estimate counts as 2.5 times it (a drafting round, once four rounds pin the line:
1.5), the line's slope leans on one depth's own excess, and drafting rounds far off their line three
times running have plain steps timed again (that timing replaces the estimate).  Costs belong to a
batch size and context length (``RoundCosts``), shared by every request; a new one starts from the
nearest one measured, weighed as one round.  Every rank of a sharded target observes rank 0's times,
so choices are deterministic from the same inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_TRACE = 8.0  # plain steps a round that traces its graphs is assumed to add, until one is measured


@dataclass
class RoundCosts:
    """What rounds cost at one batch size and context length: seconds per plain step, a line
    through drafting rounds in plain steps, and the depths whose graphs are traced.  A machine
    whose speed swings moves plain steps and drafting rounds alike, so their ratio holds between
    measurements minutes apart."""

    smoothing: float = 0.03  # EMA weight of a slower plain step's time (a stretch of eight: a fifth) ...
    speedup: float = 0.1  # ... and of a faster one's: a stall only ever adds time
    fit_decay: float = 0.95  # for the line through drafting rounds (about twenty rounds)
    outlier: float = 2.5  # a plain step over this many times its estimate is a stall, counted as this many ...
    round_outlier: float = 1.5  # ... and a drafting round, once the line is pinned down
    times: dict = field(default_factory=dict)  # 0: seconds per plain step; k > 0: last round at k, plain steps
    traced: set = field(default_factory=set)  # depths run (their graphs exist) at these shapes
    trace: float = DEFAULT_TRACE  # plain steps a trace adds to its round
    plain_age: int = 0  # drafting rounds since plain steps were timed
    refreshes: int = 0  # timings of plain steps after the first
    decoded: int = 0  # tokens decoded at these shapes so far
    stale: bool = False  # plain steps must be timed again before they are trusted ...
    retiming: int = 0  # ... and while so many of them are still to come, their mean replaces the estimate
    _retimed: int = 0  # steps of that timing seen so far
    noise: float = 0.0625  # mean squared relative deviation of a drafting round from its estimate (25%)
    switch: float = 0.0  # plain steps a drafting round right after plain steps takes over the next one (EMA)
    _fit: list = field(default_factory=lambda: [0.0] * 5)  # decayed sums: weight, k, k^2, t, k*t
    _off: int = 0  # drafting rounds in a row far off their estimate
    _held: tuple | None = None  # (depth, plain steps) of a round right after plain steps, not yet in the line

    @property
    def plain(self) -> float | None:
        return self.times.get(0)

    @property
    def drafting_known(self) -> bool:
        return self._fit[0] > 0

    def observe(self, k: int, seconds: float, traced: bool = False, switched: bool = False) -> None:
        """A round of depth k (0: one plain step) took ``seconds`` per step; ``switched``: it came
        right after plain steps (or first in a request), which left the caches cold for it.  Such
        a round is held: followed by one at its depth, what it took over that one is the switch's
        (a first round that struck a stall costs the line nothing); followed by anything else, it
        joins the line less the switch."""
        if k:
            self.traced.add(k)
        plain = self.plain
        held, self._held = self._held, None
        if held is not None and (k != held[0] or switched or traced):
            self._add(*held)
        if k == 0:
            if not traced:
                if plain is None or self.retiming:  # the first step timed, or a timing that replaces
                    self._retimed += 1  # 0 outside a timing that replaces
                    self.times[0] = seconds if self._retimed == 1 else plain + (seconds - plain) / self._retimed
                    self.retiming = max(self.retiming - 1, 0)
                    if not self.retiming:
                        self._retimed = 0
                else:
                    weight = self.smoothing if seconds > plain else self.speedup
                    self.times[0] = plain + weight * (min(seconds, self.outlier * plain) - plain)
                self.plain_age, self.stale = 0, False
            return
        if plain is None:
            return
        relative = seconds / plain
        if traced:  # the round's excess over its estimate is what tracing cost
            expected = self.relative(k)
            self.trace += 0.5 * (max(relative - (expected or relative), 0.0) - self.trace)
            return
        self.times[k] = relative
        self.plain_age += 1
        if switched:
            self._held = (k, relative)
            return
        if held is not None:  # a stall in either round counts as one round's worth at most
            self.switch += 0.2 * (min(max(held[1] - relative, -relative), relative) - self.switch)
        self._add(k, relative, held=False)

    def _add(self, k: int, relative: float, held: bool = True) -> None:
        """One round into the line (a held one less the switch), its deviation into the noise."""
        if held:
            relative = max(relative - self.switch_cost, 0.1)
        expected = self.relative(k)
        if expected is not None:
            # A line pinned by several rounds clips harder: one slow round at a rarely run depth
            # would tilt it; a line carried from other shapes must be overruled quickly.
            relative = min(relative, (self.round_outlier if self._fit[0] >= 4 else self.outlier) * expected)
            self.noise += 0.1 * ((relative / expected - 1.0) ** 2 - self.noise)
            # Three rounds in a row a quarter off their estimate: the machine's speed moved since
            # plain steps were timed, and they are timed again.
            self._off = self._off + 1 if abs(relative / expected - 1.0) > 0.25 else 0
            if self._off >= 3:
                self.stale, self._off = True, 0
        self._fit = [self.fit_decay * a + b for a, b in zip(self._fit, (1.0, k, k * k, relative, k * relative))]

    @property
    def switch_cost(self) -> float:
        return max(self.switch, 0.0)

    def relative(self, k: int) -> float | None:
        """t(k) in plain steps (None before any drafting round was timed)."""
        if k == 0:
            return 1.0
        w, sk, skk, st, skt = self._fit
        if w <= 0:
            return None
        mean_k, mean_t = sk / w, st / w
        spread = skk / w - mean_k * mean_k
        # One depth alone: its excess over a plain step, spread over its positions.  More depths
        # fit a line, leaning on that slope as much as one round at a neighbouring depth would, so
        # that one slow round at a rarely run depth cannot tilt a line the others pinned down.
        lone = max((mean_t - 1.0) / (mean_k + 1.0), 0.05)
        slope = max((skt - sk * mean_t + lone) / (spread * w + 1.0), 0.0)
        return max(mean_t + slope * (k - mean_k), 0.1)

    def optimism(self) -> float:
        """The factor that takes t(k) one standard error below its estimate: few or scattered
        rounds leave room to look again."""
        return 1.0 - min(0.5, math.sqrt(self.noise / (self._fit[0] + 1.0)))

    def trace_cost(self, k: int) -> float:
        """Plain steps a round at depth k pays for tracing its graphs (0 once they exist)."""
        return 0.0 if k in self.traced else self.trace

    @property
    def deepest(self) -> int:
        return max(self.traced, default=0)

    def carried(self) -> "RoundCosts":
        """A first guess for another context length or batch size: its drafting line and trace
        cost; its plain step is timed again, and its graphs are traced anew (other shapes)."""
        weight = self._fit[0]  # its drafting line worth one round: the first rounds here overrule it
        return RoundCosts(smoothing=self.smoothing, speedup=self.speedup, fit_decay=self.fit_decay,
                          outlier=self.outlier, times=dict(self.times), trace=self.trace, noise=self.noise, stale=True,
                          switch=self.switch,
                          _fit=[x / weight for x in self._fit] if weight > 1 else list(self._fit))


def context_bucket(tokens: int) -> int:
    """Which costs a row of this many tokens shares: one set below 2k tokens, then one per doubling.
    Attention's share of a step grows with the context, and a verify's faster or slower than a
    plain step's, so costs measured on short requests do not hold for long ones."""
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

    def fade(self, factor: float) -> None:
        """Less evidence, the same means: the caller fades its prior's weight alike."""
        self.successes = [factor * s for s in self.successes]
        self.trials = [factor * t for t in self.trials]

    def estimates(self, depth: int, prior: float, weight: float, priors: list | None = None) -> list[tuple]:
        """(mean, evidence) of s_i for positions 1..depth: each position's counts against a prior
        worth ``weight`` drafts, ``priors[i]`` where given, else the mean of the position before
        (``prior`` for the first), so a position with few trials leans on its neighbour."""
        out = []
        for i in range(depth):
            successes, trials = (self.successes[i], self.trials[i]) if i < len(self.trials) else (0.0, 0.0)
            base = priors[i] if priors is not None else prior
            prior = (successes + base * weight) / (trials + weight)
            out.append((prior, trials + weight))
        return out


@dataclass
class AcceptanceMemory:
    """Per draft position, how often drafts were accepted in the recent rounds of every request of
    one kind (greedy, or one sampled distribution) on one decoder: a new request's prior, so that
    short requests do not each pay rounds to learn it again."""

    counts: PositionCounts = field(default_factory=lambda: PositionCounts(decay=0.99))  # a few requests' rounds
    fading: float = 0.999  # per plain step of a request of this kind: evidence halves in about 350

    def observe(self, k: int, accepted: list[int]) -> None:
        self.counts.observe(k, accepted)

    def fade(self) -> None:
        """A plain step of a request of this kind: what drafting showed ages for the whole process,
        so that a few unlucky rounds early on do not keep every later request from looking again."""
        self.counts.fade(self.fading)

    def prior(self, depth: int, prior: float, weight: float) -> tuple[list[float], float] | None:
        """(s_i for positions 1..depth, evidence worth at most ``weight`` drafts) once any round was
        seen (None before); faded evidence keeps its means."""
        if not self.counts.trials:
            return None
        return [m for m, _ in self.counts.estimates(depth, prior, 2.0)], min(weight, self.counts.trials[0])


def _optimistic(mean: float, evidence: float) -> float:
    """An acceptance rate one standard deviation above its mean."""
    return min(1.0, mean + math.sqrt(mean * (1.0 - mean) / (evidence + 1.0)))


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def probe_value(mean: float, optimistic: float, share: float) -> float:
    """Plain steps per token a probe is expected to save (the knowledge gradient): the price of
    drafting tau is taken as Normal(mean, mean - optimistic); a probe moves its estimate by a
    Normal of sd (mean - optimistic) * sqrt(share), ``share`` being the probe's part of the
    evidence after it, and the saving is E[max(0, 1 - tau)] under that move (0 where plain stays
    better whatever the probe shows)."""
    sigma = (mean - optimistic) * math.sqrt(share)
    if sigma <= 1e-9:
        return max(0.0, 1.0 - mean)
    z = (1.0 - mean) / sigma
    return (1.0 - mean) * _normal_cdf(z) + sigma * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)


@dataclass
class DepthController:
    max_depth: int
    min_acceptance: float = 0.0  # below this first-draft acceptance, decode plainly
    fixed: bool = False  # always max_depth, except plain decoding below min_acceptance
    costs: RoundCosts = field(default_factory=RoundCosts)  # shared by the controllers of one batch size
    memory: AcceptanceMemory | None = None  # acceptance of earlier requests of this kind: the prior
    margin: float = 1.03  # drafting must promise this much over plain decoding
    decay: float = 0.98  # of acceptance counts per drafting round (about fifty drafts)
    fade: float = 0.995  # ... per plain step: evidence halves in about 140 steps without drafts
    horizon: int = 100  # tokens over which what a probe finds is taken to hold (text changes)
    prior: float = 0.75  # acceptance assumed before any is seen ...
    prior_weight: float = 2.0  # ... worth this many drafts
    memory_weight: float = 8.0  # an earlier request's acceptance is worth at most this many drafts
    plain_steps: int = 4  # plain steps timed before the first drafting round, and at each refresh
    refresh_every: int = 64  # drafting rounds between timings of plain steps ...
    probe_age: int = 4  # ... a probe counting as this many (probes run near break-even, where t(0) matters most)
    default_tokens_left: int = 256  # when the caller does not say how many tokens a request has left
    probing: bool = False  # the last choice was a probe (plain won, drafting was tried to find out)
    recheck: int = 8  # plain steps per choice while plain wins (a choice costs a few percent of a step)
    _measure: int = 0  # plain steps still to take for a timing
    _timings: int = 0  # timings begun while no plain time was known
    _untimed: bool = False  # a timing's stretch went untimed (it traced its graph)
    _positions: PositionCounts | None = None  # this request's acceptance per draft position
    _faded: float = 1.0  # what plain steps left of the evidence (the prior's weight fades alike)
    _last: int | None = None  # depth of the last round (0: a plain step; None: none yet)
    _plain_left: int = 0  # plain steps still to take before choosing again

    def __post_init__(self):
        self._positions = PositionCounts(self.decay)

    @property
    def times(self) -> dict:
        return self.costs.times

    def estimates(self) -> list[tuple[float, float]]:
        """(mean, evidence in drafts) of s_i for draft positions 1..max_depth."""
        remembered = self.memory.prior(self.max_depth, self.prior, self.memory_weight) if self.memory else None
        if remembered is None:
            return self._positions.estimates(self.max_depth, self.prior, self.prior_weight * self._faded)
        priors, weight = remembered  # the memory fades on its own while plain steps run
        return self._positions.estimates(self.max_depth, self.prior, max(weight, self.prior_weight * self._faded),
                                         priors)

    def position_acceptance(self) -> list[float]:
        return [mean for mean, _ in self.estimates()]

    @staticmethod
    def expected_tokens(rates: list[float]) -> list[float]:
        """E(k) for k = 0..len(rates)."""
        out, alive = [1.0], 1.0
        for s in rates:
            alive *= min(s, 0.999)
            out.append(out[-1] + alive)
        return out

    def choose(self, tokens_left: int | None = None) -> int:
        self.probing = False
        if self.max_depth == 0:
            return 0
        if self.fixed:  # below min_acceptance, plain until the first draft may again be kept often enough
            estimates = self.estimates()
            self.probing = estimates[0][0] < self.min_acceptance
            return 0 if _optimistic(*estimates[0]) < self.min_acceptance else self.max_depth
        if self._timing_plain():
            return 0
        if self._plain_left:  # plain won a few steps ago, and what decided it moves slowly
            self._plain_left -= 1
            return 0
        estimates = self.estimates()
        below = estimates[0][0] < self.min_acceptance
        if self.costs.plain is None or not self.costs.drafting_known:  # nothing to compare yet: try one depth
            return min(2, self.max_depth)
        left = max(tokens_left if tokens_left is not None else self.default_tokens_left, 1)
        depths = range(1, min(self.max_depth, max(self.costs.deepest, 1) + 1) + 1)
        cost = {k: self.costs.relative(k) for k in depths}  # t(k), from the line once per choice
        expected = self.expected_tokens([m for m, _ in estimates])
        mean = self._prices(cost, expected, left)
        # Leaving plain steps pays the switch once, spread over the tokens a drafting run may serve.
        switch = self.costs.switch_cost if self._last in (None, 0) else 0.0
        horizon = min(left, self.horizon)
        best = min(mean, key=mean.get)
        if not below and (mean[best] + switch / horizon) * self.margin < 1.0:
            return best
        # Plain wins on what is known: the next choices are made after ``recheck`` plain steps.
        self._plain_left = self.recheck - 1
        if below:
            return 0
        # Probe where finding out may pay over the tokens left.
        cheaper = {k: t * self.costs.optimism() for k, t in cost.items()}
        if min(t / (k + 1) for k, t in cheaper.items()) >= 1.0:  # even perfect drafts lose
            return 0
        optimistic = self._prices(cheaper, self.expected_tokens([_optimistic(m, n) for m, n in estimates]), left)
        net = {}
        for k in depths:
            looked_at = expected[k - 1]  # drafts a round of k looks at, on average
            saving = probe_value(mean[k], optimistic[k], looked_at / (estimates[0][1] + looked_at)) * horizon
            # what the probe round loses against plain steps, at least the margin drafting must promise
            loss = max(cost[k] + switch - expected[k], (self.margin - 1.0) * expected[k])
            net[k] = saving - loss - self.costs.trace_cost(k)
        probe = max(net, key=net.get)
        if net[probe] > 0:
            self.probing, self._plain_left = True, 0
            return probe
        return 0

    def _prices(self, cost: dict, expected: list[float], left: int) -> dict:
        """tau(k): plain steps per token at each depth k of ``cost`` (t(k)), E(k) being ``expected``."""
        # A graph traced now serves the rest of the request and, in a process that has decoded many
        # tokens at these shapes already, likely about as many more.
        serves = max(left, self.costs.decoded)
        return {k: t / expected[k] + self.costs.trace_cost(k) / serves for k, t in cost.items()}

    def _timing_plain(self) -> bool:
        """True while plain steps are being timed: before any drafting round while no plain time is
        known (twice at most: a first stretch that traced its graph went untimed), and again when
        the costs are stale or ``refresh_every`` drafting rounds old."""
        if not self._measure:
            unknown = self.costs.plain is None and (self._timings == 0 or self._untimed) and self._timings < 2
            # Early timings come sooner (after 8, 16, 32 drafting rounds): one stall in the first
            # few steps would otherwise skew every comparison for a long while.
            due = min(self.refresh_every, 8 << self.costs.refreshes)
            if unknown or self.costs.stale or self.costs.plain_age >= due:
                self.costs.refreshes += not unknown
                # Drafting rounds far off their line say the machine's speed moved: the timing
                # replaces the plain step's estimate rather than nudge it.
                self.costs.retiming = self.plain_steps if self.costs.stale else 0
                self._measure = self.plain_steps
                self._timings += unknown
                self._untimed = False
                self.costs.plain_age, self.costs.stale = 0, False  # one controller times them; the others need not
        if self._measure:
            self._measure -= 1
            return True
        return False

    def observe(self, k: int, accepted: list[int], seconds: float | None, traced: bool = False) -> None:
        """After a round of depth k (0: one plain step): accepted drafts per row, and the round's
        wall time per step (None: not timed); ``traced``: the round traced graphs."""
        self.costs.decoded += sum(n + 1 for n in accepted) if k else 1
        if k == 0 and (seconds is None or traced):
            self._untimed = True
        switched, self._last = bool(k) and self._last in (None, 0), k
        if seconds is not None:
            self.costs.observe(k, seconds, traced, switched)
            if k and self.probing:
                self.costs.plain_age += self.probe_age - 1
        elif k:
            self.costs.traced.add(k)
        if k == 0 or not accepted:  # uncertainty grows back while no drafts are seen
            self._positions.fade(self.fade)
            self._faded = max(self._faded * self.fade, 0.05)
            if self.memory is not None:
                self.memory.fade()
            return
        if self.memory is not None:
            self.memory.observe(k, accepted)
        self._positions.observe(k, accepted)
