"""Tool calling and structured output at the gateway, beside the request path: the request
fields (``models``), the prompt, grammar and parsing of calls (``calls``), and chat answers
that may be tool calls, whole or streamed (``responses``). See ``docs/structured-output.md``."""
