"""docs/sim-validation.md quotes what the current simulator predicts for the runs kept in
docs/data/sim-oos-avx2 (measured on an AVX2 EPYC): re-predicting them here must give the
document's headline shares. A change to the simulator that moves them fails this test until
``pdserve bench sim-validate --measured`` (the command the document gives) is rerun and the
document updated."""

import json
import re
from argparse import Namespace
from pathlib import Path

from loadtest import sim_oos
from sim.profile import Profile

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "data" / "sim-oos-avx2"
DOC = ROOT / "docs" / "sim-validation.md"


def test_the_documents_shares_are_what_the_simulator_predicts_now():
    report = json.loads((DATA / "oos.json").read_text())
    args = Namespace(**{**report["args"], "out": str(DATA)})
    measured = json.loads((DATA / "measured.json").read_text())
    prof, _ = sim_oos.frozen_profile(Profile.load(DATA / "profile.json"), measured, report["fit_key"], args)
    predicted = sim_oos.predict(prof, measured, args)
    rows = [r for r in sim_oos.rows(measured, predicted, report["fit_key"]) if not r["fit"] and r["q"] != "p99"]
    within = sum(abs(r["error"]) <= args.tolerance for r in rows)
    text = DOC.read_text()
    quoted = re.search(r"\*\*all p50 and p90: (\d+)/(\d+) = \d+% within", text)
    assert quoted, "docs/sim-validation.md lost its headline line"
    assert (within, len(rows)) == (int(quoted[1]), int(quoted[2])), (
        "the simulator now predicts other numbers for the kept runs: rerun "
        "`pdserve bench sim-validate --measured docs/data/sim-oos-avx2 ...` and update docs/sim-validation.md")
    held = [r for r in rows if r["rep"] not in tuple(report["args"]["dev_repeats"])]
    quoted = re.search(r"\* held out — repeats other than [\d, ]+ \(.*?\): (\d+)/(\d+) = \d+% within", text)
    assert quoted and (sum(abs(r["error"]) <= args.tolerance for r in held), len(held)) == (
        int(quoted[1]), int(quoted[2]))
