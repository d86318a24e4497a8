"""A Llama forward pass in float64 NumPy straight from a GGUF file's tensors — the independent
reference for the GGUF → Hugging Face conversion (``tests/e2e/test_gguf_conversion.py``).

Nothing here uses transformers or pdserve's loader: tensors are read and de-quantized by the
``gguf`` package, and Q/K are used in the row order the GGUF stores them. llama.cpp's Llama
(``LLAMA_ROPE_TYPE_NORM``, ``ggml_rope`` mode 0) rotates *adjacent* pairs ``(x[2i], x[2i+1])``
of each head by ``pos * base**(-2i/d)``; Hugging Face's Llama rotates the two *halves*
``(x[i], x[i + d/2])`` (``rotate_half``). ``convert_hf_to_gguf.py`` permutes the Q/K rows of
each head so the two agree; computing here with the GGUF's own rotation on its own rows, and
comparing logits with the converted model in transformers, checks that the conversion undid
the permutation (and everything else) correctly. ``rope="halves"`` gives the deliberately
wrong variant (the HF rotation on GGUF rows) so a test can show the comparison would fail.
"""

from __future__ import annotations

import numpy as np


def field(reader, key: str):
    """A scalar or string metadata value of a ``gguf.GGUFReader``."""
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    return value.tobytes().decode() if value.dtype == np.uint8 else value.item()


class GGUFLlama:
    """The Llama model of a GGUF file (``general.architecture == "llama"``), weights
    de-quantized per use to float64 (shape ``[out, in]`` as NumPy sees the GGUF data)."""

    def __init__(self, reader):
        import gguf

        self._dequantize = gguf.quants.dequantize
        self.tensors = {t.name: t for t in reader.tensors}
        self.n_layer = field(reader, "llama.block_count")
        self.n_head = field(reader, "llama.attention.head_count")
        self.n_kv = field(reader, "llama.attention.head_count_kv")
        self.eps = field(reader, "llama.attention.layer_norm_rms_epsilon")
        self.base = field(reader, "llama.rope.freq_base")
        self.n_embd = field(reader, "llama.embedding_length")
        self.head_dim = self.n_embd // self.n_head

    def w(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return self._dequantize(t.data, t.tensor_type).astype(np.float64)

    def rms_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.w(name)

    def rope(self, x: np.ndarray, mode: str) -> np.ndarray:
        """Rotary embedding of ``x`` ``[T, heads, d]`` at positions 0..T-1. ``mode="pairs"``:
        llama.cpp's rotation of adjacent elements (right for GGUF rows); ``"halves"``: HF's
        ``rotate_half`` (wrong for GGUF rows)."""
        t, _, d = x.shape
        inv = self.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
        ang = np.arange(t, dtype=np.float64)[:, None] * inv[None, :]  # [T, d/2]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        if mode == "pairs":
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def logits(self, token_ids: list[int], ropes: tuple[str, ...] = ("pairs",)) -> dict[str, np.ndarray]:
        """Logits ``[T, vocab]`` (float64) of a causal forward over ``token_ids`` (no cache), one
        per rotary mode in ``ropes`` (computed side by side: each weight is de-quantized once)."""
        t, hd, group = len(token_ids), self.head_dim, self.n_head // self.n_kv
        embd = self.w("token_embd.weight")
        xs = {mode: embd[token_ids] for mode in ropes}  # [T, n_embd] each
        mask = np.triu(np.full((t, t), -np.inf), 1)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            wq, wk, wv, wo = (self.w(p + f"attn_{n}.weight").T for n in ("q", "k", "v", "output"))
            wg, wu, wd = (self.w(p + f"ffn_{n}.weight").T for n in ("gate", "up", "down"))
            for mode, x in xs.items():
                h = self.rms_norm(x, p + "attn_norm.weight")
                q = self.rope((h @ wq).reshape(t, self.n_head, hd), mode)
                k = self.rope((h @ wk).reshape(t, self.n_kv, hd), mode)
                v = (h @ wv).reshape(t, self.n_kv, hd)
                k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # GQA: head j reads kv j // group
                scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
                probs = np.exp(scores - scores.max(-1, keepdims=True))
                probs /= probs.sum(-1, keepdims=True)
                x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(t, self.n_embd) @ wo
                h = self.rms_norm(x, p + "ffn_norm.weight")
                gate, up = h @ wg, h @ wu
                xs[mode] = x + (gate / (1 + np.exp(-gate)) * up) @ wd
        head = self.w("output.weight") if "output.weight" in self.tensors else embd  # tied
        return {mode: self.rms_norm(x, "output_norm.weight") @ head.T for mode, x in xs.items()}
