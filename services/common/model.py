"""The served model's folder for the stages that read only its tokenizer and config
(gateway, tokenizer, postfilter): converted here where torch is installed, awaited where not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from shared.config import Settings
from shared.model_files import model_folder


def servable_model_folder(settings: Settings) -> Path:
    """:func:`shared.model_files.model_folder`, converting the default GGUF model in this
    process where torch is installed (:func:`engine.model.loader.ensure_model`, imported only
    then, so the slim stages never import torch), else waiting for a model worker to.

    Raises:
        shared.model_files.ModelNotAvailable: as ``model_folder``.
    """
    convert = None
    if importlib.util.find_spec("torch") is not None:
        from engine.model.loader import ensure_model  # imports torch: only for a first conversion

        convert = ensure_model
    return model_folder(settings, convert=convert)
