import doctest
import math

import pytest

from service.core import specs
from worker import rewards as R


def test_registry_matches_the_spec_contract():
    assert set(R.REGISTRY) == set(specs.REWARDS)


def test_docstring_examples():
    assert doctest.testmod(R).failed == 0


@pytest.mark.parametrize("completion,answers,want", [
    ("The answer is 1,234.", ["1234"], 1.0),
    ("12 + 7 = 19", ["19"], 1.0),
    ("-3", ["-3"], 1.0),
    ("nothing numeric", ["3"], 0.0),
    ("<answer>5</answer> and later 7", ["5"], 1.0),  # the tagged answer wins
])
def test_numeric_match(completion, answers, want):
    assert R.numeric_match(completion, answers) == want


def test_r1_format_credit_is_separate():
    good = "<think>16 - 3 = 13</think>\n<answer>13</answer>"
    assert R.r1_math(good, ["13"]) == 1.0 and R.r1_format(good, ["13"]) == 1.0
    wrong = "<think>guess</think> <answer>12</answer>"
    assert R.r1_math(wrong, ["13"]) == 0.0 and R.r1_format(wrong, ["13"]) == 1.0
    assert R.r1_math("13", ["13"]) == 0.0 and R.r1_format("13", ["13"]) == 0.0


def test_text_rewards():
    assert R.exact_match("Paris!", ["paris"]) == 1.0
    assert R.token_f1("the red big car", ["red car"]) == pytest.approx(0.8)
    assert R.rouge_l("a b c d", ["a b x d"]) == pytest.approx(0.75)
    assert 0.0 < R.bleu("the cat sat on a mat", ["the cat sat on the mat"]) < 1.0


def test_score_weights_and_failures(monkeypatch):
    def boom(c, a):
        if c == "bad":
            raise RuntimeError("cannot parse")
        return 1.0

    monkeypatch.setitem(R.REGISTRY, "boom", R.RewardInfo(boom))
    out = R.score(["7", "bad"], [["7"], ["7"]], {"numeric_match": 2.0, "boom": 0.5})
    assert out.total[0] == 2.5
    assert math.isnan(out.total[1])
    assert out.failures == [R.RewardFailure(1, "boom", "RuntimeError: cannot parse")]
    out = R.score(["<think>x</think><answer>7</answer>"], [["7"]], {"r1_math": 1.0})
    assert out.per_fn["r1_format"] == [1.0] and out.total == [1.0]
