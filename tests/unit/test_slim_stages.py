"""The light stages (gateway, tokenizer, postfilter) never load torch or the engine, and the
product never imports its load-test harness: each module is imported in a fresh interpreter
and ``sys.modules`` is inspected (an import already done by this test process cannot hide it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SLIM_MODULES = [
    "services.gateway.routes",
    "services.gateway.server",
    "services.tokenizer.worker",
    "services.postfilter.worker",
    "services.prompt_stage.worker",
    "shared.model_files",
]


def _modules_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in ("torch", "engine", "kernels", "loadtest"))


@pytest.mark.parametrize("module", SLIM_MODULES)
def test_slim_module_imports_no_torch(module):
    modules = _modules_after(f"import {module}")
    assert module in modules
    assert _heavy(modules) == []


def test_cli_does_not_import_loadtest():
    modules = _modules_after("import services.cli as c; c.build_parser()")
    assert "services.cli" in modules
    assert _heavy(modules) == []


def test_cli_finds_loadtest_commands_by_entry_point():
    from services.cli import external_commands

    commands = external_commands()
    assert {"bench", "chaos"} <= set(commands)
    assert commands["bench"].value == "loadtest.cli:bench"


def test_slim_stages_load_the_tokenizer_without_torch(tiny_model_dir):
    """What the tokenizer, postfilter and gateway do with the model at start: tokenize a chat
    prompt and detokenize — all without importing torch."""
    code = f"""
from pathlib import Path
from shared.model_files import load_tokenizer
from services.tokenizer.prompts import PromptProcessor, model_limits
from services.postfilter.text import Detokenizer
folder = Path({str(tiny_model_dir)!r})
tok = load_tokenizer(folder)
vocab, max_len = model_limits(folder, 0)
proc = PromptProcessor(tok, vocab, max_len)
ids = tok.encode("hello world", add_special_tokens=False)
detok = Detokenizer(tok.backend_tokenizer, True)
text = "".join(detok.step(i) for i in ids) + detok.finish()
assert text.strip() == "hello world", text
"""
    modules = _modules_after(code)
    assert "transformers" in modules
    assert _heavy(modules) == []
