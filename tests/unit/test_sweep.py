"""The crossover sweep (issue 34): the committed docs/scale.json matches the profiles and the
simulator's code it was made with (else: regenerate), a changed profile is caught, a small
sweep's verdicts follow from its numbers, and the agentic mix is what it says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sim import sweep, trace

SCALE_JSON = Path(__file__).resolve().parents[2] / "docs" / "scale.json"


def test_committed_sweep_is_current():
    data = json.loads(SCALE_JSON.read_text())
    why = sweep.stale(data)
    assert not why, (f"docs/scale.json is stale ({'; '.join(why)}): regenerate it with "
                     "`pdserve simulate sweep --out docs/scale.json` and commit docs/scale.*")
    assert data["stamp"]["commit"] and len(data["stamp"]["profiles"]) >= 3
    profiles = {c["profile"] for c in data["cells"]}
    assert "a100x4-llama2-70b-32k-tp4" in profiles and {c["mix"] for c in data["cells"]} >= {
        "azure-conv", "azure-code", "mooncake", "agentic"}
    assert {c["load"] for c in data["cells"]} == set(sweep.LOADS)
    for c in data["cells"]:
        assert set(c["modes"]) == set(sweep.MODES)


def test_a_changed_profile_makes_the_sweep_stale(tmp_path, monkeypatch):
    data = json.loads(SCALE_JSON.read_text())
    name = next(iter(data["stamp"]["profiles"]))
    for f in sweep.PROFILES_DIR.glob("*.json"):
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr(sweep, "PROFILES_DIR", tmp_path)
    assert not [w for w in sweep.stale(data) if "profile" in w]
    prof = json.loads((tmp_path / f"{name}.json").read_text())
    prof["decode_s"][0] *= 1.01
    (tmp_path / f"{name}.json").write_text(json.dumps(prof))
    assert f"profile {name} changed" in sweep.stale(data)


def test_a_small_sweep_reports_what_its_numbers_say(tmp_path):
    data = sweep.sweep(80, 4, [("a100-llama2-7b", ("azure-code",), 4096)], loads=(0.6,), say=lambda *_: None)
    (cell,) = data["cells"]
    modes, v = cell["modes"], cell["verdict"]
    assert set(modes) == set(sweep.MODES) and all(b["finished"] == 80 for b in modes.values())
    agg = max(modes["aggregated"]["attainment"], modes["aggregated+chunked"]["attainment"])
    split = max(modes["disaggregated"]["attainment"], modes["conditional"]["attainment"])
    assert v["attainment_gain"] == pytest.approx(split - agg)
    if v["outcome"] == "split wins":
        assert split > agg or v["tpot_p90_ratio"] > 1
    for b in modes.values():
        assert b["itl_p50"] <= b["itl_p90"] <= b["itl_p99"] <= b["itl_p999"]
    g = data["goodput_per_worker_at_90"]
    assert set(g) == {f"a100-llama2-7b|azure-code|{m}" for m in sweep.MODES}
    for mode, b in modes.items():  # met at the swept load: its rate per worker counts
        if b["attainment"] >= 0.9:
            assert g[f"a100-llama2-7b|azure-code|{mode}"] == pytest.approx(cell["rate"] / 4)
    sweep.write_md(data, tmp_path / "scale.md", "test")
    text = (tmp_path / "scale.md").read_text()
    assert "azure-code" in text and "3× lower" in text and "never against a GPU run" in text.replace("**", "")


def test_agentic_mix_is_long_context_with_prefix_reuse():
    reqs = trace.agentic(300)
    assert all(8192 <= r.prompt_tokens <= 32768 for r in reqs)
    assert 0.6 <= trace.prefix_hit_share(reqs) <= 0.8
    assert [r.idx for r in reqs] == list(range(300)) and all(
        a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))


def test_one_command_writes_the_json_the_report_and_the_plot(tmp_path, capsys):
    from sim import run

    out = tmp_path / "scale.json"
    assert run.main(["sweep", "--quick", "--requests", "40", "--workers", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["stamp"]["profiles"].keys() == {"a100-llama2-7b"} and data["stamp"]["code"] == sweep.code_digest()
    assert len(data["cells"]) == 2 and (tmp_path / "scale.md").exists()
    md = (tmp_path / "scale.md").read_text()
    assert "Crossover map" in md and "--quick" in md
    (tmp_path / "scale.md").unlink()
    assert run.main(["sweep", "--report-only", "--out", str(out)]) == 0 and (tmp_path / "scale.md").exists()
    assert "beats" in capsys.readouterr().out
