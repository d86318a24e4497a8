"""`pdserve profile` on the tiny model, and the simulator's twin of one real run: the modes
benchmark's disaggregated deployment and its simulated twin (loadtest/sim_validate.py and
calibrate.py, the small version of the validation table).

The twin's costs are calibrated on the same run's own engine steps, so its agreement with that
run is a fit, not a prediction: it checks the machinery (the step logs reach the calibration,
the twin replays the same workload to the end, its latencies land in the run's range), not
that the simulator predicts an unseen deployment. That is what `pdserve simulate` against a
second, separate run measures (the full table, SmolLM2 and four modes, is in the closing note
of issue 16). The band is wide (a factor of 4) because the tiny model's steps take about a
millisecond, so the pipeline's noise (other jobs on the two cores) is most of what is
measured; with 16 requests the p90 is the second-slowest request, and a stall of the shared
machine lands there in full. It still fails a twin that is off by an order of magnitude (a
wrong unit, steps not replayed, the hop latency missing).
"""

from __future__ import annotations

import json

import pytest

from loadtest import sim_validate as validate
from sim.measure import main as profile_main
from sim.profile import Profile

# the tiny model's TTFT is nearly all pipeline (five processes' hops, ~1 ms of model); the twin
# takes that latency from an idle probe just before the run, and at load average ~9 the probe
# and the run's TTFT p50 were seen 1.5-3.4x apart from one run to the next (issue 16's note)
#: a fit's band, not a prediction's (see the module doc)
TOLERANCE = {"p50": 4.0, "p90": 4.0}


def test_profile_command_writes_a_sane_profile(tiny_model_dir, tmp_path, monkeypatch, nats_url):
    monkeypatch.setenv("PD_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("PD_KV_CACHE_MEMORY_BYTES", str(64 << 20))
    out = tmp_path / "p.json"
    assert profile_main(["--quick", "--max-prompt", "256", "--max-batch", "8", "--out", str(out)]) == 0
    p = Profile.load(out)
    assert p.measured and p.version == 1
    assert p.prefill_tokens == sorted(p.prefill_tokens) and p.prefill_tokens[-1] == 256
    assert all(b >= a > 0 for a, b in zip(p.prefill_s, p.prefill_s[1:]))  # monotone, positive
    assert all(b >= a > 0 for a, b in zip(p.decode_s, p.decode_s[1:]))
    assert p.decode_batch == [1, 2, 3, 4, 5, 6, 7, 8]  # every batch where the kernels change path
    # the attention per pair is the smoothed table's own (a step of several prompts agrees with it)
    from sim.calibrate import table_attention

    assert p.prefill_attn_s == pytest.approx(table_attention(p.prefill_tokens, p.sources["prefill_s_measured"]),
                                             rel=0.05, abs=1e-12)  # from times rounded to 1 µs
    # tiny model: 2 layers × K,V × 2 KV heads × head_dim 16 × 2 bytes (bfloat16 here)
    assert p.kv_bytes_per_token in (2 * 2 * 2 * 16 * 2, 2 * 2 * 2 * 16 * 4)
    assert 0 < p.bus_hop_s < 1.0 and p.token_cpu_s > 0 and 1.0 <= p.corun_slowdown <= 2.0


def test_simulated_twin_fits_the_run_it_was_calibrated_on(tiny_model_dir, tmp_path, monkeypatch, nats_url):
    monkeypatch.setenv("PD_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("PD_KV_CACHE_MEMORY_BYTES", str(64 << 20))
    assert validate.main(["--requests", "16", "--rate", "6", "--short", "24", "--long", "300",
                          "--output-tokens", "16", "--modes", "disaggregated", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "validate.json").read_text())
    m, s = data["measured"]["disaggregated"], data["simulated"]["disaggregated"]
    assert m["num_ok"] == 16 and s["finished"] == 16
    # the twin was calibrated on this run's own engine steps (both workers' step logs)
    fit = s["calibration"]["fit"]
    assert len(list((tmp_path / "steps" / "disaggregated").glob("*.jsonl"))) == 2
    assert fit["steps"] > 16 and fit["decode"] > 0 and fit["prefill"] > 0
    assert list((tmp_path / "logs" / "disaggregated").glob("tokenizer-*.log"))  # the routing decisions kept
    for metric, q in (("ttft", "p50"), ("ttft", "p90"), ("tpot", "p50")):
        ratio = s[metric][q] / m[metric][q]
        assert 1 / TOLERANCE[q] <= ratio <= TOLERANCE[q], (metric, q, m[metric][q], s[metric][q], m["probe"])


def test_profile_of_a_synthetic_shape_is_greedy_and_prices_sampling(tiny_model_dir, tmp_path, monkeypatch):
    """``--synthetic`` (how a lent GPU with no model hub is profiled) draws a random-weight
    model of a named architecture, takes the tokenizer from ``--tokenizer``, and the profile
    says so; decode is timed greedy with the cost of a sampled row beside it; an unknown shape
    is refused before anything is built."""
    from engine.model import synthetic

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rope_theta=10000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    monkeypatch.setitem(synthetic.SHAPES, "tiny-test", shape)
    monkeypatch.setenv("PD_KV_CACHE_MEMORY_BYTES", str(64 << 20))
    monkeypatch.delenv("PD_MODEL", raising=False)
    out = tmp_path / "p.json"
    assert profile_main(["--synthetic", "tiny-test", "--tokenizer", str(tiny_model_dir), "--quick", "--no-bus",
                         "--max-prompt", "128", "--max-batch", "4", "--name", "tiny-synth", "--out", str(out)]) == 0
    p = Profile.load(out)
    assert p.name == "tiny-synth" and p.model.startswith("tiny-test shape, random weights")
    # 2 layers × K,V × 2 KV heads × head_dim 16 × the element size of the default dtype
    assert p.kv_bytes_per_token in (2 * 2 * 2 * 16 * 2, 2 * 2 * 2 * 16 * 4)
    assert "greedy" in p.sources["decode_s"] and p.sources["sample_s_per_row"] >= 0
    assert p.tokenize_s > 0 and p.token_cpu_s > 0  # the tokenizer was copied in and priced
    for bad in (["--synthetic", "no-such-shape"], ["--tokenizer", str(tiny_model_dir)],
                ["--synthetic", "tiny-test", "--tokenizer", str(tmp_path)]):  # no tokenizer.json there
        with pytest.raises(SystemExit) as info:
            profile_main([*bad, "--out", str(tmp_path / "q.json")])
        assert info.value.code == 2 and not (tmp_path / "q.json").exists()
