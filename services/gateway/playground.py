"""The browser playground at ``/`` (``PD_PLAYGROUND``, on by default): a chat page with
streaming, the common sampling parameters and the model list, that draws each answer's
request timeline (``/debug/timeline/<id>``: queue, tokenize, prefill, KV hand-off, decode,
postfilter) as bars, with TTFT and ITL. Plain HTML/JS/CSS shipped in the package
(``services/gateway/static``): no build step, nothing fetched from elsewhere at run time.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")


def mount_playground(app: FastAPI) -> None:
    """Serve the page at ``/`` and its script and style under ``/playground/``."""

    async def index():
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.mount("/playground", StaticFiles(directory=STATIC_DIR), name="playground")
