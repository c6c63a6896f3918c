import math

import pytest
import torch

from tests.numerics import assert_close
from worker.algos.correction import MismatchStats, correct


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def _close(actual, expected):
    assert_close(actual, _t(expected))  # an exp or a product of a few float32 values


# the trainer's old log-probs and the engine's of the same tokens; token 3 of row 0 and row 1's last are padding
OLD = _t([[-1.0, -2.0, -0.5, 0.0], [-0.2, -1.0, -3.0, 0.0]])
ENG = _t([[-1.0, -2.5, -0.2, 7.0], [-0.2, -0.4, -3.1, 7.0]])
MASK = _t([[1, 1, 1, 0], [1, 1, 1, 0]])
# per-token ratios pi_old / q: row 0: 1, e^0.5 = 1.649, e^-0.3 = 0.741; row 1: 1, e^-0.6 = 0.549, e^0.1 = 1.105


def test_token_truncation_caps_each_ratio():
    c = correct(OLD, ENG, MASK, mode="truncated", level="token", cap=1.5)
    _close(c.weights, [[1, 1.5, math.exp(-0.3), 0], [1, math.exp(-0.6), math.exp(0.1), 0]])
    assert c.changed.sum().item() == 1


def test_token_masking_drops_ratios_outside_the_band():
    c = correct(OLD, ENG, MASK, mode="masked", level="token", cap=1.5)  # band [0.667, 1.5]
    _close(c.weights, [[1, 0, math.exp(-0.3), 0], [1, 0, math.exp(0.1), 0]])
    assert c.changed.sum().item() == 2


def test_sequence_level_uses_the_product_of_the_sequences_ratios():
    # row 0: log rho = 0 + 0.5 - 0.3 = 0.2 (1.221); row 1: 0 - 0.6 + 0.1 = -0.5 (0.607)
    c = correct(OLD, ENG, MASK, mode="truncated", level="sequence", cap=1.2)
    _close(c.weights, [[1.2] * 3 + [0], [math.exp(-0.5)] * 3 + [0]])
    c = correct(OLD, ENG, MASK, mode="masked", level="sequence", cap=1.5)
    _close(c.weights, [[math.exp(0.2)] * 3 + [0], [0] * 4])
    assert c.changed.sum().item() == 3  # row 1's three real tokens


def test_none_measures_without_weighting():
    c = correct(OLD, ENG, MASK, mode="none", level="token", cap=2.0)
    assert c.weights is None
    stats = MismatchStats()
    stats.add(c, MASK)
    m = stats.metrics(stats.ratios())
    assert m["mismatch/logp_abs_mean"] == pytest.approx((0 + 0.5 + 0.3 + 0 + 0.6 + 0.1) / 6)
    assert m["mismatch/logp_abs_max"] == pytest.approx(0.6)
    assert m["mismatch/ratio_p50"] == pytest.approx((1 + 1) / 2)
    assert m["correction/changed_fraction"] == 0.0
