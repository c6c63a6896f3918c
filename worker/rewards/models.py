"""Rewards computed by a model, loaded once per job, frozen, batched on the worker's device:
a sequence classifier (`reward_model`), a generative judge asked a rubric (`judge`), and
sentence-encoder similarity to the reference (`similarity`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.core.reward_specs import JudgeReward, RewardModelReward, SimilarityReward
from service.core.sources import require_model_path
from service.core.specs import ModelSpec
from worker.rewards.functions import parse_number
from worker.rewards.scoring import Item, Scores


def _fill(template: str, it: Item) -> str:
    return template.format(prompt=it.prompt, completion=it.completion, answer=it.answer)


def _chunks(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


@dataclass
class RewardModel:
    """A sequence classifier's chosen output (a logit, or its probability) for prompt + completion."""

    key: str
    weight: float
    spec: RewardModelReward
    model: torch.nn.Module
    tokenizer: object
    target: int
    counts: bool = True

    @classmethod
    def load(cls, spec: RewardModelReward, *, settings, device: str) -> RewardModel:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = require_model_path(spec.model, settings.model_roots, what="reward model", presets=())
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval().requires_grad_(False)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"  # absolute positions and last-token pooling both read right padding correctly
        model.config.pad_token_id = tok.pad_token_id
        target = spec.target
        if isinstance(target, str):
            if target not in model.config.label2id:
                raise ValueError(f"reward model {spec.model!r} has no label {target!r}: its labels are "
                                 f"{', '.join(model.config.label2id)}")
            target = model.config.label2id[target]
        if not 0 <= target < model.config.num_labels:
            raise ValueError(f"reward model {spec.model!r} has {model.config.num_labels} outputs; target {target}")
        return cls(spec.key, spec.weight, spec, model, tok, target)

    def _text(self, it: Item) -> str:
        if self.spec.chat_template and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": it.prompt}, {"role": "assistant", "content": it.completion}],
                tokenize=False)
        return _fill(self.spec.template, it)

    @torch.no_grad()
    def score(self, items: Sequence[Item], step: int) -> Scores:
        device = next(self.model.parameters()).device
        values: list[float | None] = []
        for rows in _chunks(len(items), self.spec.batch_size):
            enc = self.tokenizer([self._text(items[i]) for i in rows], padding=True, truncation=True,
                                 max_length=self.spec.max_length, return_tensors="pt").to(device)
            logits = self.model(**enc).logits.float()  # [b, labels]
            if self.spec.output == "probability":
                probs = torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
                values += probs[:, self.target].tolist()
            else:
                values += logits[:, self.target].tolist()
        return Scores(values)


@dataclass
class Judge:
    """A generative model asked the rubric: P(yes) against P(no) for its first answer token, or the
    number it writes (greedy), mapped from number_range to [0, 1]."""

    key: str
    weight: float
    spec: JudgeReward
    model: torch.nn.Module
    tokenizer: object
    yes_id: int
    no_id: int
    counts: bool = True

    @classmethod
    def load(cls, spec: JudgeReward, *, settings, device: str) -> Judge:
        from worker.model.loading import load_base_model, load_tokenizer

        mspec = ModelSpec(name=spec.model, dtype="float32")  # a judge scores in float32: its rewards do not move with the CPU
        kw = dict(models_root=settings.models_dir, model_roots=settings.model_roots)
        tok = load_tokenizer(mspec, **kw)
        model = load_base_model(mspec, tokenizer=tok, **kw).to(device).eval().requires_grad_(False)
        yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in (spec.yes, spec.no))
        if yes == no:
            raise ValueError(f"judge tokens {spec.yes!r} and {spec.no!r} start with the same token")
        return cls(spec.key, spec.weight, spec, model, tok, yes, no)

    def _prompt(self, it: Item) -> str:
        question = _fill(self.spec.rubric, it)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                      add_generation_prompt=True)
        return question + "\n"

    @torch.no_grad()
    def score(self, items: Sequence[Item], step: int) -> Scores:
        device = next(self.model.parameters()).device
        values: list[float | None] = []
        for rows in _chunks(len(items), self.spec.batch_size):
            enc = self.tokenizer([self._prompt(items[i]) for i in rows], padding=True, add_special_tokens=False,
                                 return_tensors="pt").to(device)  # left-padded: the last position is the next token
            if self.spec.mode == "yes_probability":
                last = self.model(**enc).logits[:, -1, :].float()  # [b, V]
                values += torch.softmax(last[:, [self.yes_id, self.no_id]], dim=-1)[:, 0].tolist()
                continue
            out = self.model.generate(**enc, max_new_tokens=8, do_sample=False, temperature=None, top_p=None,
                                      top_k=None, pad_token_id=self.tokenizer.pad_token_id)
            lo, hi = self.spec.number_range
            for row in out[:, enc["input_ids"].shape[1]:]:
                n = parse_number(self.tokenizer.decode(row, skip_special_tokens=True))
                values.append(None if n is None else min(1.0, max(0.0, (n - lo) / (hi - lo))))
        return Scores(values)


@dataclass
class Similarity:
    """Cosine similarity (mean-pooled sentence embeddings) of the completion to its closest reference."""

    key: str
    weight: float
    spec: SimilarityReward
    encoder: object  # worker.retriever.DualEncoder with one tower
    counts: bool = True

    @classmethod
    def load(cls, spec: SimilarityReward, *, settings, device: str) -> Similarity:
        from worker.retriever import DualEncoder, load_encoder

        model, tok = load_encoder(spec.model, model_roots=settings.model_roots)
        encoder = DualEncoder(model, model, tok, scale=1.0).to(device).eval().requires_grad_(False)
        return cls(spec.key, spec.weight, spec, encoder)

    @torch.no_grad()
    def score(self, items: Sequence[Item], step: int) -> Scores:
        refs = sorted({a for it in items for a in it.answers})
        ref_emb = self.encoder.documents(refs, batch_size=self.spec.batch_size)  # [R, h], unit norm
        ref_row = {a: i for i, a in enumerate(refs)}
        values: list[float | None] = []
        for rows in _chunks(len(items), self.spec.batch_size):
            emb = self.encoder.queries([items[i].completion for i in rows])  # [b, h], unit norm
            for j, i in enumerate(rows):
                own = [ref_row[a] for a in items[i].answers]
                values.append(float((ref_emb[own] @ emb[j]).max()) if own else None)
        return Scores(values)


def build(spec, *, settings, device: str):
    kinds = {"reward_model": RewardModel, "judge": Judge, "similarity": Similarity}
    return kinds[spec.name].load(spec, settings=settings, device=device)
