"""``omlx-mtp timeline``: the time MTP adds or saves against MTP off, split by cause."""

from __future__ import annotations

import json

import pytest

from omlx_mtp.decode.batch import Round
from omlx_mtp.tools.cli import main
from omlx_mtp.tools.timeline import CAUSES, breakdown


def test_each_round_is_priced_against_plain_steps_of_mtp_off():
    plain_step = 0.010  # MTP off: 10 ms per step of a batch of two
    rounds = [
        Round("plain", 0, 4, 2, 8, 0.044, False),  # 4 steps, 1 ms slower each than MTP off's
        Round("draft", 3, 1, 2, 6, 0.020, False),  # 3 tokens per row for 2 steps' time: saves one step
        Round("probe", 1, 1, 2, 2, 0.016, False),  # 1 token per row for 1.6 steps: loses 0.6
        Round("draft", 4, 1, 2, 4, 0.050, True),  # traced: its whole excess is the trace's
    ]
    added = breakdown(0.140, rounds, plain_step)
    assert set(added) == set(CAUSES)
    assert added["plain stretches"] == pytest.approx(0.004)
    assert added["drafting rounds"] == pytest.approx(-0.010)
    assert added["probes"] == pytest.approx(0.006)
    assert added["tracing"] == pytest.approx(0.030)
    assert added["between rounds"] == pytest.approx(0.140 - 0.130)


def test_a_round_right_after_a_plain_stretch_pays_the_switch():
    """What a drafting round following plain steps takes over the usual round of its depth (one
    following another drafting round) is the switch's, not the depth's."""
    plain_step = 0.010
    rounds = [
        Round("draft", 2, 1, 1, 2, 0.015, False),  # the first round: nothing before it
        Round("draft", 2, 1, 1, 2, 0.017, False),  # after a drafting round: usual
        Round("plain", 0, 8, 1, 8, 0.080, False),
        Round("probe", 2, 1, 1, 3, 0.025, False),  # after plain: 8.5 ms over the usual 16.5 ms
        Round("draft", 2, 1, 1, 2, 0.016, False),  # after the probe: usual
        Round("plain", 0, 8, 1, 8, 0.080, False),
        Round("draft", 3, 1, 1, 2, 0.030, False),  # no usual round at depth 3: all of it is the round's
    ]
    added = breakdown(sum(r.seconds for r in rounds), rounds, plain_step)
    assert added["switching from plain"] == pytest.approx(0.0085)
    assert added["probes"] == pytest.approx(0.0165 - 0.030)  # the usual round's time for 3 tokens
    assert added["drafting rounds"] == pytest.approx(0.015 + 0.017 + 0.016 + 0.030 - 4 * 0.020)
    assert added["plain stretches"] == pytest.approx(0.0) and added["between rounds"] == pytest.approx(0.0)


def test_timeline_runs_on_the_demo_pair_and_reports_every_cause(capsys):
    assert main(["timeline", "--repeats", "1", "--max-tokens", "10", "--batch", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["added_share_of_off_time"]) == set(CAUSES) and report["batch"] == 2
    assert report["mtp_over_off"] > 0 and sum(report["rounds_per_run"].values()) > 0


def test_timeline_refuses_a_drafter_without_a_model(capsys):
    assert main(["timeline", "--drafter", "somewhere"]) == 2
    assert "--drafter needs --model" in capsys.readouterr().err
