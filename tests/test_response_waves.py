"""A step's responses reach oMLX's scheduler one token per request at a time, and a request the
host ends by itself (a stop string in its text, a parser's stop) gets no more tokens."""

from __future__ import annotations

from types import SimpleNamespace

from omlx_mtp.hosts.omlx.response_waves import process_in_waves, split_into_waves


class Scheduler:
    """What oMLX's ``_process_batch_responses`` does that matters here: it reads each response as
    the next token of its request, and ends a request whose text reached ``stop_text``."""

    def __init__(self, stop_text: str):
        self.uid_to_request_id = {0: "a", 1: "b", 2: "c"}
        self.stop_text = stop_text
        self.text = {"a": "", "b": "", "c": ""}
        self.calls: list[list[int]] = []

    def _process_batch_responses(self, responses):
        self.calls.append([r.uid for r in responses])
        outputs, finished = [], set()
        for r in responses:
            rid = self.uid_to_request_id[r.uid]
            self.text[rid] += r.token
            done = r.finish_reason is not None or self.stop_text in self.text[rid]
            outputs.append((rid, r.token, done))
            if done:
                finished.add(rid)
        return outputs, finished


def step(tokens: dict[int, str], finish: dict[int, str] | None = None) -> list:
    """One step's responses: every uid's tokens, uid by uid (as an MTP round gives them)."""
    out = []
    for uid, text in tokens.items():
        for i, token in enumerate(text):
            last = i == len(text) - 1
            out.append(SimpleNamespace(uid=uid, token=token, finish_reason=(finish or {}).get(uid) if last else None))
    return out


def test_waves_hold_each_uid_once_in_order():
    responses = step({0: "xyz", 1: "p", 2: "qr"})
    waves = split_into_waves(responses)
    assert [[(r.uid, r.token) for r in w] for w in waves] == [
        [(0, "x"), (1, "p"), (2, "q")], [(0, "y"), (2, "r")], [(0, "z")]]
    assert split_into_waves([]) == []


def test_a_request_the_host_ended_gets_no_more_tokens():
    scheduler = Scheduler(stop_text="ab")
    process_in_waves(scheduler)
    outputs, finished = scheduler._process_batch_responses(step({0: "xabcd", 1: "abq", 2: "pq"}, {2: "length"}))
    assert finished == {"a", "b", "c"}
    assert scheduler.text == {"a": "xab", "b": "ab", "c": "pq"}  # nothing after the stop string
    assert all(len(set(call)) == len(call) for call in scheduler.calls)
    for rid in "abc":  # one finished output per request, its last
        mine = [o for o in outputs if o[0] == rid]
        assert [o[2] for o in mine] == [False] * (len(mine) - 1) + [True]


def test_one_token_per_request_goes_straight_through_and_wrapping_twice_is_once():
    scheduler = Scheduler(stop_text="zz")
    process_in_waves(scheduler)
    process_in_waves(scheduler)
    responses = step({0: "x", 1: "y"})
    assert scheduler._process_batch_responses(responses)[0] == [("a", "x", False), ("b", "y", False)]
    assert scheduler.calls == [[0, 1]]
    assert not hasattr(scheduler._process_batch_responses.__wrapped__, "__wrapped__")  # wrapped once
