"""The remote tier's circuit breaker: a state machine against a model, invariants checked
after each step; its health probe (the thread that alone probes while the breaker is open)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvbackend.store.circuit_breaker import CircuitBreaker
from kvbackend.store.health_probe import HealthProbe

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
        assert self.breaker.seconds_to_try() == (max(0.0, self.next_try - self.now)
                                                 if self.delay else 0.0)


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


class Service:
    """A service whose health checks answer as ``answers`` says (then always True)."""

    def __init__(self, breaker: CircuitBreaker, answers: list[bool]) -> None:
        self.breaker, self.answers = breaker, list(answers)
        self.delays: list[float] = []  # the breaker's delay at each health check
        self.back = threading.Event()

    def ping(self) -> bool:
        self.delays.append(self.breaker.delay_s)
        return self.answers.pop(0) if self.answers else True


def test_the_probe_thread_alone_checks_until_the_service_answers():
    breaker = CircuitBreaker(0.01, 0.02)
    service = Service(breaker, [False, False, False])
    probe = HealthProbe(breaker, service.ping, service.back.set, "test-probe")
    assert probe.failed() is True and not breaker.closed
    probe.check_invariants()
    assert service.back.wait(30)
    assert service.delays == [0.01, 0.02, 0.02, 0.02]  # doubled up to the maximum
    assert breaker.closed
    probe.check_invariants()
    service.back.clear()
    assert probe.failed() is True  # a new outage: a new probe thread
    probe.check_invariants()
    assert service.back.wait(30) and breaker.closed


def test_stop_ends_the_probing_and_closes_the_breaker():
    breaker = CircuitBreaker(0.01, 0.01)
    service = Service(breaker, [False] * 10**6)
    probe = HealthProbe(breaker, service.ping, service.back.set, "test-probe")
    probe.failed()
    probe.stop()
    assert breaker.closed and not service.back.is_set()
    probe.check_invariants()


def test_an_open_breaker_without_a_probe_breaks_the_invariant():
    breaker = CircuitBreaker(1.0, 1.0)
    probe = HealthProbe(breaker, lambda: True, lambda: None, "test-probe")
    breaker.failed()  # not through the probe: nothing would ever close it
    with pytest.raises(RuntimeError, match="no probe running"):
        probe.check_invariants()
