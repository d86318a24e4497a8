"""``python -m services.gateway``: the HTTP gateway under uvicorn."""

from __future__ import annotations

import time
import uuid

import uvicorn

from services.gateway.routes import create_app
from shared.config import Settings
from shared.logging import configure_logging
from shared.tracing import configure_tracing


def main_entry() -> None:
    settings = Settings.from_env()
    if not settings.instance_id:
        settings = settings.replace(instance_id=f"gateway-{uuid.uuid4().hex[:8]}")
    configure_logging("gateway", settings.instance_id, settings.log_level, settings.log_json)
    configure_tracing("gateway", settings.tracing, settings.otel_endpoint)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.gateway_host,
        port=settings.gateway_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_drain_s) + 4,
    )
    DrainingServer(config, app.state.gateway).run()


class DrainingServer(uvicorn.Server):
    """Tells the gateway when shutdown starts, so open requests get a clean error event (and
    their work is aborted) before uvicorn cuts connections."""

    def __init__(self, config: uvicorn.Config, gateway):
        super().__init__(config)
        self.gateway = gateway

    def handle_exit(self, sig, frame) -> None:
        if self.gateway.shutting_down_at is None:
            self.gateway.shutting_down_at = time.monotonic()
        super().handle_exit(sig, frame)
