"""A GGUF file's quantized tensors, read as they are stored, under Hugging Face Llama names.

``gguf``'s :class:`~gguf.GGUFReader` gives each tensor's type, its shape and its raw block
bytes (``[rows, bytes_per_row]`` uint8 for the block types). This module splits the blocks
into their 4- or 8-bit codes and per-32-element scales, without de-quantizing:

* ``Q4_0`` block (18 bytes): ``d`` (fp16), 16 bytes of codes; ``w = (q - 8) * d``.
* ``Q4_1`` block (20 bytes): ``d``, ``m`` (fp16), 16 bytes of codes; ``w = q * d + m``.
* ``Q8_0`` block (34 bytes): ``d`` (fp16), 32 int8 codes; ``w = q * d``.

In a 4-bit block, byte ``j`` holds element ``j`` in its low nibble and element ``j + 16`` in
its high nibble (ggml's ``dequantize_row_q4_0`` / ``q4_1``, mirrored by ``gguf.quants``).

llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` (its ``permute`` in
``convert_hf_to_gguf.py``, rotary halves interleaved); transformers' GGUF loader undoes it
(``_reverse_permute_weights``). It is a permutation of rows, and the 32-element blocks run
along a row (the input dimension), so the codes and scales move with their rows unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: GGUF tensor name → transformers Llama module name (``{i}`` = layer index).
_NAMES = {
    "token_embd": "model.embed_tokens",
    "output": "lm_head",
    "output_norm": "model.norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
#: block types kept quantized; everything else (F32, F16, Q6_K, ...) stays float
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
GROUP = 32


@dataclass(slots=True)
class QuantTensor:
    """One quantized weight, ``[out_features, in_features]`` in transformers' orientation.

    ``codes``: uint8 ``[out, in]`` in 0..15 (Q4_0/Q4_1) or int8 ``[out, in]`` (Q8_0).
    ``scale``: float32 ``[out, in // 32]``, the blocks' ``d`` (fp16 → fp32 is exact).
    ``minimum``: float32 ``[out, in // 32]``, Q4_1's ``m``; ``None`` for Q4_0 and Q8_0.
    """

    qtype: str
    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> np.ndarray:
        """float32 ``[out, in]`` values (for tests and the float fallback)."""
        out, cols = self.codes.shape
        q = self.codes.astype(np.float32).reshape(out, cols // GROUP, GROUP)
        if self.qtype == "Q4_0":
            q = q - 8
        w = q * self.scale[..., None]
        if self.minimum is not None:
            w = w + self.minimum[..., None]
        return w.reshape(out, cols)


def hf_name(gguf_name: str) -> str | None:
    """The transformers parameter name of a GGUF Llama tensor, or ``None`` when unknown."""
    m = _BLOCK.match(gguf_name)
    if m:
        module = _NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{module}.weight" if module else None
    base = gguf_name.removesuffix(".weight")
    return f"{_NAMES[base]}.weight" if base in _NAMES and gguf_name.endswith(".weight") else None


def split_blocks(qtype: str, raw: np.ndarray) -> QuantTensor:
    """Codes and scales of ``raw`` (uint8 ``[rows, bytes_per_row]`` of ``qtype`` blocks).

    Raises:
        ValueError: ``qtype`` is not one of :data:`QUANT_TYPES`.
    """
    rows = raw.shape[0]
    if qtype == "Q8_0":
        blocks = raw.reshape(rows, -1, 34)
        scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return QuantTensor(qtype, codes, scale, None)
    if qtype not in ("Q4_0", "Q4_1"):
        raise ValueError(f"unsupported quantization type {qtype}")
    head = 2 if qtype == "Q4_0" else 4
    blocks = raw.reshape(rows, -1, head + 16)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if head == 4 else None
    qs = blocks[..., head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
    return QuantTensor(qtype, codes, scale, minimum)


def unpermute_rows(num_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation: ``new[i] = old[order[i]]``
    (the same index map as transformers' ``_reverse_permute_weights``)."""
    dim = num_rows // n_head // 2
    return np.arange(num_rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(num_rows)


def _take_rows(t: QuantTensor, order: np.ndarray) -> QuantTensor:
    minimum = None if t.minimum is None else t.minimum[order]
    return QuantTensor(t.qtype, t.codes[order], t.scale[order], minimum)


def read_quantized(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, QuantTensor]:
    """The Q4_0/Q4_1/Q8_0 tensors of the GGUF file at ``path``, by transformers name, with
    the Q/K rows in transformers' order. Tensors of other types are left out (the float
    model already holds them).

    Raises:
        OSError / ValueError: the file cannot be read as GGUF.
    """
    from gguf import GGUFReader

    reader = GGUFReader(path)
    out: dict[str, QuantTensor] = {}
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        name = hf_name(tensor.name)
        if qtype not in QUANT_TYPES or name is None:
            continue
        t = split_blocks(qtype, np.asarray(tensor.data))
        if ".attn_q." in tensor.name:
            t = _take_rows(t, unpermute_rows(t.shape[0], num_heads))
        elif ".attn_k." in tensor.name:
            t = _take_rows(t, unpermute_rows(t.shape[0], num_kv_heads))
        out[name] = t
    return out
