"""Rewards: what scores a completion. Functions (built in, or plugins under the entry-point group
`grpo_jobs.rewards`) in functions.py; a sequence classifier, an LLM judge and sentence-encoder
similarity in models.py; remote graders over HTTP in remote.py; scoring.py combines weighted
components and turns what cannot be scored into exclusions; build.py makes a job's components. They
import torch, transformers and `service.core`, nothing of the loops or the store."""

from worker.rewards.build import build_scorer
from worker.rewards.functions import (
    REGISTRY,
    RewardFn,
    RewardInfo,
    answer_tag_match,
    bleu,
    exact_match,
    extract_answer,
    lookup,
    normalize_text,
    numeric_match,
    parse_number,
    r1_format,
    r1_math,
    rouge_l,
    token_f1,
)
from worker.rewards.scoring import (
    Component,
    FunctionComponent,
    Item,
    RewardFailure,
    RewardUnavailable,
    Scored,
    Scorer,
    Scores,
    score,
)

__all__ = [
    "REGISTRY", "RewardFn", "RewardInfo", "answer_tag_match", "bleu", "exact_match", "extract_answer", "lookup",
    "normalize_text", "numeric_match", "parse_number", "r1_format", "r1_math", "rouge_l", "token_f1",
    "Component", "FunctionComponent", "Item", "RewardFailure", "RewardUnavailable", "Scored", "Scorer", "Scores",
    "build_scorer", "score",
]
