"""Tenants at the gateway, in process against the fake pipeline: keys from a file (hashed,
named, with quotas and cache_salt groups), reload without restart, the admin usage endpoint
summing two gateways through Redis, and the Redis-down policy both ways."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from prometheus_client import REGISTRY

from services.gateway.openai_models import TokenizeRequest
from services.gateway.tenancy.keys import group_salt, hash_key, parse_keys_file
from shared.config import Settings, SettingsError
from shared.messages import Accepted
from tests.pipeline_fixture import free_port
from tests.unit.test_gateway import BODY, client_for, make, texts
from tests.unit.test_shared_limits import cleanup, run


def keys_yaml(path, entries: list[dict]) -> None:
    lines = ["keys:"]
    for e in entries:
        lines.append(f"  - name: {e['name']}")
        lines.append(f"    sha256: {hash_key(e['key'])}")
        for field in ("tokens_per_minute", "requests_per_minute", "max_concurrent_requests", "cache_salt"):
            if field in e:
                lines.append(f"    {field}: {e[field]}")
    path.write_text("\n".join(lines) + "\n")


def bump_mtime(path) -> None:
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def answer(task):
    return texts(task.meta.request_id, ["a", "b"])


def test_keys_file_stores_hashes_and_parses_yaml_and_toml(tmp_path):
    settings = Settings.from_env({}, rate_limit_tokens_per_minute=500)
    keys_yaml(tmp_path / "keys.yaml", [{"name": "alice", "key": "sk-a", "tokens_per_minute": 100, "cache_salt": "acme"},
                                       {"name": "bob", "key": "sk-b"}])
    (tmp_path / "keys.toml").write_text(f'[[keys]]\nname = "alice"\nsha256 = "{hash_key("sk-a")}"\n'
                                        'tokens_per_minute = 100\ncache_salt = "acme"\n'
                                        f'[[keys]]\nname = "bob"\nsha256 = "{hash_key("sk-b")}"\n')
    from_yaml = parse_keys_file(tmp_path / "keys.yaml", settings)
    assert from_yaml == parse_keys_file(tmp_path / "keys.toml", settings)
    alice, bob = from_yaml[hash_key("sk-a")], from_yaml[hash_key("sk-b")]
    assert (alice.tokens_per_minute, bob.tokens_per_minute) == (100, 500)  # bob gets the default
    assert alice.cache_salt == group_salt("acme") and bob.cache_salt == hash_key("sk-b")[:16]
    assert "sk-a" not in (tmp_path / "keys.yaml").read_text()
    (tmp_path / "bad.yaml").write_text(f"keys:\n  - name: x\n    sha256: {hash_key('k')}\n    tokens_per_minute: -1\n")
    with pytest.raises(SettingsError, match="tokens_per_minute"):
        parse_keys_file(tmp_path / "bad.yaml", settings)


def test_keys_reload_without_restart_and_a_bad_file_keeps_the_keys_in_force(tiny_model_dir, tmp_path):
    path = tmp_path / "keys.yaml"
    keys_yaml(path, [{"name": "alice", "key": "sk-a"}])
    app, _ = make(tiny_model_dir, answer, keys_file=str(path), keys_reload_interval_s=0.001)

    async def go():
        async with client_for(app) as c:
            before = (await c.post("/v1/chat/completions", json=BODY, headers=auth("sk-a")),
                      await c.post("/v1/chat/completions", json=BODY, headers=auth("sk-new")))
            keys_yaml(path, [{"name": "newcomer", "key": "sk-new"}])
            bump_mtime(path)
            await asyncio.sleep(0.01)  # past the 1 ms reload interval (requests can be faster than it)
            after = (await c.post("/v1/chat/completions", json=BODY, headers=auth("sk-a")),
                     await c.post("/v1/chat/completions", json=BODY, headers=auth("sk-new")))
            path.write_text("keys: [oops")
            bump_mtime(path)
            await asyncio.sleep(0.01)
            broken = await c.post("/v1/chat/completions", json=BODY, headers=auth("sk-new"))
            return before, after, broken

    before, after, broken = run(go())
    assert [r.status_code for r in before] == [200, 401]
    assert [r.status_code for r in after] == [401, 200]
    assert broken.status_code == 200


def test_sighup_reloads_the_keys_file(tiny_model_dir, tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text("keys = []\n")
    app, _ = make(tiny_model_dir, answer, keys_file=str(path), keys_reload_interval_s=3600)
    path.write_text(f'[[keys]]\nname = "late"\nsha256 = "{hash_key("sk-late")}"\n')

    async def go():
        async with client_for(app) as c:
            before = await c.post("/v1/chat/completions", json=BODY, headers=auth("sk-late"))
            app.state.gateway.admission.start()  # installs the SIGHUP handler on this loop
            os.kill(os.getpid(), signal.SIGHUP)
            keys = app.state.gateway.admission.keys
            for _ in range(200):  # the loop runs the handler at its next turn
                if keys.file_keys:
                    break
                await asyncio.sleep(0.01)
            after = await c.post("/v1/chat/completions", json=BODY, headers=auth("sk-late"))
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            return before, after

    before, after = run(go())
    assert (before.status_code, after.status_code) == (401, 200)


def test_one_organisation_shares_a_cache_salt_and_others_never(tiny_model_dir, tmp_path):
    path = tmp_path / "keys.yaml"
    keys_yaml(path, [{"name": "acme-1", "key": "sk-a1", "cache_salt": "acme"},
                     {"name": "acme-2", "key": "sk-a2", "cache_salt": "acme"},
                     {"name": "globex", "key": "sk-g", "cache_salt": "globex"},
                     {"name": "solo", "key": "sk-s"}])
    app, fake = make(tiny_model_dir, answer, keys_file=str(path), api_keys="sk-env")

    async def go():
        async with client_for(app) as c:
            for key in ("sk-a1", "sk-a2", "sk-g", "sk-s", "sk-env"):
                assert (await c.post("/v1/chat/completions", json=BODY, headers=auth(key))).status_code == 200

    run(go())
    a1, a2, g, s, env = (t.meta.cache_salt for t in fake.submitted)
    assert a1 == a2
    assert len({a1, g, s, env}) == 4
    assert env.startswith(hash_key("sk-env")[:16])  # the env keys' salt is what it was


def test_usage_endpoint_sums_two_gateways_and_needs_the_admin_key(tiny_model_dir, tmp_path, redis_url, namespace):
    path = tmp_path / "keys.yaml"
    keys_yaml(path, [{"name": "alice", "key": "sk-a", "tokens_per_minute": 10_000},
                     {"name": "bob", "key": "sk-b", "requests_per_minute": 1}])
    common = dict(keys_file=str(path), rate_limit_store="redis", redis_url=redis_url, namespace=namespace,
                  admin_api_key="sk-admin")
    (one, _), (two, _) = make(tiny_model_dir, answer, **common), make(tiny_model_dir, answer, **common)

    def counted(name: str, labels: dict) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    alice_ok = {"key_name": "alice", "outcome": "ok"}
    before = (counted("pd_gateway_key_requests_total", alice_ok),
              counted("pd_gateway_key_tokens_total", {"key_name": "alice", "kind": "completion"}))

    async def go():
        async with client_for(one) as c1, client_for(two) as c2:
            for c in (c1, c2, c1):
                assert (await c.post("/v1/chat/completions", json=BODY, headers=auth("sk-a"))).status_code == 200
            bob = [await c.post("/v1/chat/completions", json=BODY, headers=auth("sk-b")) for c in (c1, c2)]
            await one.state.gateway.admission.drain()
            await two.state.gateway.admission.drain()
            gates = [await c2.get("/v1/usage", headers=h) for h in ({}, auth("wrong"), auth("sk-a"))]
            return bob, gates, await c2.get("/v1/usage", headers=auth("sk-admin"))

    try:
        bob, gates, usage = run(go())
    finally:
        run(cleanup(redis_url, namespace))
    assert [r.status_code for r in bob] == [200, 429]  # one request per minute, across both
    assert [r.status_code for r in gates] == [401, 401, 403]
    assert gates[2].json()["error"]["code"] == "permission_denied"
    body = usage.json()
    assert body["scope"] == "all_gateways"
    rows = {row["key_name"]: row for row in body["data"]}
    # the fake pipeline: 5 prompt tokens and 2 completion tokens per request
    assert rows["alice"]["requests"] == 3 and rows["alice"]["prompt_tokens"] == 15
    assert rows["alice"]["completion_tokens"] == 6 and rows["alice"]["by_outcome"]["ok"]["requests"] == 3
    assert rows["bob"]["by_outcome"]["ok"]["requests"] == 1
    assert rows["bob"]["by_outcome"]["rate_limit_exceeded"]["requests"] == 1
    # and each process's Prometheus counters (both gateways live in this one), labelled by name
    assert counted("pd_gateway_key_requests_total", alice_ok) - before[0] == 3
    assert counted("pd_gateway_key_tokens_total", {"key_name": "alice", "kind": "completion"}) - before[1] == 6


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_redis_down_policy(tiny_model_dir, policy, namespace):
    app, _ = make(tiny_model_dir, answer, api_keys="k1", rate_limit_tokens_per_minute=1000, rate_limit_store="redis",
                  rate_limit_redis_url=f"redis://127.0.0.1:{free_port()}/0", rate_limit_failure_policy=policy,
                  namespace=namespace)

    async def go():
        async with client_for(app) as c:
            return [await c.post("/v1/chat/completions", json=BODY, headers=auth("k1")) for _ in range(2)]

    responses = run(go())
    if policy == "open":
        assert [r.status_code for r in responses] == [200, 200]
        limits = app.state.gateway.admission.limits
        assert limits.down_until > 0 and limits.local.buckets  # the limit held, in this gateway's buckets
    else:
        assert [r.status_code for r in responses] == [503, 503]
        error = responses[0].json()["error"]
        assert error["code"] == "rate_limiter_unavailable" and error["type"] == "server_error"


@pytest.mark.parametrize("store", ["local", "redis"])
def test_three_gateways_give_a_key_its_limit_once_with_redis_and_three_times_alone(tiny_model_dir, redis_url,
                                                                                    namespace, store):
    probe, _ = make(tiny_model_dir, lambda task: None)
    size = probe.state.gateway.tokenize(TokenizeRequest(model="tiny-llama", messages=BODY["messages"]))["count"] + 8
    limit = 2 * size + size // 2  # two requests fit

    def exact(task):  # uses all it reserved: no refund lets a third in, however fast they finish
        events = texts(task.meta.request_id, ["a"] * 8)
        events[0] = (0.0, Accepted(request_id=task.meta.request_id, num_prompt_tokens=size - 8, max_tokens=8))
        return events

    apps = [make(tiny_model_dir, exact, api_keys="k1", rate_limit_tokens_per_minute=limit, rate_limit_store=store,
                 rate_limit_window_s=3600.0, redis_url=redis_url, namespace=namespace)[0] for _ in range(3)]

    async def go():
        clients = [client_for(app) for app in apps]
        try:
            burst = [clients[i % 3].post("/v1/chat/completions", json=BODY, headers=auth("k1")) for i in range(12)]
            return await asyncio.gather(*burst)
        finally:
            for c in clients:
                await c.aclose()

    try:
        responses = run(go())
    finally:
        run(cleanup(redis_url, namespace))
    ok = sum(r.status_code == 200 for r in responses)
    print(f"\n[3 gateways, {store} store] limit={limit} request={size} tokens admitted={ok} requests")
    assert ok == (2 if store == "redis" else 6)


def test_a_missing_or_invalid_keys_file_stops_the_gateway_at_start(tmp_path):
    from services.gateway.tenancy.keys import KeyRing

    with pytest.raises(SettingsError, match="PD_KEYS_FILE"):
        KeyRing(Settings.from_env({}, keys_file=str(tmp_path / "nope.yaml")))
    (tmp_path / "dup.yaml").write_text(f"keys:\n  - name: a\n    sha256: {hash_key('x')}\n"
                                       f"  - name: a\n    sha256: {hash_key('y')}\n")
    with pytest.raises(SettingsError, match="twice"):
        KeyRing(Settings.from_env({}, keys_file=str(tmp_path / "dup.yaml")))


def test_a_request_refused_for_bad_input_holds_no_concurrent_slot(tiny_model_dir):
    app, _ = make(tiny_model_dir, answer, api_keys="k1", max_concurrent_requests_per_key=1)
    bad = {"model": "tiny-llama", "prompt": [10 ** 6], "echo": True}  # a token id outside the vocabulary

    async def go():
        async with client_for(app) as c:
            first = await c.post("/v1/completions", json=bad, headers=auth("k1"))
            return first, await c.post("/v1/completions", json={**bad, "prompt": "hi"}, headers=auth("k1"))

    first, second = run(go())
    assert first.status_code == 400
    assert second.status_code == 200, second.text
