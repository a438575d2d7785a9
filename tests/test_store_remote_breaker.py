"""The remote tier's circuit breaker: a state machine against a model, invariants checked
after each step."""

from __future__ import annotations

import threading

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvbackend.store.circuit_breaker import CircuitBreaker

FIRST_S, MAX_S = 0.5, 8.0


class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.breaker = CircuitBreaker(FIRST_S, MAX_S, clock=lambda: self.now)
        self.delay = 0.0  # the model: 0 while closed
        self.next_try = 0.0

    @rule(dt=st.sampled_from([0.0, 0.1, 0.5, 1.0, 4.0, 20.0]))
    def wait(self, dt: float) -> None:
        self.now += dt

    @rule()
    def allow(self) -> None:
        expected = self.delay == 0 or self.now >= self.next_try
        assert self.breaker.allow() is expected
        if self.delay and expected:  # the probe: the others wait another delay
            self.next_try = self.now + self.delay

    @rule()
    def failed(self) -> None:
        assert self.breaker.failed() is (self.delay == 0)  # an outage begins: warn once
        self.delay = FIRST_S if self.delay == 0 else min(MAX_S, 2 * self.delay)
        self.next_try = self.now + self.delay

    @rule()
    def succeeded(self) -> None:
        assert self.breaker.succeeded() is (self.delay > 0)  # an outage ends
        self.delay = 0.0

    @invariant()
    def matches_the_model(self) -> None:
        self.breaker.check_invariants()
        assert self.breaker.closed is (self.delay == 0)
        assert self.breaker.delay_s == self.delay


TestBreaker = BreakerMachine.TestCase


def test_one_probe_per_delay_across_threads():
    now = [0.0]
    breaker = CircuitBreaker(1.0, 4.0, clock=lambda: now[0])
    breaker.failed()
    now[0] = 1.0
    allowed = []
    threads = [threading.Thread(target=lambda: allowed.append(breaker.allow()))
               for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert allowed.count(True) == 1


def test_bad_delays_are_refused():
    with pytest.raises(ValueError, match="0 < first_s <= max_s"):
        CircuitBreaker(0, 1)
    with pytest.raises(ValueError, match="0 < first_s <= max_s"):
        CircuitBreaker(2, 1)
