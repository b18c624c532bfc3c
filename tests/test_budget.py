"""TimeBudget driven by a fake clock: robust to one slow step, and always stops in time."""

import pytest

from training.budget import TimeBudget


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def simulate(step_times, limit=30.0, startup=2.0, eval_steps=30):
    """Run steps of the given durations until the budget says stop; (steps, stop time).
    The final eval + save is estimated, as in training, to cost eval_steps steps."""
    clock = FakeClock()
    budget = TimeBudget(limit, started=clock.now, final_estimate=lambda step_s: eval_steps * step_s, clock=clock)
    clock.now += startup
    budget.begin()
    for n, dt in enumerate(step_times):
        clock.now += dt  # the step runs; the loop asks before starting the next one
        if budget.out_of_time():
            return n + 1, clock.now - budget.started
        budget.record(dt)
    raise AssertionError("ran out of scripted steps")


def test_one_slow_step_does_not_stop_the_run_early():
    steady = [0.1] * 1000
    slow = [0.1] * 50 + [5.0] + [0.1] * 1000  # one step 50x slower: another process took the core
    n_steady, t_steady = simulate(steady)
    n_slow, t_slow = simulate(slow)
    # the slow run loses the 4.9 s the slow step cost, and nothing more
    assert t_slow == pytest.approx(t_steady) and n_slow == n_steady - 49
    # the final eval + save (30 steps = 3 s, reserved 1.2x) and one step still fit in the limit
    assert 30.0 - 1.2 * 3.0 - 0.1 - 1e-9 <= t_steady < 30.0 - 1.2 * 3.0


def test_stops_before_the_limit_when_steps_slow_down_for_good():
    n, t = simulate([0.1] * 100 + [0.5] * 1000, eval_steps=4)  # 5x slower from step 100 on, for good
    assert 100 < n and t + 0.5 + 1.2 * 4 * 0.5 <= 30.0 + 0.5  # stops by the new pace, in time


def test_a_measured_final_cost_replaces_the_estimate():
    clock = FakeClock()
    budget = TimeBudget(10.0, clock.now, final_estimate=lambda s: 100 * s, clock=clock)
    budget.record(0.1)
    assert budget.reserve() > 10  # the estimate alone would stop at once
    budget.record_final(1.0)
    assert budget.reserve() == 1.2 and not budget.out_of_time()


def test_progress_counts_only_the_training_time():
    clock = FakeClock()
    budget = TimeBudget(20.0, clock.now, final_estimate=lambda s: 0.0, clock=clock)
    clock.now += 10.0  # start-up: data, model, compile
    budget.begin()
    clock.now += 5.0
    assert budget.progress() == 0.5  # 5 of the 10 s left for training


def test_progress_leaves_out_the_reserve_for_the_final_eval_and_save():
    clock = FakeClock()
    budget = TimeBudget(20.0, clock.now, final_estimate=lambda step_s: 10 * step_s, clock=clock)
    clock.now += 2.0
    budget.begin()
    budget.record(0.1)  # the final eval + save is estimated at 10 steps: 1 s, reserved 1.2 s
    clock.now += 8.4
    assert budget.reserve() == pytest.approx(1.2)
    assert budget.progress() == pytest.approx(8.4 / (20.0 - 2.0 - 1.2))  # 0.5: the schedule ends before the eval
    budget.record_final(3.0)  # timed: reserve 3.6 s
    assert budget.progress() == pytest.approx(8.4 / (20.0 - 2.0 - 3.6))


def test_the_edges_of_the_budget():
    clock = FakeClock()
    budget = TimeBudget(10.0, clock.now, final_estimate=lambda step_s: 0.0, clock=clock)
    clock.now += 2.5
    assert budget.progress() == 0.25  # before begin(): counted from the start
    budget.record(0.5)
    clock.now += 7.0  # this step would end exactly at the limit: still allowed
    assert not budget.out_of_time()
    clock.now += 0.25
    assert budget.out_of_time()
    late = TimeBudget(1.0, clock.now, final_estimate=lambda step_s: 5.0, clock=clock)
    late.begin()
    clock.now += 0.002
    assert late.progress() == pytest.approx(2.0)  # no time left for training at all: past the end at once
