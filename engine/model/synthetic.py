"""Models with a published architecture and seeded random weights, for measuring step costs
where the real weights cannot be had (a lent GPU machine reaches no model hub, and what a call
carries is capped far below a 7B checkpoint). A step's time depends on the shapes only; what
such a model says is noise, so nothing that checks outputs against a reference may use it
except against the same random weights (``pdserve bench gpu``'s greedy check does that).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

#: Llama-family shapes by name: each is the ``LlamaConfig`` of the published checkpoint's
#: ``config.json`` (HuggingFaceTB/SmolLM2-135M-Instruct; meta-llama/Llama-2-7b-hf).
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=4096,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2),
}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def synthetic_model(folder: Path, shape: str = "smollm2-135m", *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", initializer_range: float = 0.1, seed: int = 0,
                    tokenizer_from: Path | None = None) -> Path:
    """Write a Hugging Face folder (config.json, safetensors) of ``shape`` with weights drawn
    from N(0, ``initializer_range``²) under ``seed``, stored in ``dtype``; return ``folder``.

    Args:
        shape: a key of :data:`SHAPES`.
        device: where the weights are drawn (a GPU draws a 7B model in seconds; the CPU in minutes).
        initializer_range: 0.1 (not Llama's 0.02) gives logits clear winners, so a greedy
            comparison is not decided by rounding.
        tokenizer_from: a model folder whose tokenizer files are copied in (the profile's
            tokenizer and postfilter costs need one; ids the tokenizer makes above the shape's
            vocabulary are never fed to the model).

    Raises:
        KeyError: ``shape`` is not in :data:`SHAPES`.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], initializer_range=initializer_range)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    if tokenizer_from is not None:
        for name in _TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).exists():
                shutil.copy(Path(tokenizer_from) / name, folder / name)
    return folder
