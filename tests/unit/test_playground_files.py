"""The playground's files are served at / and /playground/ (and not with PD_PLAYGROUND off),
and reference nothing outside the package (no CDN: nothing can be fetched at run time)."""

from __future__ import annotations

import re

from services.gateway.playground import STATIC_DIR
from tests.unit.test_gateway import client_for, make, run, texts


def answer(task):
    return texts(task.meta.request_id, ["a"])


def get_all(app, paths):
    async def go():
        async with client_for(app) as c:
            return [await c.get(p) for p in paths]

    return run(go())


def test_playground_is_served_and_can_be_turned_off(tiny_model_dir):
    app, _ = make(tiny_model_dir, answer)
    page, js, css = get_all(app, ["/", "/playground/playground.js", "/playground/playground.css"])
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/playground/playground.js">' in page.text
    assert js.status_code == 200 and "/v1/chat/completions" in js.text and "/debug/timeline/" in js.text
    assert css.status_code == 200
    assert "/" not in app.openapi()["paths"]  # not part of the API schema (nor fuzzed as one)
    off, _ = make(tiny_model_dir, answer, playground=False)
    assert [r.status_code for r in get_all(off, ["/", "/playground/playground.js"])] == [404, 404]


def test_playground_files_reference_nothing_remote():
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"(src|href)\s*=\s*[\"'](https?:)?//", text), path.name
        assert "import(" not in text and "@import" not in text, path.name
