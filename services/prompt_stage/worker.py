"""Runner of a pluggable pre-processing stage: ``python -m services.prompt_stage module.path:Class``.

The class (a :class:`~services.plugins.api.PromptStage`) only transforms a TokenizeTask; this
runner pulls tasks from the stage's own work queue (``<ns>.stage-<name>.tasks``, durable
``stage-<name>-workers``, shared by the stage's replicas), calls the class, publishes the result
to the next queue (the next pre-stage or the tokenizer) and acks only once that is stored —
with the same abort, deadline, poison, retry and heartbeat handling as the built-in stages.
"""

from __future__ import annotations

import asyncio
import sys

import msgspec

from services.common.consumer import PullConsumer, WorkItem
from services.common.runtime import Worker
from services.plugins.api import PromptStage, load_class, stage_name
from shared.config import Settings
from shared.deadline import task_headers
from shared.messages import TokenizeTask
from shared.recovery import work_id
from shared.timeline import with_mark
from shared.tracing import span


class StageWorker(Worker):
    concurrency = 64

    def __init__(self, settings: Settings, ref: str):
        self.ref = ref
        self.name = stage_name(ref)
        self.stage = f"stage-{self.name}"
        super().__init__(settings)
        if self.name not in self.protocol.pre_stages:
            raise SystemExit(f"{ref} is not in PD_PRE_STAGES={settings.pre_stages!r}")

    async def setup(self) -> None:
        cls = load_class(self.ref)
        if not issubclass(cls, PromptStage):
            raise SystemExit(f"{self.ref} is not a PromptStage")
        self.plugin: PromptStage = cls()
        await self.plugin.setup(self.settings)

    async def serve(self) -> None:
        self.consumer = PullConsumer(self, self.protocol.stage_queue(self.name), TokenizeTask, self.handle,
                                     capacity=lambda: self.concurrency - len(self.consumer.in_flight))
        self.spawn(self.consumer.run(), "consume")
        self.spawn(self.consumer.keepalive(), "keepalive")

    def heartbeat_fields(self) -> dict:
        consumer = self.consumer
        return {"num_running": len(consumer.in_flight) if consumer else 0, "capacity": self.concurrency}

    async def handle(self, item: WorkItem) -> str | None:
        task: TokenizeTask = item.message  # type: ignore[assignment]
        if not await self.still_wanted(task.meta, item.num_delivered):
            await item.ack()
            return "dropped"
        with span(self.stage, task.meta.headers, request_id=task.meta.request_id) as carry:
            out = await self.plugin.process(task)
            meta = with_mark(msgspec.structs.replace(out.meta, headers=carry or out.meta.headers), f"{self.stage}.done")
            await self.bus.publish_work(self.protocol.after_stage(self.name), msgspec.structs.replace(out, meta=meta),
                                        work_id(meta), headers=task_headers(meta.deadline_at))
        await item.ack()


def main_entry() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m services.prompt_stage module.path:ClassName")
    settings = Settings.from_env()
    try:
        asyncio.run(StageWorker(settings, sys.argv[1]).run())
    except KeyboardInterrupt:
        pass
