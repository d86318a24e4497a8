"""From an HTTP request to pipeline requests: the JSON body, the OpenAI request model, and
one TokenizeTask per choice (its sampling parameters, seed and deadline).

Every failure here is the client's: an explicit :class:`~shared.errors.PdError` with a 4xx
(``invalid_json``, ``invalid_body``, ``model_not_found``, an out-of-vocabulary token id, a
body over ``PD_MAX_REQUEST_BODY_BYTES``), never a 500.
"""

from __future__ import annotations

import json
import random
import time

import msgspec
from fastapi import Request
from pydantic import ValidationError

from services.gateway.openai_models import ChatCompletionRequest, CompletionRequest, validation_error_to_invalid
from services.gateway.request_run import Choice
from services.gateway.tenancy.admission import Admission
from services.gateway.tenancy.keys import Tenant
from services.gateway.tools.calls import plan_chat
from services.tokenizer.prompts import PromptProcessor
from shared.config import Settings
from shared.errors import InvalidRequest, ModelNotFound, PayloadTooLarge
from shared.messages import RequestMeta, SamplingParams, TokenizeTask


async def read_json(request: Request, limit_bytes: int) -> dict:
    """The JSON object of a request body.

    Raises:
        PayloadTooLarge: over ``limit_bytes``.
        InvalidRequest: not UTF-8, not JSON, or not an object.
    """
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit_bytes:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit_bytes} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit_bytes} bytes")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not valid UTF-8: {exc}", code="invalid_body") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
        # lone surrogates ("\ud800") decode into str but cannot be encoded again
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                             code="invalid_json") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply", code="invalid_json") from None
    except UnicodeEncodeError:
        raise InvalidRequest("request body holds a lone UTF-16 surrogate, which is not text",
                             code="invalid_json") from None
    except ValueError as exc:  # e.g. an integer literal of thousands of digits
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_body")
    return data


def _reject_constant(name: str):
    raise InvalidRequest(f"request body is not valid JSON: {name} is not a JSON number", code="invalid_json")


def parse_body(cls, data: dict, model_name: str):
    """``data`` as the pydantic request model ``cls``, for the served model.

    Raises:
        InvalidRequest: a field is missing or invalid (400).
        ModelNotFound: another model is named (404).
    """
    try:
        req = cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error_to_invalid(exc) from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply", code="invalid_body") from None
    if req.model != model_name:
        raise ModelNotFound(f"The model '{req.model}' does not exist; this server serves '{model_name}'",
                            param="model")
    return req


class ChoiceBuilder:
    """Turns a parsed request into its choices: one pipeline request (TokenizeTask) each.

    Args:
        settings: the gateway's settings (request timeout).
        model_name: the served model's id.
        inbox: the gateway instance's event subject (every task's ``reply_to``).
        prompts: the tokenizer and the model's limits (vocabulary, context).
    """

    def __init__(self, settings: Settings, model_name: str, inbox: str, prompts: PromptProcessor):
        self.settings = settings
        self.model_name = model_name
        self.inbox = inbox
        self.prompts = prompts

    @property
    def vocab_size(self) -> int:
        return self.prompts.vocab_size

    def sampling_for(self, req, max_tokens: int, seed: int, num_logprobs: int | None) -> SamplingParams:
        top_k = req.top_k if req.top_k not in (None, 0, -1) else None
        stop_ids = tuple(req.stop_token_ids or ())
        self.check_token_ids(stop_ids, "stop_token_ids")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            min_p=req.min_p or 0.0,
            seed=seed,
            stop=req.stop_list(),
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=req.logit_bias_ids(self.vocab_size),
            logprobs=num_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            speculative=req.speculative,
        )

    def _meta(self, request_id: str, now: float, req, tenant: Tenant | None, timeout_s: float | None) -> RequestMeta:
        salt = Admission.cache_salt(tenant, req.cache_salt)
        timeout_s = self.settings.request_timeout_s if timeout_s is None else timeout_s
        return RequestMeta(request_id=request_id, reply_to=self.inbox, model=self.model_name, created_at=now,
                           deadline_at=now + timeout_s, cache_salt=salt)

    @staticmethod
    def _base_seed(req) -> int:
        return (req.seed % (1 << 63)) if req.seed is not None else random.getrandbits(63)

    def chat(self, req: ChatCompletionRequest, base_id: str, tenant: Tenant | None = None,
             timeout_s: float | None = None) -> list[Choice]:
        """One pipeline request per choice; choice k samples with seed + k. Each carries the
        deadline ``timeout_s`` (default ``PD_REQUEST_TIMEOUT_S``) from now."""
        now = time.time()
        requested = req.requested_max_tokens()
        max_tokens = requested if requested is not None else self.prompts.max_model_len
        # tools, tool messages, response_format's grammar
        plan = plan_chat(req, self.prompts.tokenizer, closed=not self.settings.structured_additional_properties)
        seed = self._base_seed(req)
        return [
            Choice(index=k, prompt_index=0, task=TokenizeTask(
                meta=self._meta(f"{base_id}-{k}", now, req, tenant, timeout_s),
                sampling=msgspec.structs.replace(
                    self.sampling_for(req, max_tokens, (seed + k) % (1 << 63), req.num_logprobs()),
                    grammar=plan.grammar),
                messages=plan.messages,
                add_generation_prompt=req.add_generation_prompt,
                max_tokens_is_default=requested is None,
                tools=plan.tools,
            ))
            for k in range(req.n)
        ]

    def completion(self, req: CompletionRequest, base_id: str, tenant: Tenant | None = None,
                   timeout_s: float | None = None) -> list[Choice]:
        """One pipeline request per (prompt, choice); choice index = prompt * n + k, sampled
        with seed + index."""
        now = time.time()
        # max_tokens 0 (echo): prefill samples one token anyway; the answer leaves it out
        max_tokens = max(1, req.max_tokens) if req.max_tokens is not None else 16
        seed = self._base_seed(req)
        choices = []
        for p, prompt in enumerate(req.prompts()):
            for k in range(req.n):
                index = p * req.n + k
                task = TokenizeTask(
                    meta=self._meta(f"{base_id}-{index}", now, req, tenant, timeout_s),
                    sampling=msgspec.structs.replace(
                        self.sampling_for(req, max_tokens, (seed + index) % (1 << 63), req.num_logprobs()),
                        prompt_logprobs=req.prompt_logprobs()),
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=prompt if isinstance(prompt, list) else None,
                )
                choices.append(Choice(index=index, prompt_index=p, task=task))
        return choices

    def echo_texts(self, req) -> list[str]:
        """Completions with ``echo``: each prompt's text (token-id prompts detokenized)."""
        if not getattr(req, "echo", False):
            return []
        out = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                out.append(prompt)
            else:
                self.check_token_ids(prompt, "prompt")
                out.append(self.prompts.tokenizer.decode(prompt))
        return out

    def check_token_ids(self, ids, param: str) -> None:
        """Raises InvalidRequest (400) for an id outside the vocabulary."""
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise InvalidRequest(f"{param} must be in [0, {self.vocab_size})" if param == "stop_token_ids"
                                 else f"token ids must be in [0, {self.vocab_size})", param=param)
