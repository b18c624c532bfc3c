"""When a run with a wall-clock limit (--max-time) must stop, and how far through it it is.

    budget = TimeBudget(limit=45.0, started=t_start, final_estimate=lambda step_s: ...)
    budget.begin()                      # the training loop starts: start-up is paid
    progress = budget.progress()        # share of the training time used, for the lr schedule
    budget.record(step_seconds)         # after each step
    if budget.out_of_time(): ...        # the next step plus the final eval + save would overrun
    budget.record_final(seconds)        # an eval + save was timed: use it instead of the estimate

The final eval + save must fit inside the limit, so the budget reserves their cost. Both the
reserve and the next step's cost come from the median of recent step times: a single slow step
(another process took the core for a second) must not make the run believe it is out of time.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

# Steps whose median stands for "a step now": long enough that a few outliers cannot move it,
# short enough to follow a real change of pace (an eval's warm caches, a longer sequence).
RECENT_STEPS = 21
# The reserve is this much more than the estimated final eval + save: estimates are rough
# before the first eval has been timed, and overrunning the limit is worse than one step less.
RESERVE_MARGIN = 1.2


class TimeBudget:
    def __init__(self, limit: float, started: float, final_estimate: Callable[[float], float],
                 clock: Callable[[], float] = time.time) -> None:
        """limit: seconds from `started` (a clock() reading); final_estimate(step_seconds)
        guesses the final eval + save until one has been timed."""
        self.limit, self.started, self.clock = limit, started, clock
        self.final_estimate = final_estimate
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.final_cost: float | None = None  # measured
        self.loop_started = started

    def begin(self) -> None:
        self.loop_started = self.clock()

    def record(self, step_seconds: float) -> None:
        self.recent.append(step_seconds)

    def record_final(self, seconds: float) -> None:
        self.final_cost = seconds

    def step_time(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0

    def reserve(self) -> float:
        final = self.final_cost if self.final_cost is not None else self.final_estimate(self.step_time())
        return RESERVE_MARGIN * final

    def progress(self) -> float:
        """Share of the time available for training steps used so far (may pass 1)."""
        available = self.limit - (self.loop_started - self.started) - self.reserve()
        return (self.clock() - self.loop_started) / max(available, 1e-3)

    def out_of_time(self) -> bool:
        """True when one more step and then the final eval + save would pass the limit."""
        return self.clock() - self.started + self.step_time() + self.reserve() > self.limit
