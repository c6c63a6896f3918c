"""The bundled environments' rules, without a server."""

import pytest

from worker.environments.bundled import (
    CalculatorEnvironment,
    GuessNumberEnvironment,
    TextAction,
    calculate,
    word_problem,
)


@pytest.mark.parametrize(("expression", "value"), [("17*3+4", 55), ("(20 - 2) / 4", 4.5), ("-7 // 2", -4)])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(("expression", "why"), [
    ("__import__('os').system('true')", "only numbers"), ("2**99999", "only numbers"), ("1/0", "division by zero"),
    ("9" * 300, "longer than 200"), ("999999*999999*999999", "too large"), ("1 +", "not an arithmetic")])
def test_the_calculator_evaluates_nothing_else(expression, why):
    with pytest.raises(ValueError, match=why):
        calculate(expression)


def test_a_calculator_episode():
    env = CalculatorEnvironment()
    first = env.reset(seed=3)
    problem, answer = word_problem(3)
    assert first.message.startswith(problem) and not first.done
    called = env.step(TextAction(message=f"Let me see. <calc>{answer} + 0</calc>"))
    assert (called.message, called.tool_call, called.done, called.reward) == (f"= {answer}", True, False, 0.0)
    failed = env.step(TextAction(message="<calc>open('/etc/passwd')</calc>"))
    assert failed.tool_error and not failed.done
    assert env.step(TextAction(message="no numbers here")).done is False
    done = env.step(TextAction(message=f"So {answer - 1} + 1 is <answer>{answer}</answer>"))
    assert done.done and done.reward == pytest.approx(1.1)


def test_a_wrong_answer_that_worked_out_the_right_number_earns_half():
    env = CalculatorEnvironment()
    env.reset(seed=3)
    _, answer = word_problem(3)
    assert env.step(TextAction(message=f"It is {answer}, or maybe {answer + 1}")).reward == 0.5


def test_a_guessing_game_rewards_only_guesses_the_feedback_allows():
    env = GuessNumberEnvironment()
    env.reset(seed=11)
    secret = env._secret
    assert 2 < secret < 19
    low = env.step(TextAction(message=f"I guess {secret - 2} first"))  # untagged: the first number
    assert (low.message, low.reward, low.done) == ("higher", 0.1, False)
    assert env.step(TextAction(message=f"<guess>{secret - 2}</guess>")).reward == 0.0  # the same guess again
    assert env.step(TextAction(message="<guess>1</guess>")).reward == 0.0  # ignores `higher`
    assert env.step(TextAction(message="<guess>99</guess>")).reward == 0.0  # out of range
    assert env.step(TextAction(message=f"<guess>{secret + 1}</guess>")).reward == 0.1
    assert env.step(TextAction(message=f"<guess>{secret}</guess>")).done
    again = GuessNumberEnvironment()
    again.reset(seed=11)
    assert again._secret == secret  # the task is the seed's
