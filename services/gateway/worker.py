"""``python -m services.gateway``: the HTTP gateway under uvicorn."""

from __future__ import annotations

import uuid

import uvicorn

from services.gateway.app import create_app
from shared.config import Settings
from shared.logging import configure_logging


def main_entry() -> None:
    settings = Settings.from_env()
    if not settings.instance_id:
        settings = settings.replace(instance_id=f"gateway-{uuid.uuid4().hex[:8]}")
    configure_logging("gateway", settings.instance_id, settings.log_level, settings.log_json)
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.gateway_host,
        port=settings.gateway_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
