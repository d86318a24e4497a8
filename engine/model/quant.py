"""Weight-only quantized linear layers for the CPU, holding GGUF's 32-element blocks as stored.

:class:`BlockLinear` keeps per-32-input groups of codes and the file's float16 scales:

* 4-bit (from Q4_0 / Q4_1): the file's codes, unchanged and packed as in the file (byte ``j``
  of a group: element ``j`` low nibble, ``j + 16`` high), ``w = q * d + m``. Q4_1 gives
  ``d, m`` directly; Q4_0 (``w = (q - 8) d``) becomes ``m = -8 d``, exact in float16 while
  ``|d| <= 8188`` (weights within float16's range; a larger scale raises ``ValueError``). ``d``
  and ``m`` stay float16 as the file stores them (4 bytes a group where float32 took 8: 17 %
  fewer bytes for a 4-bit row); the kernel widens a tile's at a time to float32, exactly, so
  nothing is rounded or re-quantized.
* 8-bit (from Q8_0, or ``PD_WEIGHTS=int8`` for any float model, quantized to Q8_0 by
  :func:`engine.model.weights.quantize_float`): int8 codes, ``w = q * d``, the file's codes and scales.

Multiplication: up to :data:`KERNEL_MAX_ROWS` token rows, the AVX2 kernel in
``kernels/cpu/quant_linear.cpp`` (reads each weight byte once for all rows); above it (prefill),
the layer de-quantizes to float32 for that call and uses torch's GEMM, where the compute
dominates. Why not torch's ``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``: on this
AVX2-only EPYC they ran 10-50x slower than a float32 GEMV (vectorized for AVX-512 only), and
``_weight_int8pack_mm`` takes one scale per output row, which cannot hold Q8_0's per-32
scales. The figures are in docs/decisions.md.

The kernel's arithmetic is per layer (:attr:`BlockLinear.int8`, from ``PD_BLOCK_DOT`` through
:func:`resolve_block_dot` and :func:`set_block_dot`): float32 (weights widened exactly, float32
sums), int8 activations (each row of x quantized per 32 inputs, integer dot products:
llama.cpp's q4_1 x q8_1 / q8_0 x q8_0 scheme, an opt-in), bf16 dot products (x and weights
rounded to bf16, the default for a bfloat16 model on AVX512-BF16 without AMX) or the same bf16
roundings with the dot products on AMX tiles (:attr:`BlockLinear.amx`, a bfloat16 model on an AMX
CPU).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from engine.model.gguf import GROUP, QuantTensor
from shared.logging import get_logger

log = get_logger(__name__)

#: Token rows up to which the block kernel runs (measured on the AVX2 EPYC, one thread, vs
#: fp32 GEMV / de-quantize + GEMM: 1 row 1.4-4x faster, 8 rows 1.3-4x, 32 rows 0.6-1.7x,
#: 64 rows 0.8-1.4x, 128 rows 0.4-0.9x), so decode batches up to 64 use it, prefill does not.
KERNEL_MAX_ROWS = 64


@functools.cache
def _kernel():
    """The block kernel's extension, or ``None`` (no AVX2/FMA, or no compiler: the layers then
    de-quantize per call, correct but slower; logged once)."""
    from kernels.cpu import quant

    if not quant.available():
        return None
    try:
        return quant.load()
    except Exception as exc:  # a failed build must not stop serving
        log.warning("quant_kernel_unavailable", error=str(exc))
        return None


#: ``PD_BLOCK_DOT``'s arithmetics of the block kernels (see :func:`resolve_block_dot`).
BLOCK_DOTS = ("float32", "int8", "bf16", "amx")


def resolve_block_dot(setting: str, cpu_flags: str | None = None, dtype: torch.dtype | None = None,
                      vendor: str | None = None) -> str:
    """The block kernels' arithmetic for ``PD_BLOCK_DOT=setting``: one of :data:`BLOCK_DOTS`,
    or ``auto``, which is, measured per CPU kind (docs/decisions.md, "Int8 activations on AVX2"
    and "bf16 dot products timed on AVX512-BF16"):

    * ``float32`` on a CPU without AVX-512 too: ``int8`` there ran the integer dot products at
      1.4-2.2x the float32 loops' GFLOP/s, but on the AVX2 EPYC (2026-12-03) its rounding turned
      SmolLM2's greedy answer to "What is the capital of France?" into another sentence than the
      float32 reference's (``tests/e2e/test_smollm2_reference.py``): exact sums first, ``int8``
      stays an opt-in (``PD_BLOCK_DOT=int8``);
    * ``bf16`` on an AMD CPU with AVX512-BF16 and no AMX when the model computes in bfloat16
      (``dtype``; what ``PD_DTYPE=auto`` picks there). On the AVX-512 EPYC (Zen 4 class) its
      loops run 1.3-2.4x the float32 ones from 4 rows up, and the engine decoded 1.6-1.8x the
      tokens/s at batch 8-64 and prefilled 1.6-2.4x faster, as fast at batch 1. Not on an Intel
      CPU (``vendor`` ``GenuineIntel``) without AMX tiles: on a Xeon of family 6 model 207
      (AVX512-BF16 and -FP16, its AMX hidden by the hypervisor; 2026-12-07) the same loops ran
      0.57-1.03x the float32 ones at 1-64 rows, as on the AMX Xeon (0.58-0.91x), and the engine
      with float32 loops (attention float32 too) prefilled 1.07-1.25x faster at 512 and 2,048
      tokens and decoded 1.16-1.28x faster at batch 1 and 8 (docs/decisions.md, "Intel without
      AMX tiles: float32 block loops"), so ``float32`` there;
    * ``amx`` on an AMX Xeon (``amx_tile`` and ``amx_bf16``; Sapphire Rapids class) when the
      model computes in bfloat16: bf16's roundings with the dot products on AMX tiles. There the
      bf16 register loops ran 0.58-0.91x the float32 ones at 1-128 rows (2026-12-03), while the
      tiles run 4-6x them from 16 rows up (2026-12-05, ``pdserve bench block-kernel``;
      docs/decisions.md, "Block matmuls on AMX tiles");
    * ``float32`` otherwise on AVX-512 (16-lane float32 loops, exact; the int8 loops measured
      slower there from 4 rows up).

    ``cpu_flags``: ``/proc/cpuinfo``'s flags (default: this CPU's). ``dtype``: the model's
    compute dtype (``None``: not bfloat16). ``vendor``: ``/proc/cpuinfo``'s ``vendor_id``
    (default: this CPU's).

    Raises:
        ValueError: an unknown setting.
    """
    if setting in BLOCK_DOTS:
        return setting
    if setting != "auto":
        raise ValueError(f"PD_BLOCK_DOT must be auto or one of {', '.join(BLOCK_DOTS)}, not {setting!r}")
    if cpu_flags is None:
        from kernels.cpu import _cpu_flags

        cpu_flags = _cpu_flags()
    flags = set(cpu_flags.split())
    if not {"avx512f", "avx512bw"} <= flags:
        return "float32"
    if dtype != torch.bfloat16:
        return "float32"
    if {"amx_tile", "amx_bf16"} <= flags:
        return "amx"
    if "avx512_bf16" not in flags or "amx_tile" in flags:
        return "float32"
    if vendor is None:
        from kernels.cpu import _cpu_vendor

        vendor = _cpu_vendor()
    return "float32" if vendor == "GenuineIntel" else "bf16"


def _kernel_has_bf16() -> bool:
    """Whether the block kernel is built with bf16 dot products (AVX512-BF16)."""
    return bool(getattr(_kernel(), "has_bf16", False))


def bf16_dot_available(dtype: torch.dtype) -> bool:
    """Whether ``PD_BLOCK_DOT=bf16`` can apply: a model computing in ``dtype`` bfloat16 and a
    block kernel built with bf16 dot products (AVX512-BF16)."""
    return dtype == torch.bfloat16 and _kernel_has_bf16()


def _kernel_has_amx() -> bool:
    """Whether the block kernel is built with AMX tiles on a CPU and Linux kernel that grant them."""
    return bool(getattr(_kernel(), "has_amx", False))


def amx_dot_available(dtype: torch.dtype) -> bool:
    """Whether ``PD_BLOCK_DOT=amx`` can apply: a model computing in ``dtype`` bfloat16 and a block
    kernel built with AMX tiles on a CPU and Linux kernel that grant them (``has_amx``)."""
    return dtype == torch.bfloat16 and _kernel_has_amx()


def effective_block_dot(setting: str, dtype: torch.dtype, device_type: str = "cpu") -> str:
    """The arithmetic the block kernels use for ``PD_BLOCK_DOT=setting`` in a model computing in
    ``dtype`` on ``device_type``: :func:`resolve_block_dot`, then ``float32`` off the CPU, and
    ``float32`` (with a ``bf16_dot_unavailable`` or ``amx_dot_unavailable`` warning) where
    ``bf16`` or ``amx`` cannot apply (see :func:`bf16_dot_available`, :func:`amx_dot_available`). The engine, the quality gate and the benchmark's labels all
    resolve through here, so they agree.

    Raises:
        ValueError: an unknown setting.
    """
    dot = resolve_block_dot(setting, dtype=dtype)
    if device_type != "cpu":
        return "float32"
    if dot == "bf16" and not bf16_dot_available(dtype):
        log.warning("bf16_dot_unavailable", dtype=str(dtype).removeprefix("torch."), fallback="float32")
        return "float32"
    if dot == "amx" and not amx_dot_available(dtype):
        log.warning("amx_dot_unavailable", dtype=str(dtype).removeprefix("torch."), fallback="float32")
        return "float32"
    return dot


def set_block_dot(model: torch.nn.Module, dot: str) -> int:
    """Set the arithmetic of every :class:`BlockLinear` of ``model`` (one of :data:`BLOCK_DOTS`:
    ``int8`` activations, ``bf16`` dot products, ``amx`` tiles, else float32); returns how many
    layers there are.

    Raises:
        ValueError: ``bf16`` where the block kernel has no bf16 dot products, ``amx`` where it
            has no AMX tiles.
    """
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    if dot == "bf16" and layers and not _kernel_has_bf16():
        raise ValueError("PD_BLOCK_DOT=bf16 needs a CPU with AVX512-BF16 (and the block kernel built)")
    if dot == "amx" and layers and not _kernel_has_amx():
        raise ValueError("PD_BLOCK_DOT=amx needs a CPU with AMX-BF16 tiles granted by the kernel (and the block "
                         "kernel built)")
    for m in layers:
        m.int8 = dot == "int8"
        m.bf16 = dot == "bf16"
        m.amx = dot == "amx"
    return len(layers)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 ``[N, K]`` codes in 0..15 → ``[N, K / 2]`` bytes in GGUF's in-group order."""
    n, k = codes.shape
    g = codes.astype(np.uint8).reshape(n, k // GROUP, 2, GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def _exact_half(values: torch.Tensor, what: str) -> torch.Tensor:
    """``values`` as a contiguous float16 tensor, the same numbers.

    Raises:
        ValueError: some value is not a float16 value (it would be rounded).
    """
    half = values.to(torch.float16).contiguous()
    wide = values.float()
    same = (half.float() == wide) | (wide.isnan() & half.isnan())
    if not bool(same.all()):
        raise ValueError(f"block {what} must be float16 values (as GGUF stores them); "
                         f"{int((~same).sum())} of {same.numel()} would be rounded")
    return half


class BlockLinear(torch.nn.Module):
    """``y = x W^T (+ b)`` with ``W`` in 32-input blocks; see the module docstring.

    Args:
        bits: 4 or 8.
        codes: 4-bit: uint8 ``[out, in / 2]`` packed; 8-bit: int8 ``[out, in]``.
        scale: ``[out, in / 32]`` (``d``); minimum: ``[out, in / 32]`` (``m``, 4-bit only).
            Any float dtype whose values float16 holds exactly (a GGUF file's are float16);
            kept as float16.
        bias: optional float ``[out]``.

    Raises:
        ValueError: a scale or minimum that float16 cannot hold exactly.

    ``int8`` (attribute, default False; :func:`set_block_dot`): the kernel quantizes each row
    of ``x`` per 32 inputs to int8 and takes integer dot products (llama.cpp's q4_1 x q8_1
    scheme, ``PD_BLOCK_DOT=int8``). ``bf16`` (attribute, default False): ``x`` and the weights
    rounded to bf16, bf16 dot products, float32 sums (``PD_BLOCK_DOT=bf16``). ``amx`` (attribute,
    default False): the same roundings, the dot products on AMX tiles (``PD_BLOCK_DOT=amx``). The
    de-quantized float path (rows above :data:`KERNEL_MAX_ROWS`) is unaffected by any of them.
    """

    int8: bool = False
    bf16: bool = False
    amx: bool = False

    def __init__(self, bits: int, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.bits = bits
        self.out_features = codes.shape[0]
        self.in_features = scale.shape[1] * GROUP
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", _exact_half(scale, "scale"))
        self.register_buffer("minimum", _exact_half(minimum, "minimum") if minimum is not None
                             else torch.empty(0, dtype=torch.float16))
        self.bias = bias

    @classmethod
    def from_gguf(cls, t: QuantTensor) -> BlockLinear:
        """From a Q4_0, Q4_1 or Q8_0 tensor, codes and scales as stored."""
        scale = torch.from_numpy(np.ascontiguousarray(t.scale))
        if t.qtype == "Q8_0":
            return cls(8, torch.from_numpy(np.ascontiguousarray(t.codes)), scale, None)
        minimum = -8 * scale if t.minimum is None else torch.from_numpy(np.ascontiguousarray(t.minimum))
        return cls(4, torch.from_numpy(pack_nibbles(t.codes)), scale, minimum)

    def dequantized(self) -> torch.Tensor:
        """float32 ``[out, in]``."""
        ext = _kernel()
        if ext is not None:
            if self.bits == 4:
                return ext.q4_dequantize(self.codes, self.scale, self.minimum)
            return ext.q8_dequantize(self.codes, self.scale, self.minimum)
        if self.bits == 4:
            g = self.codes.reshape(self.out_features, -1, 1, GROUP // 2)
            q = torch.cat([g & 0x0F, g >> 4], dim=2).reshape(self.out_features, -1, GROUP).float()
            w = q * self.scale.float()[..., None] + self.minimum.float()[..., None]
        else:
            w = self.codes.reshape(self.out_features, -1, GROUP).float() * self.scale.float()[..., None]
        return w.reshape(self.out_features, self.in_features)

    def kernel_rows(self, flat: torch.Tensor, ext) -> torch.Tensor:
        """float32 ``[m, in]`` (``m`` ≤ :data:`KERNEL_MAX_ROWS`, CPU) through the block kernel of
        the built extension ``ext``: float32 ``[m, out]``, bias added. Each row's result is the
        same whatever the other rows."""
        kernel = ext.q4_linear if self.bits == 4 else ext.q8_linear
        out = kernel(flat, self.codes, self.scale, self.minimum, bf16=self.bf16, int8=self.int8, amx=self.amx)
        return out + self.bias if self.bias is not None else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        ext = _kernel()
        if ext is not None and flat.shape[0] <= KERNEL_MAX_ROWS and x.device.type == "cpu":
            out = self.kernel_rows(flat, ext)
        else:
            out = torch.nn.functional.linear(flat, self.dequantized(), self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.bits}-bit blocks of {GROUP}"
