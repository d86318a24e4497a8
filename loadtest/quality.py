"""Quality gate for quantized weights: teacher-forced next-token agreement and perplexity
against the float32 reference of the same model.

Quantized weights cannot be token-identical to a float reference, so they are held to
numbers instead: on a fixed text, both models read the same tokens (teacher forcing); at
every position we compare their most likely next token (top-1 agreement) and each model's
perplexity on the text's actual next tokens.

The models run over the text in chunks of ``chunk`` tokens with transformers' KV cache, so
the quantized layers see decode-sized products (their block kernel, not the de-quantized
float path used for long prefills).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class Quality:
    """``top1_agreement`` in [0, 1]; perplexities are ``exp(mean NLL)`` over ``tokens`` targets."""

    tokens: int
    top1_agreement: float
    ppl_reference: float
    ppl_quantized: float

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_quantized / self.ppl_reference


@torch.inference_mode()
def chunked_logits(model: torch.nn.Module, token_ids: list[int], chunk: int = 16) -> torch.Tensor:
    """float32 ``[len(token_ids), vocab]`` logits, fed ``chunk`` tokens at a time with a KV cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor(token_ids, dtype=torch.long).unsqueeze(0)
    out = []
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start : start + chunk]
        res = model(input_ids=piece, cache=cache, use_cache=True)
        out.append(res.logits[0].float())
    return torch.cat(out)


def compare(reference: torch.nn.Module, quantized: torch.nn.Module, token_ids: list[int], chunk: int = 16) -> Quality:
    """Teacher-forced :class:`Quality` of ``quantized`` against ``reference`` on ``token_ids``
    (at least 2 tokens).

    Raises:
        ValueError: fewer than 2 tokens.
    """
    if len(token_ids) < 2:
        raise ValueError("need at least 2 tokens")
    ref = chunked_logits(reference, token_ids, chunk)[:-1]
    got = chunked_logits(quantized, token_ids, chunk)[:-1]
    target = torch.tensor(token_ids[1:])
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()

    def ppl(logits: torch.Tensor) -> float:
        return math.exp(torch.nn.functional.cross_entropy(logits, target).item())

    return Quality(len(target), agree, ppl(ref), ppl(got))


def quantized_copy(model: torch.nn.Module, mode: str, folder: Path, block_dot: str = "float32",
                   dtype: torch.dtype | None = None, device_type: str = "cpu") -> torch.nn.Module:
    """A deep copy of float ``model`` with ``PD_WEIGHTS=mode`` applied (see :mod:`engine.model.weights`)
    and its block layers multiplying with ``PD_BLOCK_DOT=block_dot`` (see
    :func:`engine.model.quant.resolve_block_dot`; ``int8`` quantizes their inputs too, ``bf16``
    rounds inputs and weights to bf16), resolved as the served engine resolves it
    (:func:`engine.model.quant.effective_block_dot`). ``dtype`` and ``device_type``: what the served
    engine computes in and on (``dtype`` default: ``model``'s); the copy itself stays in
    ``model``'s dtype on the CPU, so the comparison measures the weights and the block
    arithmetic alone."""
    from engine.model.quant import effective_block_dot, set_block_dot
    from engine.model.weights import apply_weights

    clone = copy.deepcopy(model)
    apply_weights(clone, mode, folder, torch.device("cpu"))
    set_block_dot(clone, effective_block_dot(block_dot, dtype or model.get_input_embeddings().weight.dtype,
                                             device_type))
    return clone


def repo_text(max_chars: int = 6000) -> str:
    """A text shipped in the repository (``docs/architecture.md``), for the benchmark's gate."""
    return (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()[:max_chars]
