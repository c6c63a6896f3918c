"""The environments the worker serves itself (`environment.name`), as OpenEnv environments.

Each reads the model's text and answers in text, so any model can play it; each task comes from the
reset seed alone, so a group's episodes play the same task and a run is reproducible.

- `calculator`: a one-step arithmetic word problem. The model may call the calculator, `<calc>17+8</calc>`,
  and is told the result (`= 25`); a turn without a call is its answer (`<answer>25</answer>`, else the last
  number it writes) and ends the episode. Reward 1 for the right answer (0.5 for a wrong one whose turn
  wrote the right number on the way), plus 0.1 for the tag. It is also an MCP tool environment: its
  `calculator` tool (`{"expression": "17+8"}`) answers the same sums to a job with `tools: mcp`.
- `multiplication`: multiply a 3-4 digit number by a 2-3 digit one, which a small model cannot do in its
  head; the same `calculator` tool (MCP, or `<calc>` in text), answered and rewarded as `calculator`.
- `guess-number`: find a number from 1 to 20 (`<guess>N</guess>`, else the first number of the reply), told
  `higher` or `lower` after each guess. A guess the feedback so far still allows earns 0.1 (a repeated
  guess, or one that ignores `higher`, earns nothing), the right one 1.1 and ends the episode.

Both read answers leniently (a small model rarely writes the tags at first) and reward the tags a little,
so a model learns answering first and the format with it.

Observations carry `tool_call` and `tool_error` (a calculator call, one that failed), which the
worker counts per step. Each environment counts its live sessions (SESSIONS: one instance per session,
closed by the server when the session ends), which a bundled server reports at `/sessions`.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from dataclasses import dataclass
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class TextAction(Action):
    message: str = Field(..., max_length=100_000, description="The model's turn, as text.")


class TextObservation(Observation):
    message: str = Field("", description="What the model reads next.")
    tool_call: bool = Field(False, description="The turn called a tool.")
    tool_error: bool = Field(False, description="The tool call failed.")


_CALC = re.compile(r"<calc>(.*?)</calc>", re.S)
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.truediv}


def calculate(expression: str) -> int | float:
    """+ - * / // and parentheses over numbers below a million: nothing else is evaluated."""
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float) and abs(node.value) < 1e6:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv)) and right == 0:
                raise ValueError("division by zero")
            out = _OPS[type(node.op)](left, right)
            if abs(out) > 1e12:
                raise ValueError("the result is too large")
            return out
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    return ev(tree.body)


_NAMES = ("Ada", "Ben", "Chen", "Dana", "Eli", "Fay")
_THINGS = ("apples", "books", "coins", "stamps", "marbles", "shells")
_INT = re.compile(r"-?\d+")


def word_problem(seed: int) -> tuple[str, int]:
    """A one-step arithmetic word problem and its answer, from the seed alone."""
    rng = random.Random(seed)
    who, what = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(10, 40), rng.randint(2, 9)
    if rng.random() < 0.5:
        return f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?", a + b
    return f"{who} has {a} {what} and gives away {b}. How many {what} does {who} have now?", a - b


def final_answer(text: str) -> tuple[int | None, bool]:
    """The answer a turn gives: <answer>N</answer>, else the last whole number it writes; and whether tagged."""
    if (m := _ANSWER.search(text)) is not None:
        return int(m.group(1)), True
    numbers = _INT.findall(text)
    return (int(numbers[-1]), False) if numbers else (None, False)


@dataclass
class SessionCount:
    """Sessions of this server's environment: open now, and the most open at once."""

    open: int = 0
    most: int = 0


SESSIONS = SessionCount()


def multiplication(seed: int) -> tuple[str, int]:
    """A multiplication a small model cannot do in its head, and its product, from the seed alone."""
    rng = random.Random(seed)
    a, b = rng.randint(100, 9999), rng.randint(12, 999)
    return f"What is {a} * {b}?", a * b


class Counted(Environment):
    """An environment that counts itself in SESSIONS from creation to close."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        SESSIONS.open += 1
        SESSIONS.most = max(SESSIONS.most, SESSIONS.open)
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            SESSIONS.open -= 1
        super().close()


def calculator_tools() -> FastMCP:
    """The MCP server of the arithmetic environments: one tool, `calculator`."""
    mcp = FastMCP("calculator")

    @mcp.tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression: numbers, + - * / // and parentheses. Returns the result."""
        value = calculate(expression)  # a ValueError is the tool's error, read back by the model
        return str(int(value) if float(value).is_integer() else round(value, 6))

    return mcp


class CalculatorEnvironment(Counted, MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    INSTRUCTIONS = ("You may use a calculator: write <calc>expression</calc>, for example <calc>12+7</calc>, and "
                    "you will be told the result. Give the answer as <answer>number</answer>.")

    def __init__(self) -> None:
        super().__init__(calculator_tools())
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._answer = 0

    # OpenEnv's Task API (served by openenv 0.10's create_app): tasks by split and index, each split's
    # from seeds of its own
    SPLITS = {"train": (100_000, 0), "test": (1_000, 10**9)}  # split: (tasks, the seed of its first)

    def task(self, seed: int) -> tuple[str, int]:
        problem, answer = word_problem(seed)
        return f"{problem}\n{self.INSTRUCTIONS}", answer

    def list_splits(self) -> list[str]:
        return list(self.SPLITS)

    def num_tasks(self, split: str) -> int:
        if split not in self.SPLITS:
            raise NotImplementedError(f"no split {split!r}")
        return self.SPLITS[split][0]

    def get_task(self, split: str, index: int) -> dict:
        if not 0 <= index < self.num_tasks(split):
            raise IndexError(index)
        return {"id": f"{split}-{index}", "index": index, "prompt": self.task(self.SPLITS[split][1] + index)[0]}

    def reset(self, seed: int | None = None, episode_id: str | None = None, split: str | None = None,
              index: int | None = None, **kwargs) -> TextObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        if split is not None and index is not None:  # a task of a split: its seed, whatever `seed` says
            self.get_task(split, index)
            seed = self.SPLITS[split][1] + index
        problem, self._answer = self.task(seed if seed is not None else random.randrange(2**31))
        return TextObservation(message=problem, reward=None, done=False)

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs) -> TextObservation:
        """A text turn: a `<calc>` call, or the answer (MCP tool calls go to the `calculator` tool)."""
        assert isinstance(action, TextAction)
        self._state.step_count += 1
        text = action.message
        if (m := _CALC.search(text)) is not None:
            try:
                value = calculate(m.group(1))
            except ValueError as exc:
                return TextObservation(message=f"calculator error: {exc}", reward=0.0, tool_call=True, tool_error=True)
            shown = int(value) if float(value).is_integer() else round(value, 6)
            return TextObservation(message=f"= {shown}", reward=0.0, tool_call=True)
        answer, tagged = final_answer(text)
        if answer is None:
            return TextObservation(message="Write <calc>expression</calc>, or the answer as <answer>number</answer>.",
                                   reward=0.0)
        right = answer == self._answer
        # half for a turn that worked the answer out but ended on another number
        worked = not right and str(self._answer) in _INT.findall(text)
        return TextObservation(message="Correct." if right else "Wrong.",
                               reward=float(right) + 0.5 * worked + 0.1 * tagged, done=True)

    @property
    def state(self) -> State:
        return self._state


class MultiplicationEnvironment(CalculatorEnvironment):
    INSTRUCTIONS = "Use the calculator if you need it. Give the answer as <answer>number</answer>."

    def task(self, seed: int) -> tuple[str, int]:
        problem, answer = multiplication(seed)
        return f"{problem}\n{self.INSTRUCTIONS}", answer


class GuessNumberEnvironment(Counted):
    SUPPORTS_CONCURRENT_SESSIONS = True
    HIGH = 20

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret, self._lo, self._hi = 1, 1, self.HIGH

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> TextObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._secret = random.Random(seed).randint(1, self.HIGH)
        self._lo, self._hi = 1, self.HIGH  # what the feedback so far still allows
        return TextObservation(message=f"I am thinking of a number from 1 to {self.HIGH}. Guess it: reply with "
                               "<guess>number</guess>, for example <guess>7</guess>. After each guess I say higher "
                               "or lower.", reward=None)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs) -> TextObservation:  # type: ignore[override]
        self._state.step_count += 1
        m = _GUESS.search(action.message) or _INT.search(action.message)  # the tagged guess, else the first number
        guess = None if m is None else int(m.group(1) if m.re is _GUESS else m.group(0))
        if guess is None or not 1 <= guess <= self.HIGH:
            return TextObservation(message=f"Reply with a number from 1 to {self.HIGH}.", reward=0.0)
        if guess == self._secret:
            return TextObservation(message="Correct!", reward=1.1, done=True)
        # only a guess the feedback so far allows earns anything: repeating one, or ignoring `higher`, does not
        useful = self._lo <= guess <= self._hi
        if guess < self._secret:
            self._lo = max(self._lo, guess + 1)
        else:
            self._hi = min(self._hi, guess - 1)
        return TextObservation(message="higher" if guess < self._secret else "lower", reward=0.1 * useful)

    @property
    def state(self) -> State:
        return self._state


ENVIRONMENTS: dict[str, type[Environment]] = {"calculator": CalculatorEnvironment,
                                              "multiplication": MultiplicationEnvironment,
                                              "guess-number": GuessNumberEnvironment}
