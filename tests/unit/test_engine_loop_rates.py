"""The prefill rate and decode step time a worker publishes in its heartbeat
(services/common/engine_loop.py), what the router's cost model and the gateway's admission
predict with; and the long-prompt burst's verdict when prompts were refused."""

from __future__ import annotations

from types import SimpleNamespace

from services.common.engine_loop import EngineLoop


def _loop() -> EngineLoop:
    engine = SimpleNamespace(stats=SimpleNamespace(last_step_tokens=0, last_step_seqs=0))
    return EngineLoop(engine, None, lambda outputs: None, lambda ids, exc: None)


def _step(loop: EngineLoop, tokens: int, seqs: int, elapsed: float) -> None:
    loop.engine.stats.last_step_tokens, loop.engine.stats.last_step_seqs = tokens, seqs
    loop._observe_rates(elapsed)


def test_the_cold_first_prefill_step_does_not_seed_the_rate():
    loop = _loop()
    _step(loop, 132, 4, 0.79)  # a new worker's first prefill: cold, 167 tokens/s
    assert loop.prefill_tokens_per_s == 0.0  # not timed: the gateway keeps its default until a warm step
    _step(loop, 132, 4, 0.2)  # warm: 660 tokens/s
    assert loop.prefill_tokens_per_s == 660.0
    _step(loop, 512, 1, 1.0)
    assert loop.prefill_tokens_per_s == 0.8 * 660.0 + 0.2 * 512.0  # then an EWMA
    assert loop.decode_step_s == 0.0  # no decode step seen


def test_decode_steps_are_timed_from_the_first():
    loop = _loop()
    _step(loop, 1, 1, 0.012)
    assert loop.decode_step_s == 0.012
    _step(loop, 8, 8, 0.030)
    assert loop.decode_step_s == 0.8 * 0.012 + 0.2 * 0.030
    _step(loop, 12, 4, 0.05)  # speculation's verify rows, under 32 tokens: neither rate
    assert loop.decode_step_s == 0.8 * 0.012 + 0.2 * 0.030 and loop.prefill_tokens_per_s == 0.0


def test_longmix_gives_no_verdict_from_a_run_that_refused_prompts(capsys):
    """A burst whose longest prompts were refused ends sooner: its wall time meets nothing."""
    from loadtest.bench_longmix import print_long_mix

    def figures(wall_s: float, failed: int) -> dict:
        return dict(wall_s=wall_s, ttft_p50_s=1.0, ttft_max_s=wall_s, itl_p50_ms=40.0, itl_p99_ms=90.0,
                    later_itl_p99_ms=80.0, hop_p50_ms=100.0, hop_max_ms=200.0, failed=failed,
                    errors=["HTTP 503"] * failed, hop_phases_max_ms={})

    print_long_mix([("pdserve up", figures(60.0, 5)), ("llama.cpp server -t 2", figures(265.0, 0))], 16, 100, 5700, 12)
    assert "(target <= 0.7x: MISSES: 5 + 0 prompts failed)" in capsys.readouterr().out
    print_long_mix([("pdserve up", figures(60.0, 0)), ("llama.cpp server -t 2", figures(265.0, 0))], 16, 100, 5700, 12)
    assert "0.23x (target <= 0.7x: meets)" in capsys.readouterr().out
