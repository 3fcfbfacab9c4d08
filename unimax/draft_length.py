"""How many tokens a verified block drafts: the length with the most tokens per millisecond, from
the running acceptance and the measured cost of every block length.

A block of k drafts emits the agreeing prefix and one exact token. If each draft agrees with
probability a (given the ones before it did), it emits E(k) = 1 + a + ... + a^k tokens on
average and costs draft(k) + verify(k) + (1 - a^k) * rewind (+ a host cost per block, shared
by an exact run's steps for k = 0): the policy picks k in 0..k_max maximising E(k) / cost(k).
k = 0 is an exact step through the verifier, so when the drafts are poor verified mode runs at
about BF16-only speed instead of below it; when they are good it drafts the longest block that
pays.

The acceptance is estimated from every block's outcome: a block that accepted m of k drafts checked
m + 1 positions (m if m == k) and saw m agree. Counts decay per position checked, so the estimate
follows the last few dozen drafts; a prior of a few positions starts it optimistic and keeps it
below 1. Optimistic enough that the first block drafts (0.9: at the H200's 4B costs the first
blocks draft 3-8; from 0.8 they were exact steps until the first probe, 32 blocks in, which in a
simulated 256-token reply at acceptance 0.96 cost 7% of its speed; at low acceptance 0.9 costs
~1.5%, the one wasted block). A run of k = 0 blocks learns nothing, so every ``probe_every``-th of
them drafts a probe of ``probe_length`` tokens instead; a probe accepted in full is followed at
once by one twice as long, so drafts that got good are back in use a few blocks later. A probe
that fails doubles the run of k = 0 blocks before the next (up to ``probe_every_max``; back to
``probe_every`` once the policy drafts of its own accord), so drafts that stay poor cost ever
fewer probe chains: at the H200's Qwen3.5-0.8B costs, simulated, 0.897 -> 0.949x BF16-only at
acceptance 0.8 and 0.931 -> 0.941 at 0.95, the 4B costs' rows within 0.4%. The price: drafts
that turn good after a long poor stretch are found up to probe_every_max exact steps later, not
32 (simulated with acceptance alternating between 0.6 and 1.0 every 200 tokens, still a gain:
0.972 -> 0.981; bench/RESULTS.md). Measured on the engine (Qwen3.5-0.8B
shape, forced acceptance): 0.93 -> 0.98x at 0.95, 0.96-0.97x at 0.5-0.9.

The costs come from the engine's captured graphs (GraphRunner.replay_ms); without them (no CUDA
graphs, or before capture) the policy is not calibrated and every block drafts k_max. A reply held
to a grammar adds the host's turn per draft (each draft's mask is filled after the draft before
it): its blocks pass ``extra``, the host time a block of k adds to its graphs' (unimax.held.
HostTurns, learned from the reply's own blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftLength:
    k_max: int
    prior: float = 0.9  # acceptance assumed before any block ran
    prior_positions: float = 2.0
    decay: float = 0.95  # per position checked (at least one per block): a memory of ~20
    # (0.98 / 0.99 simulated at the H200's 4B costs: +0.5-2% where the acceptance holds still,
    # -5-8% where it moves between 0.6 and 1.0 every 200 tokens; bench/RESULTS.md, fiftieth)
    probe_every: int = 32  # k = 0 blocks in a row before a probe (after a failed one: more)
    probe_every_max: int = 256  # the interval's cap as failed probes double it
    probe_length: int = 1  # the first probe block's drafts; doubled while probes pass
    host_ms: float = 0.1  # per block: the host sync and bookkeeping
    draft_ms: dict[int, float] = field(default_factory=dict)  # k -> a block of k draft steps
    verify_ms: dict[int, float] = field(default_factory=dict)  # k -> verifying k drafts
    rewind_ms: float = 0.0
    agreed: float = 0.0
    checked: float = 0.0
    zero_run: int = 0
    probe: int = 0  # the draft length of the probe block now running (0: none)
    next_probe: int = 0  # a passed probe's doubled length, tried on the next block
    probe_gap: int = 0  # the k = 0 blocks before the next probe (0: probe_every)

    def __post_init__(self):
        if not isinstance(self.k_max, int) or self.k_max < 1:
            raise ValueError(f"k_max must be an integer >= 1, got {self.k_max!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
        if not 1 <= self.probe_every <= self.probe_every_max:
            raise ValueError(f"probe_every must be in 1..probe_every_max "
                             f"({self.probe_every_max}), got {self.probe_every!r}")

    @property
    def gap(self) -> int:
        """The k = 0 blocks in a row before the next probe: probe_every, doubled by every
        failed probe up to probe_every_max, back to probe_every once the policy drafts of
        its own accord."""
        return self.probe_gap or self.probe_every

    @property
    def calibrated(self) -> bool:
        return all(k in self.verify_ms for k in range(self.k_max + 1)) and all(
            k in self.draft_ms for k in range(1, self.k_max + 1))

    def calibrate(self, draft_ms: dict[int, float], verify_ms: dict[int, float],
                  rewind_ms: float) -> None:
        self.draft_ms = {0: 0.0, **draft_ms}
        self.verify_ms = dict(verify_ms)
        self.rewind_ms = rewind_ms

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft agrees, given the drafts before it did."""
        return ((self.agreed + self.prior * self.prior_positions)
                / (self.checked + self.prior_positions))

    def expected_tokens(self, k: int, a: float | None = None) -> float:
        a = self.acceptance if a is None else a
        return sum(a ** i for i in range(k + 1))

    def expected_ms(self, k: int, a: float | None = None, extra=None) -> float:
        """A block of k drafts' expected time; for k = 0 one exact step's. k = 0 runs as exact
        runs (``exact_run``: up to k_max steps in one graph, one host sync), so its step pays
        a share of the host's cost, not all of it. Charged whole, it tipped the model's choice
        to drafting where exact steps were faster (H200, gdn24-0.8b:
        host 0.1 ms on a 0.756 ms step; at acceptance 0.95 the model put 4 drafts at 0.840 ms
        a token against exact runs' 0.768). In bench/draft_policy.py's simulation that choice
        was not what held the policy at ~0.93x there (0.929 -> 0.931 with this): the probes'
        doubling chains are, see docs/design.md. ``extra(k)``: ms a block of k adds beyond
        the graphs' and this host cost (a held reply's host turns; k = 0: one exact step's)."""
        a = self.acceptance if a is None else a
        host = self.host_ms if k else self.host_ms / min(self.k_max, self.probe_every)
        host += 0.0 if extra is None else extra(k)
        return self.draft_ms[k] + self.verify_ms[k] + (1.0 - a ** k) * self.rewind_ms + host

    def best(self, limit: int, a: float | None = None, extra=None) -> int:
        """The k in 0..limit with the most expected tokens per millisecond."""
        return max(range(limit + 1),
                   key=lambda k: self.expected_tokens(k, a) / self.expected_ms(k, a, extra))

    def choose(self, remaining: int, extra=None) -> int:
        """The next block's draft length; ``remaining`` tokens are left to emit (a block emits
        at most k + 1). ``extra``: as in ``expected_ms``."""
        limit = max(0, min(self.k_max, remaining - 1))
        self.probe = 0
        if not self.calibrated:
            return limit
        if limit == 0:  # (no choice: the last token; the run of exact steps goes on)
            return 0
        k = self.best(limit, extra=extra)
        if k > 0:
            self.zero_run = self.next_probe = self.probe_gap = 0
            return k
        if self.next_probe:
            self.probe = min(self.next_probe, limit)
        else:
            self.zero_run += 1
            if self.zero_run >= self.gap:
                self.zero_run = 0
                self.probe = min(self.probe_length, limit)
        return self.probe

    def exact_run(self, limit: int) -> int:
        """After ``choose`` gave 0 and no probe: how many exact steps may run back to back as
        one block (one graph, one host sync: the engine's exact run) before the next probe is
        due, at most ``limit``. They count as that many k = 0 choices; observe each."""
        if self.probe or not self.calibrated:
            return 1
        n = max(1, min(limit, self.gap - self.zero_run))
        self.zero_run += n - 1
        return n

    def forget(self) -> None:
        """Back to the prior (the costs stay)."""
        self.agreed = self.checked = 0.0
        self.zero_run = self.probe = self.next_probe = self.probe_gap = 0

    def observe(self, k: int, accepted: int) -> None:
        """A block drafted k tokens and the verifier kept the first ``accepted``."""
        if not 0 <= accepted <= k:
            raise ValueError(f"accepted must be in 0..{k}, got {accepted}")
        if self.probe:
            self.next_probe = min(2 * k, self.k_max) if accepted == k else 0
            if accepted < k:  # still poor: wait twice as long for the next probe
                self.probe_gap = min(2 * self.gap, self.probe_every_max)
            self.probe = 0
        positions = accepted + (accepted < k)
        keep = self.decay ** max(positions, 1)
        self.agreed = self.agreed * keep + accepted
        self.checked = self.checked * keep + positions
