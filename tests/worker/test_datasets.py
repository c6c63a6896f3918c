import json

import pytest

from service.core.datafiles import task_row
from service.core.specs import DatasetSpec
from worker.datasets import Example, arith, jsonl, load_task, render_example, render_prompt
from worker.model.loading import char_tokenizer


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


def test_jsonl_validation_from_its_own_file(tmp_path, settings_factory):
    settings = settings_factory(GRPO_DATASETS_ROOT=tmp_path)
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"prompt": f"t{i}", "answer": i}) for i in range(5)))
    (tmp_path / "v.jsonl").write_text("\n".join(json.dumps({"prompt": f"v{i}", "answer": i}) for i in range(3)))
    train, val = jsonl(DatasetSpec(name="jsonl", path="t.jsonl", val_path="v.jsonl"), settings)
    assert [e.question for e in train] == [f"t{i}" for i in range(5)]  # every training row trains: none held out
    assert [e.question for e in val] == ["v0", "v1", "v2"]
    with pytest.raises(ValueError, match="dataset.num_val would have no effect"):
        DatasetSpec(name="jsonl", path="t.jsonl", val_path="v.jsonl", num_val=2)
    with pytest.raises(ValueError, match="dataset.val_path would have no effect"):
        DatasetSpec(name="arith", val_path="v.jsonl")


def test_instruction_follows_rewards_and_template():
    task = load_task(DatasetSpec(num_train=5, num_val=2), settings=None, reward_names=["r1_math"])
    assert "<answer>" in task.instruction
    text = render_prompt(char_tokenizer(), "What is 2+2?", "Be brief.")
    assert text == "Be brief.\n\nQuestion: What is 2+2?\nAnswer:"


CHAT = {"messages": [{"role": "system", "content": "Answer with a number."},
                     {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                     {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]}


def test_chat_rows_read_as_their_conversation_and_final_answer(tmp_path, settings_factory):
    settings = settings_factory(GRPO_DATASETS_ROOT=tmp_path)
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(CHAT) for _ in range(4)))
    train, _ = jsonl(DatasetSpec(name="jsonl", path="chat.jsonl", num_val=1), settings)
    ex = train[0]
    assert (ex.question, ex.answers) == ("And 3+3?", ("6",))
    assert ex.meta["messages"] == CHAT["messages"][:-1]
    # without a chat template: the turns, then the assistant's cue; the row's own system turn stands
    assert render_example(char_tokenizer(), ex, "Be brief.") == (
        "System: Answer with a number.\nUser: What is 2+2?\nAssistant: 4\nUser: And 3+3?\nAssistant:")


@pytest.mark.parametrize(("row", "error"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, "at least a user and an assistant"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]}, "assistant's turn"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}, "needs a user turn"),
    ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "a"}]}, "messages\\[0\\].role"),
    ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "a"}]}, "non-empty string"),
    ({"messages": [{"role": "user", "content": "q", "name": "x"}, {"role": "assistant", "content": "a"}]},
     "exactly 'role' and 'content'"),
    ({**CHAT, "answer": "6"}, "no other fields: answer"),
])
def test_bad_chat_rows_say_what_is_wrong(row, error):
    with pytest.raises(ValueError, match=error):
        task_row(row)


@pytest.mark.slow
def test_chat_rows_render_with_the_models_chat_template(models_root):
    from service.core.specs import ModelSpec
    from worker.model.loading import load_tokenizer

    tok = load_tokenizer(ModelSpec(name="smollm2-135m-instruct"), models_root=models_root)
    ex = Example("And 3+3?", ("6",), {"messages": CHAT["messages"][:-1]})
    assert render_example(tok, ex, "ignored: the row has its own system turn") == tok.apply_chat_template(
        CHAT["messages"][:-1], add_generation_prompt=True, tokenize=False)
    plain = Example("What is 2+2?", ("4",))
    assert render_example(tok, plain, "Be brief.") == render_prompt(tok, "What is 2+2?", "Be brief.")
