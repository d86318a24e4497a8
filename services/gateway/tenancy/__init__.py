"""Tenancy at the gateway, beside the request path: who may send a request now and what it
cost — API keys (``keys``), limits per key shared by every gateway (``limits``, Redis) or in
one process (``local_limits``), a key's quota and the 429 it gets (``quota``), admission by
predicted wait with per-key shares and the 503 it gives (``waits``), the usage meter (``usage``),
and the one façade the request path calls (``admission.Admission``)."""
