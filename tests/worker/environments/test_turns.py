"""The token contract of a turn: an episode's ids are its pieces appended, never a re-rendered conversation."""

import pytest

from worker.environments.turns import ChatTurns, PlainTurns, Reply, TemplateRefused, turn_format
from worker.model.loading import char_tokenizer

# ChatML as SmolLM2 and Qwen write it, with this tokenizer's EOS closing a turn
CHATML = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
# A template that keeps only the last model turn's text (as reasoning templates drop earlier thinking)
REWRITES = ("{% for m in messages %}<s>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}</s>\n"
            "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def _tok(template):
    tok = char_tokenizer()
    tok.chat_template = template
    return tok


def test_appended_turns_are_the_rendered_conversation():
    """With a tokenizer that tokenizes text piece by piece alike, the appended ids equal the whole
    conversation rendered and tokenized once: nothing is lost or added at the turn boundaries."""
    tok = _tok(CHATML)
    turns = ChatTurns.of(tok)
    assert turns.close == "</s>\n" and turns.eos_text == "</s>"
    sampled = tok.encode("<calc>2+3</calc>", add_special_tokens=False) + [tok.eos_token_id]  # ended with EOS
    ids = turns.first("Add 2 and 3.") + sampled + turns.between([Reply("= 5")], ended_with_eos=True)
    whole = tok.apply_chat_template([{"role": "user", "content": "Add 2 and 3."},
                                     {"role": "assistant", "content": "<calc>2+3</calc>"},
                                     {"role": "user", "content": "= 5"}], tokenize=False, add_generation_prompt=True)
    assert ids == tok.encode(whole, add_special_tokens=False)


def test_a_turn_cut_before_its_eos_is_closed_by_environment_tokens():
    tok = _tok(CHATML)
    turns = ChatTurns.of(tok)
    closed = turns.between([Reply("= 5")], ended_with_eos=False)
    assert closed[0] == tok.eos_token_id  # the template's close, which the model did not sample
    assert closed[1:] == turns.between([Reply("= 5")], ended_with_eos=True)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    with pytest.raises(TemplateRefused, match="rewrites earlier turns"):
        ChatTurns.of(_tok(REWRITES))


def test_no_template_means_plain_lines():
    tok = char_tokenizer()
    assert isinstance(turn_format(tok, chat=True), PlainTurns)
    assert isinstance(turn_format(_tok(CHATML), chat=False), PlainTurns)
    plain = PlainTurns(tok)
    assert tok.decode(plain.first("Guess.")) == "Guess.\n"
    assert tok.decode(plain.between([Reply("higher")], ended_with_eos=True)) == "\nhigher\n"
