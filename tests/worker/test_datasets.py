import json

import pytest

from service.core.specs import DatasetSpec
from worker.datasets import arith, jsonl, load_task, render_prompt
from worker.models import char_tokenizer


def test_arith_is_seeded_and_splits_are_disjoint():
    spec = DatasetSpec(name="arith", num_train=300, num_val=50, seed=3)
    train, val = arith(spec)
    assert (len(train), len(val)) == (300, 50)
    assert arith(spec) == (train, val)
    assert not {e.question for e in val} & {e.question for e in train}
    for ex in train[:50]:
        assert ex.answers[0].lstrip("-").isdigit()


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_arith_answers_are_correct(difficulty):
    train, _ = arith(DatasetSpec(name="arith", num_train=20, num_val=5, difficulty=difficulty))
    assert all(int(e.answers[0]) >= 0 for e in train)


def test_jsonl_rows_and_errors(tmp_path, settings_factory):
    settings = settings_factory(GRPO_DATASETS_ROOT=tmp_path)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(10)))
    train, val = jsonl(DatasetSpec(name="jsonl", path="d.jsonl", num_val=3), settings)
    assert len(train) == 7 and len(val) == 3
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"prompt": "y", "answer": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl: line 1: needs an 'answer'"):
        jsonl(DatasetSpec(name="jsonl", path="bad.jsonl"), settings)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        jsonl(DatasetSpec(name="jsonl", path="missing.jsonl"), settings)


def test_instruction_follows_rewards_and_template():
    task = load_task(DatasetSpec(num_train=5, num_val=2), settings=None, reward_names=["r1_math"])
    assert "<answer>" in task.instruction
    text = render_prompt(char_tokenizer(), "What is 2+2?", "Be brief.")
    assert text == "Be brief.\n\nQuestion: What is 2+2?\nAnswer:"
