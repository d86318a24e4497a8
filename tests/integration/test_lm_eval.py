"""lm-evaluation-harness (``lm-eval`` from PyPI) against a live pdserve: its
``local-completions`` model on the tiny-model pipeline, and its own ``hf`` model on the same
float32 weights, over two local tasks shipped in tests/data/lm_eval (JSON lines read by
``dataset_path: json``; nothing is downloaded): a multiple-choice log-likelihood task, which
goes through prompt logprobs (``echo`` + ``logprobs``), and a ``generate_until`` task.

Every sample must agree: the log-likelihood of each choice within LOGLIKELIHOOD_TOLERANCE (both
sides float32; pdserve's paged attention sums in another order than transformers' eager one),
the same greedy flags and the same generated text; so the scores are equal.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(600)
TASKS_DIR = REPO / "tests" / "data" / "lm_eval"
TASKS = ["pdserve_mc", "pdserve_gen"]
#: nats per choice (a sum over its continuation tokens)
LOGLIKELIHOOD_TOLERANCE = 1e-3


def evaluate(model: str, model_args: dict) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=1, log_samples=True,
                                   task_manager=TaskManager(include_path=str(TASKS_DIR)), device="cpu")


def by_doc(results: dict, task: str) -> dict[int, list]:
    return {s["doc_id"]: s["filtered_resps"] for s in results["samples"][task]}


def test_lm_eval_against_pdserve_matches_hf(pipeline, tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(REPO)  # the task files name their data relative to the repository root
    served = evaluate("local-completions", {
        "model": tiny_model_dir.name, "base_url": f"{pipeline.url}/v1/completions",
        "tokenizer": str(tiny_model_dir), "tokenizer_backend": "huggingface", "tokenized_requests": True,
        "num_concurrent": 1, "max_retries": 1,
    })
    hf = evaluate("hf", {"pretrained": str(tiny_model_dir), "dtype": "float32"})

    served_mc, hf_mc = by_doc(served, "pdserve_mc"), by_doc(hf, "pdserve_mc")
    assert len(served_mc) == len(hf_mc) == 8
    gaps = []
    for doc_id, choices in hf_mc.items():
        for (ll_hf, greedy_hf), (ll_pd, greedy_pd) in zip(choices, served_mc[doc_id], strict=True):
            gaps.append(abs(ll_hf - ll_pd))
            assert greedy_hf == greedy_pd
    assert max(gaps) < LOGLIKELIHOOD_TOLERANCE, gaps
    served_gen, hf_gen = by_doc(served, "pdserve_gen"), by_doc(hf, "pdserve_gen")
    assert len(served_gen) == len(hf_gen) == 6
    assert served_gen == hf_gen
    assert any(text[0].strip() for text in hf_gen.values())  # it generated something to compare
    for task, metrics in (("pdserve_mc", ("acc,none", "acc_norm,none")), ("pdserve_gen", ("exact_match,none",))):
        for metric in metrics:
            assert served["results"][task][metric] == hf["results"][task][metric], (task, metric)
    print("lm-eval scores (pdserve = hf):", {t: {m: v for m, v in served["results"][t].items() if "," in m}
                                              for t in TASKS}, "max loglikelihood gap", max(gaps))
