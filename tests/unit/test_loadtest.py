"""The load-test toolkit: trace loaders, arrival processes, metrics and reports."""

from __future__ import annotations

import json
import statistics

import pytest

from loadtest.client import RequestResult, percentile, summarize
from loadtest.report import table, write
from loadtest.workloads import Scaling, azure, mooncake, synthetic


def test_azure_trace_replay_keeps_arrivals_and_caps_lengths():
    specs = azure("azure2023_conv.csv", 20, Scaling(time_scale=0.5, max_prompt_tokens=300, max_output_tokens=32))
    assert len(specs) == 20 and specs[0].send_at == 0.0
    assert all(b.send_at >= a.send_at for a, b in zip(specs, specs[1:]))
    assert all(1 <= len(s.prompt) <= 300 and 1 <= s.max_tokens <= 32 for s in specs)
    full = azure("azure2023_conv.csv", 20, Scaling(time_scale=1.0, max_prompt_tokens=10**6, max_output_tokens=10**6))
    assert specs[5].send_at == pytest.approx(full[5].send_at * 0.5)
    assert [len(s.prompt) for s in full[:3]] == [374, 396, 879]  # the trace's own first rows


def test_mooncake_requests_sharing_hash_ids_share_prompt_prefixes():
    specs = mooncake("mooncake_conversation.jsonl", 200, Scaling(1.0, 4096, 64, block_tokens=32))
    rows = [json.loads(line) for line in open(__import__("loadtest.workloads", fromlist=["x"]).trace_path(
        "mooncake_conversation.jsonl")).readlines()[:200]]
    pairs = 0
    for i in range(len(rows)):
        for j in range(i + 1, min(len(rows), i + 30)):
            a, b = rows[i]["hash_ids"], rows[j]["hash_ids"]
            shared = 0
            while shared < min(len(a), len(b)) and a[shared] == b[shared]:
                shared += 1
            n = min(shared * 32, len(specs[i].prompt), len(specs[j].prompt))
            if n:
                assert specs[i].prompt[:n] == specs[j].prompt[:n]
                pairs += 1
            if shared < min(len(a), len(b)):
                k = shared * 32
                if k < min(len(specs[i].prompt), len(specs[j].prompt)):
                    assert specs[i].prompt[k:k + 32] != specs[j].prompt[k:k + 32]
    assert pairs > 10


def test_poisson_and_gamma_rates():
    for burst in (1.0, 4.0):
        specs = synthetic(4000, 2.0, [(64, 1.0)], 8, burstiness=burst, seed=1)
        gaps = [b.send_at - a.send_at for a, b in zip(specs, specs[1:])]
        assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.08)
        cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
        assert cv2 == pytest.approx(burst, rel=0.25)


def result(ttft, gaps, tokens, ok=True):
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(tag="", sent_at=0, ok=ok, output_tokens=tokens, ttft_s=ttft, e2e_s=times[-1], chunk_times=times)


def test_summary_metrics_and_goodput():
    rs = [result(0.5, [0.1] * 9, 10), result(2.0, [0.1] * 9, 10), result(0.4, [0.5] * 9, 10),
          RequestResult(tag="", sent_at=0, ok=False, error="HTTP 500")]
    s = summarize(rs, wall_s=10.0, slo_ttft_s=1.0, slo_tpot_s=0.2)
    assert (s.num_requests, s.num_ok) == (4, 3)
    assert s.requests_per_s == pytest.approx(0.3) and s.output_tokens_per_s == pytest.approx(3.0)
    assert s.goodput_rps == pytest.approx(0.1)  # only the first meets both SLOs
    assert s.tpot["mean"] == pytest.approx((0.1 + 0.1 + 0.5) / 3)
    assert s.ttft["p50"] == pytest.approx(0.5)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 90) is None


def test_report_writes_json_markdown_and_plots(tmp_path):
    rs = {"a": [result(0.5, [0.1] * 5, 6)], "b": [result(0.7, [0.2] * 5, 6)]}
    sums = {k: summarize(v, 5.0, 1.0, 0.3) for k, v in rs.items()}
    path = write(tmp_path, "t", "w", sums, rs, sweeps={"a": [(1.0, sums["a"]), (2.0, sums["a"])]})
    text = path.read_text()
    assert "| a |" in text and "| b |" in text and "cdf_ttft.png" in text
    for f in ("report.json", "cdf_ttft.png", "cdf_itl.png", "load.png"):
        assert (tmp_path / f).stat().st_size > 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["requests"]["a"][0]["chunk_times"][0] == 0.5
    assert "TTFT p50" in table(sums)


def test_transformers_baseline_server_streams_through_the_client(tiny_model_dir):
    """The plain-transformers baseline the benchmarks compare against answers the same client."""
    import asyncio

    import httpx

    from loadtest.baselines import ServerThread, hf_app
    from loadtest.client import RequestSpec, send_one
    from loadtest.infra import free_port

    with ServerThread(hf_app(tiny_model_dir, "tiny-llama", 1), free_port()) as server:
        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                return await send_one(c, "tiny-llama", RequestSpec(0.0, "Hello there", 6), extra={"ignore_eos": True})

        result = asyncio.run(go())
    assert result.ok, result.error
    assert result.output_tokens == 6 and result.ttft_s is not None and result.ttft_s > 0


def test_llama_build_flags_follow_the_cpu_and_never_turn_amx_on(monkeypatch, tmp_path):
    from loadtest.baselines import llama_build_dir, llama_cmake_flags

    monkeypatch.delenv("PD_LLAMA_CMAKE_FLAGS", raising=False)
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))
    zen3 = llama_cmake_flags("flags : fpu sse2 avx avx2 fma f16c")
    xeon = llama_cmake_flags("flags : avx avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 amx_tile amx_bf16")
    assert "-DGGML_AVX2=ON" in zen3 and "-DGGML_AVX512=OFF" in zen3 and "-DGGML_AVX512_BF16=OFF" in zen3
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"} <= set(xeon)
    for flags in (zen3, xeon):
        assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AMX_TILE=OFF" in flags and "-DGGML_AMX_BF16=OFF" in flags
    # one build folder per set of flags, under the cache folder
    assert llama_build_dir(zen3) != llama_build_dir(xeon) and llama_build_dir(zen3).is_relative_to(tmp_path)
    monkeypatch.setenv("PD_LLAMA_CMAKE_FLAGS", "-DGGML_AVX2=OFF -DX=1")
    assert llama_cmake_flags("avx2") == ["-DGGML_AVX2=OFF", "-DX=1"]


def test_free_ports_are_distinct_bindable_and_never_ephemeral():
    """A port the kernel can hand to a bind(0) or an outgoing connection can be taken between
    the pick and the server's bind (a CI run lost a NATS cluster node so): free_port stays below
    the ephemeral range, never repeats, and a burst of ephemeral sockets cannot land on its picks."""
    import socket

    from loadtest.infra import _ephemeral_low, free_port

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= p < _ephemeral_low() for p in ports)
    held = []
    try:
        for _ in range(200):  # what the route relays and clients do meanwhile
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        assert not {s.getsockname()[1] for s in held} & set(ports)
        for p in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
    finally:
        for s in held:
            s.close()


def test_http_verdicts_judge_the_chunk_gap_and_report_time_per_token_beside_it():
    from loadtest.bench_http import http_verdicts

    nan = float("nan")
    rows = [("pdserve up", 1, 13.2, 6.1, 44, 167.2, ""), ("pdserve up", 8, 37.3, 20.0, 2032, 133.0, ""),
            ("llama.cpp server -t 2", 1, 9.7, 10.3, 24, 97.3, ""), ("llama.cpp server -t 2", 8, 39.5, 40.0, 5461, 40.0, ""),
            ("llama.cpp server -t 2", 32, nan, nan, nan, nan, "did not start")]
    lines = http_verdicts(rows)
    assert lines[0] == "ITL p50 at concurrency 1: pdserve 13.2 ms / llama.cpp 9.7 ms = 1.36x (target <= 1x: MISSES)"
    assert lines[1].startswith("TPOT p50 at concurrency 1: pdserve 6.1 ms / llama.cpp 10.3 ms = 0.59x")
    assert lines[2] == "output tok/s at concurrency 8: 3.33x llama.cpp (target >= 3x: meets)"
    assert len(lines) == 3  # no verdict at 32: llama.cpp's row has no rate
