"""docs/sim-validation.md quotes what the current simulator predicts for the runs kept in
docs/data/sim-oos-* (one folder per measured machine): re-predicting them here must give the
document's headline shares. A change to the simulator that moves them fails this test until
``pdserve bench sim-validate --measured`` (the command the document gives) is rerun and the
document updated. Each dataset's part of the document starts at a marker line
``<!-- oos: docs/data/<folder> -->``."""

import json
import re
from argparse import Namespace
from pathlib import Path

import pytest

from loadtest import sim_oos
from sim.profile import Profile

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "sim-validation.md"
DATASETS = sorted(p.name for p in (ROOT / "docs" / "data").glob("sim-oos-*") if (p / "oos.json").exists())


def _part(text: str, name: str) -> str:
    """The document's text from ``name``'s marker to the next dataset's marker."""
    marker = f"<!-- oos: docs/data/{name} -->"
    assert marker in text, f"docs/sim-validation.md has no part for docs/data/{name} (marker {marker})"
    part = text.split(marker, 1)[1]
    return part.split("<!-- oos: ", 1)[0]


def test_every_kept_dataset_is_in_the_document():
    assert DATASETS, "no kept runs under docs/data/sim-oos-*"
    text = DOC.read_text()
    for name in DATASETS:
        _part(text, name)


@pytest.mark.parametrize("name", DATASETS)
def test_the_documents_shares_are_what_the_simulator_predicts_now(name):
    data = ROOT / "docs" / "data" / name
    report = json.loads((data / "oos.json").read_text())
    args = Namespace(**{**report["args"], "out": str(data)})
    measured = json.loads((data / "measured.json").read_text())
    prof, _ = sim_oos.frozen_profile(Profile.load(data / "profile.json"), measured, report["fit_key"], args)
    predicted = sim_oos.predict(prof, measured, args)
    rows = [r for r in sim_oos.rows(measured, predicted, report["fit_key"]) if not r["fit"] and r["q"] != "p99"]
    within = sum(abs(r["error"]) <= args.tolerance for r in rows)
    text = _part(DOC.read_text(), name)
    quoted = re.search(r"\*\*all p50 and p90: (\d+)/(\d+) = \d+% within", text)
    assert quoted, f"docs/sim-validation.md lost the headline line of {name}"
    assert (within, len(rows)) == (int(quoted[1]), int(quoted[2])), (
        f"the simulator now predicts other numbers for the runs in docs/data/{name}: rerun "
        f"`pdserve bench sim-validate --measured docs/data/{name} ...` and update docs/sim-validation.md")
    held = [r for r in rows if r["rep"] not in tuple(report["args"]["dev_repeats"])]
    quoted = re.search(r"\* held out — repeats other than [\d, ]+ \(.*?\): (\d+)/(\d+) = \d+% within", text)
    assert quoted and (sum(abs(r["error"]) <= args.tolerance for r in held), len(held)) == (
        int(quoted[1]), int(quoted[2]))
