"""Choosing how the model's linear layers hold their weights (``PD_WEIGHTS``).

* ``float``: the dtype's float matrices (what the exactness tests use).
* ``auto``: as stored in the source file. A folder converted from a GGUF file (its marker
  names the file) gets the file's Q4_0/Q4_1/Q8_0 tensors as :class:`~engine.model.quant.BlockLinear`
  (codes and scales as stored); a float folder stays float.
* ``int8``: every linear layer quantized to Q8_0 blocks (8 bits per weight, one scale per
  32 inputs) by the ``gguf`` package's quantizer, from the float weights (any HF model).

Embeddings stay float (a lookup reads one row per token); norms and other small tensors too.
Quantized layers run on the CPU only; on CUDA every setting means float, and ``auto`` means
float on a CPU where the block kernel is unavailable (no AVX2/FMA or no compiler).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.model.quant import BlockLinear, _kernel
from shared.logging import get_logger
from shared.model_files import COMPLETE_MARKER, ModelNotAvailable, default_gguf_path

log = get_logger(__name__)

WEIGHT_MODES = ("auto", "float", "int8")


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file ``folder`` was converted from (its conversion marker), if it still exists.

    The marker records the path in the environment that converted it; the converted folder is
    shared by every checkout and venv (``PD_CACHE_DIR``), so when that path is gone the same
    file from this environment's model wheel is used."""
    marker = Path(folder) / COMPLETE_MARKER
    try:
        source = json.loads(marker.read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    if not source:
        return None
    if Path(source).exists():
        return Path(source)
    try:
        here = default_gguf_path()
    except ModelNotAvailable:
        return None
    return here if here.name == Path(source).name and here.exists() else None


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quantize_from_gguf(model: torch.nn.Module, path: Path) -> dict[str, int]:
    """Replace the linear layers of ``model`` whose GGUF tensors are quantized.

    A tied LM head (no ``output.weight`` in the file) takes ``token_embd``'s tensor.
    Returns counts per kind (``int4``, ``int8``).

    Raises:
        ValueError: a tensor's shape differs from the model's layer.
    """
    from engine.model.gguf import read_quantized

    config = model.config
    tensors = read_quantized(path, config.num_attention_heads, config.num_key_value_heads)
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    counts = {"int4": 0, "int8": 0}
    for name, module in list(model.named_modules()):
        t = tensors.get(f"{name}.weight")
        if t is None or not isinstance(module, torch.nn.Linear):
            continue
        if t.shape != tuple(module.weight.shape):
            raise ValueError(f"{name}: GGUF tensor {t.shape} vs layer {tuple(module.weight.shape)}")
        layer = BlockLinear.from_gguf(t)
        if module.bias is not None:
            layer.bias = module.bias.detach().float()
        _set_module(model, name, layer)
        counts["int4" if layer.bits == 4 else "int8"] += 1
    return counts


def quantize_float(model: torch.nn.Module, qtype: str = "Q8_0") -> dict[str, int]:
    """Quantize every ``nn.Linear`` of float ``model`` (input size a multiple of 32) into GGUF
    blocks of ``qtype`` with the ``gguf`` package's own quantizer (ggml's rules: Q8_0
    ``d = max|w| / 127`` per 32 inputs), then serve them as :class:`BlockLinear` like a
    GGUF file's tensors. ``PD_WEIGHTS=int8`` is ``Q8_0``; tests also use ``Q4_1``.
    Returns counts per kind."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from engine.model.gguf import split_blocks

    counts = {"int4": 0, "int8": 0}
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and module.in_features % 32 == 0:
            raw = quantize(module.weight.detach().float().numpy(), GGMLQuantizationType[qtype])
            layer = BlockLinear.from_gguf(split_blocks(qtype, raw))
            layer.bias = None if module.bias is None else module.bias.detach().float()
            _set_module(model, name, layer)
            counts["int4" if layer.bits == 4 else "int8"] += 1
    return counts


def apply_weights(model: torch.nn.Module, mode: str, folder: Path, device: torch.device) -> dict[str, int]:
    """Apply ``PD_WEIGHTS=mode`` to the loaded float ``model`` from ``folder``; returns the
    counts of replaced layers (all zero when the weights stay float).

    Raises:
        ValueError: unknown mode.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"PD_WEIGHTS must be one of {WEIGHT_MODES}, not {mode!r}")
    none = {"int4": 0, "int8": 0}
    if mode == "float" or device.type != "cpu":
        return none
    if mode == "auto" and _kernel() is None:
        log.warning("weights_stay_float", reason="no block kernel on this CPU; de-quantizing per call would be slower")
        return none
    if mode == "int8":
        counts = quantize_float(model, "Q8_0")
    else:
        source = gguf_source(folder)
        counts = quantize_from_gguf(model, source) if source is not None else none
    if any(counts.values()):
        log.info("weights_quantized", mode=mode, **counts)
    return counts
