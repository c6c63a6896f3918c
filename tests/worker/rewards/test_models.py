"""Model-based rewards and plugins with real components: a sequence classifier built here and served
from a model root, MiniLM similarity, the bundled SmolLM2 as judge, and an installed plugin."""

import sys

import pytest
import torch

from service.core.reward_specs import JudgeReward, RewardModelReward, SimilarityReward
from service.core.settings import Settings
from tests.conftest import install_reward_plugin
from worker.rewards import Item, Scorer, build_scorer
from worker.rewards.models import Judge, RewardModel, Similarity


@pytest.fixture
def classifier_root(tmp_path):
    """A 2-layer BERT classifier with labels bad/good and a character tokenizer, saved under a model root."""
    from transformers import BertConfig, BertForSequenceClassification

    from worker.model.loading import char_tokenizer

    tok = char_tokenizer()
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        num_labels=2, id2label={0: "bad", 1: "good"}, label2id={"bad": 0, "good": 1}, pad_token_id=tok.pad_token_id))
    root = tmp_path / "models"
    model.save_pretrained(root / "team" / "tiny-rm")
    tok.save_pretrained(root / "team" / "tiny-rm")
    return root


ITEMS = [Item("2+2?", "4", ("4",)), Item("Capital of France?", "Paris, of course", ("Paris",)),
         Item("Say hi", "a much longer answer that pads the batch", ("hi",))]


def test_reward_model_scores_the_chosen_output_batched(classifier_root, tmp_path):
    settings = Settings(GRPO_DATA_DIR=tmp_path, GRPO_MODEL_ROOTS=str(classifier_root))
    logit = RewardModel.load(RewardModelReward(name="reward_model", model="team/tiny-rm", target="good"),
                             settings=settings, device="cpu")
    prob = RewardModel.load(RewardModelReward(name="reward_model", model="team/tiny-rm", target=1,
                                              output="probability", batch_size=1), settings=settings, device="cpu")
    got_logit = logit.score(ITEMS, 0).values
    got_prob = prob.score(ITEMS, 0).values
    for it, lg, p in zip(ITEMS, got_logit, got_prob):  # each against the text alone, unpadded
        enc = logit.tokenizer(f"{it.prompt}\n{it.completion}", return_tensors="pt")
        with torch.no_grad():
            out = logit.model(**enc).logits[0]
        assert lg == pytest.approx(float(out[1]), abs=1e-5)
        assert p == pytest.approx(float(torch.softmax(out, -1)[1]), abs=1e-5)
    with pytest.raises(ValueError, match="no label 'great'"):
        RewardModel.load(RewardModelReward(name="reward_model", model="team/tiny-rm", target="great"),
                         settings=settings, device="cpu")


@pytest.mark.slow
def test_similarity_prefers_a_paraphrase(tmp_path):
    sim = Similarity.load(SimilarityReward(name="similarity"), settings=Settings(GRPO_DATA_DIR=tmp_path), device="cpu")
    ref = ("The meeting was moved to Friday afternoon.",)
    items = [Item("", "They pushed the meeting back to Friday after lunch.", ref),
             Item("", "Bananas are rich in potassium.", ref), Item("", ref[0], ref)]
    paraphrase, unrelated, same = sim.score(items, 0).values
    assert same == pytest.approx(1.0, abs=1e-4) and paraphrase > unrelated + 0.3, (paraphrase, unrelated)


@pytest.mark.slow
def test_the_bundled_judge_ranks_right_answers_above_wrong_ones(tmp_path, models_root):
    settings = Settings(GRPO_DATA_DIR=tmp_path, GRPO_MODELS_ROOT=models_root)
    judge = Judge.load(JudgeReward(name="judge"), settings=settings, device="cpu")
    pairs = [("Tom has 3 eggs and gets 4 more. How many eggs does Tom have?", "7", "Tom has 7 eggs.", "Tom has 9 eggs."),
             ("What is the capital of France?", "Paris", "The capital of France is Paris.",
              "The capital of France is Berlin."),
             ("Lena has 10 apples and gives 4 away. How many are left?", "6", "She has 6 apples left.",
              "She has 14 apples left."),
             ("How many legs does a spider have?", "8", "A spider has 8 legs.", "A spider has 6 legs.")]
    items = [Item(q, c, (a,)) for q, a, right, wrong in pairs for c in (right, wrong)]
    v = Scorer([judge]).score(items, step=0).per_fn["judge"]
    assert all(0 < x < 1 for x in v)
    assert all(v[2 * i] > v[2 * i + 1] for i in range(len(pairs))), v


def test_an_installed_plugin_is_named_like_a_builtin(tmp_path, monkeypatch):
    """A tiny package with an entry point in the grpo_jobs.rewards group, installed on the path."""
    from service.core.reward_specs import function_names, plugins
    from service.core.specs import GRPOJob
    from worker.rewards import REGISTRY

    site = tmp_path / "site"
    install_reward_plugin(site, "shout-reward", "shout_reward", "def shouting(completion, answers):\n"
                          "    return sum(c.isupper() for c in completion) / max(1, len(completion))\n", "shouting")
    monkeypatch.syspath_prepend(str(site))
    plugins.cache_clear()
    try:
        assert "shouting" in function_names() and "shout-reward 0.1" in plugins()["shouting"]
        spec = GRPOJob.model_validate({"rewards": [{"name": "shouting", "weight": 2.0}, {"name": "exact_match"}]})
        scorer = build_scorer(spec.reward_specs(), settings=Settings(GRPO_DATA_DIR=tmp_path), device="cpu", job_id=None)
        out = scorer.score([Item("q", "ABcd", ("ABcd",))], step=0)
        assert out.per_fn == {"shouting": [0.5], "exact_match": [1.0]} and out.total == [2.0 * 0.5 + 1.0]
    finally:
        plugins.cache_clear()
        REGISTRY.pop("shouting", None)
        sys.modules.pop("shout_reward", None)
