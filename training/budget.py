"""When a run stops: its wall-clock budget (--max-time, TimeBudget) and stop signals (StopSignal)."""

import contextlib
import signal
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

RECENT_STEPS = 21  # their median is "a step now": one slow step cannot move it, but a change of pace can
RESERVE_MARGIN = 1.2  # overrunning the limit is worse than one step less, and estimates are rough


class TimeBudget:
    """--max-time: `limit` seconds from `started`, less a reserve for the final eval + save (estimated, then timed)."""

    def __init__(self, limit: float, started: float, final_estimate: Callable[[float], float],
                 clock: Callable[[], float] = time.time) -> None:
        self.limit, self.started, self.loop_started, self.clock = limit, started, started, clock
        self.final_estimate = final_estimate
        self.final_cost: float | None = None
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)

    def begin(self) -> None:
        self.loop_started = self.clock()

    def record(self, step_seconds: float) -> None:
        self.recent.append(step_seconds)

    def record_final(self, seconds: float) -> None:
        self.final_cost = seconds

    def step_time(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0

    def reserve(self) -> float:
        return RESERVE_MARGIN * (self.final_estimate(self.step_time()) if self.final_cost is None else self.final_cost)

    def progress(self) -> float:
        """The share of the training time used, for the lr schedule; it may pass 1."""
        available = self.limit - (self.loop_started - self.started) - self.reserve()
        return (self.clock() - self.loop_started) / max(available, 1e-3)

    def out_of_time(self) -> bool:
        return self.clock() - self.started + self.step_time() + self.reserve() > self.limit


# Each asks the run to stop and keep its work: Ctrl-C, a kill, SLURM's or Grid Engine's warning, a CPU-time limit,
# a closed terminal, or the reader of our output leaving (`| head`). One the run started ignoring (nohup) stays so.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGXCPU, signal.SIGHUP,
                signal.SIGPIPE)


class Stopped(Exception):
    """A stop signal during StopSignal.cut_short's work."""


class StopSignal:
    """A stop signal lets the loop finish its step, save, evaluate and exit, but ends cut_short's work at once.
    With escalate (off under torchrun, which repeats signals), a second Ctrl-C quits at once, or after a save."""

    def __init__(self, escalate: bool) -> None:
        self.name: str | None = None
        self.escalate, self.abrupt, self.hold, self.quit = escalate, False, False, False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:  # Python itself ignores SIGPIPE, so ignoring it was not the user's choice
                if signal.getsignal(sig) is not signal.SIG_IGN or sig == signal.SIGPIPE:
                    self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.abrupt:  # cut_short's caller tells what was stopped
            self.name, self.abrupt = self.name or signal.Signals(signum).name, False
            raise Stopped
        if self.name and self.escalate and signum == signal.SIGINT:
            self.quit = True
            if not self.hold:
                raise KeyboardInterrupt
        elif not self.name:
            self.name = signal.Signals(signum).name
            print(f"\n{self.name}: finishing this step, then save + eval (Ctrl-C again to quit without saving)",
                  file=sys.stderr, flush=True)

    def cut_short(self, work: Callable[[], Any]) -> Any:
        """work(), or None if a stop signal came before it ended: for work whose result is not saved."""
        self.abrupt = True
        try:
            return work()
        except Stopped:
            return None
        finally:
            self.abrupt = False

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """A save: a second Ctrl-C quits after it (torch.save would turn it into a RuntimeError mid-write)."""
        self.hold = True
        try:
            yield
        finally:
            self.hold = False
        if self.quit:
            raise KeyboardInterrupt

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def exit_code(stopped: str) -> int:
    """A shell's exit code for a stop by signal, 128 + its number (a quit is SIGINT's), else 0."""
    name = "SIGINT" if stopped == "quit" else stopped
    return 128 + signal.Signals[name] if name in signal.Signals.__members__ else 0
