"""Reward functions: pure (completion, answers) -> float, built in or installed as plugins.

`answers` is the list of acceptable reference answers of the example. Every built-in is
deterministic and side-effect free. Plugins are functions of the same signature that the platform
team installs on the workers under the entry-point group `grpo_jobs.rewards`.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points

from service.core.reward_specs import PLUGIN_GROUP

RewardFn = Callable[[str, Sequence[str]], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_R1_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def extract_answer(text: str) -> str:
    """The content of the last <answer>...</answer>, or the whole text when there is none.

    >>> extract_answer("<think>2+2</think> <answer> 4 </answer>")
    '4'
    """
    tags = _ANSWER_TAG.findall(text)
    return tags[-1].strip() if tags else text.strip()


def parse_number(text: str) -> float | None:
    """The last number in text, commas removed (GSM8K convention).

    >>> parse_number("She has 1,250 apples, so 1250.")
    1250.0
    """
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def normalize_text(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def numeric_match(completion: str, answers: Sequence[str]) -> float:
    """1.0 when the last number of the (tagged) answer equals a reference number.

    >>> numeric_match("3 + 4 = 7", ["7"])
    1.0
    >>> numeric_match("I think 8", ["7"])
    0.0
    """
    got = parse_number(extract_answer(completion))
    if got is None:
        return 0.0
    for a in answers:
        want = parse_number(a)
        if want is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6):
            return 1.0
    return 0.0


def exact_match(completion: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised answer equals a normalised reference.

    >>> exact_match("The Eiffel Tower.", ["eiffel tower"])
    1.0
    """
    got = normalize_text(extract_answer(completion))
    return float(any(got == normalize_text(a) for a in answers))


def token_f1(completion: str, answers: Sequence[str]) -> float:
    """Best SQuAD token F1 against the references.

    >>> round(token_f1("blue and green", ["green"]), 3)
    0.5
    """
    pred = normalize_text(extract_answer(completion)).split()
    best = 0.0
    for a in answers:
        ref = normalize_text(a).split()
        common = Counter(pred) & Counter(ref)
        overlap = sum(common.values())
        if overlap == 0:
            continue
        p, r = overlap / len(pred), overlap / len(ref)
        best = max(best, 2 * p * r / (p + r))
    return best


@lru_cache(maxsize=1)
def _rouge():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(completion: str, answers: Sequence[str]) -> float:
    """Best ROUGE-L F-measure (rouge-score) against the references.

    >>> rouge_l("the cat sat", ["the cat sat"])
    1.0
    """
    pred = extract_answer(completion)
    return max((_rouge().score(a, pred)["rougeL"].fmeasure for a in answers), default=0.0)


def bleu(completion: str, answers: Sequence[str]) -> float:
    """Sentence BLEU (sacrebleu, exponential smoothing) in [0, 1].

    >>> round(bleu("the cat sat on the mat", ["the cat sat on the mat"]), 6)
    1.0
    """
    import sacrebleu

    pred = extract_answer(completion)
    return min(1.0, sacrebleu.sentence_bleu(pred, list(answers)).score / 100.0)


def r1_format(completion: str, answers: Sequence[str]) -> float:
    """1.0 for the R1-zero format `<think>...</think> <answer>...</answer>`, else 0.

    >>> r1_format("<think>4 eggs</think> <answer>4</answer>", ["4"])
    1.0
    """
    return float(bool(_R1_FORMAT.match(completion)))


def r1_math(completion: str, answers: Sequence[str]) -> float:
    """R1-zero math reward: 1.0 only with the format and a correct answer inside the tags.

    >>> r1_math("<think>2+2</think> <answer>4</answer>", ["4"])
    1.0
    >>> r1_math("4", ["4"])
    0.0
    """
    return float(r1_format(completion, answers) == 1.0 and numeric_match(completion, answers) == 1.0)


def answer_tag_match(completion: str, answers: Sequence[str]) -> float:
    """1.0 when an <answer> tag is present and its number matches (no <think> required).

    >>> answer_tag_match("so <answer>12</answer>", ["12"])
    1.0
    """
    return float(bool(_ANSWER_TAG.search(completion)) and numeric_match(completion, answers) == 1.0)


@dataclass(frozen=True)
class RewardInfo:
    fn: RewardFn
    diagnostics: tuple[str, ...] = ()  # extra rewards logged (not trained on) alongside this one


REGISTRY: dict[str, RewardInfo] = {
    "numeric_match": RewardInfo(numeric_match),
    "exact_match": RewardInfo(exact_match),
    "token_f1": RewardInfo(token_f1),
    "rouge_l": RewardInfo(rouge_l),
    "bleu": RewardInfo(bleu),
    "r1_math": RewardInfo(r1_math, diagnostics=("r1_format",)),  # format credit, reported separately
    "r1_format": RewardInfo(r1_format),
    "answer_tag_match": RewardInfo(answer_tag_match),
}


def lookup(name: str) -> RewardInfo:
    """A built-in, or a plugin loaded from its entry point on first use."""
    if name not in REGISTRY:
        found = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == name]
        if not found:
            raise KeyError(f"reward {name!r} is neither built in nor installed on this worker "
                           f"(entry-point group {PLUGIN_GROUP})")
        REGISTRY[name] = RewardInfo(found[0].load())
    return REGISTRY[name]
