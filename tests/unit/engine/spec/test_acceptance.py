"""`DraftAcceptance`: the per-position counts a speculation policy decides with."""

from __future__ import annotations

import numpy as np
import pytest

from engine.spec.acceptance import DraftAcceptance


def test_predictions_count_the_same_from_one_array_or_ragged_rows() -> None:
    rows = [[0.9, 0.6, 0.3], [0.7, 0.4, 0.1]]
    whole, ragged = DraftAcceptance(5, 4.0), DraftAcceptance(5, 4.0)
    whole.add_predictions(np.array(rows), [3, 3])
    ragged.add_predictions(rows, [3, 3])
    assert whole.head_means() == pytest.approx(ragged.head_means())
    assert whole.head_means() == pytest.approx([0.8, 0.5, 0.2, 0.5, 0.5])  # 0.5: no prediction yet
    ragged.add_predictions([[0.5]], [1])  # a request with one draft counts at position 1 only
    assert ragged.conf_n == [3, 2, 2, 0, 0]


def test_rates_start_from_the_heads_means_and_move_to_the_outcomes() -> None:
    acc = DraftAcceptance(2, 4.0)
    assert acc.rates() is None and acc.calibration() == [1.0, 1.0]
    acc.add_predictions(np.full((1, 2), 0.8), [2])
    for _ in range(400):  # position 1 accepted one time in four; position 2 never reached
        for accepted in (1, 0, 0, 0):
            acc.add_outcome([0.8, 0.8], 2, accepted)
    rates = acc.rates()
    assert rates is not None and rates[0] == pytest.approx(0.25, abs=0.01)
    assert acc.tries == [1600, 400] and acc.hits == [400, 0]
    assert acc.calibration()[0] == pytest.approx(0.25 / 0.8, abs=0.01)  # the head is over-confident
    acc.decay(0.5)
    assert acc.tries == [800, 200] and acc.rates() == pytest.approx(rates, abs=0.01)
