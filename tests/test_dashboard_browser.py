"""The web dashboard (octo/api_dashboard.py, octo/dashboard/) in a real headless Chromium against a real `octo serve`.

One server holds an echo model (chat, embeddings), the synthetic `demo` model (auto-benchmarked across the installed
engines: the benchmark chart) and a synthetic Whisper checkpoint (transcription). Playwright for Python drives the
system's Debian `chromium` (nothing is downloaded). A screenshot of each view goes to .cache/screenshots/.
The HTTP-level checks (ETag, caching, the open page behind --api-key, the live feed) need no browser.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from serverproc import REPO, run_octo

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = REPO / ".cache" / "screenshots"
KEY = "dash-secret-key-123"
SYSTEM = ("You are a careful assistant. The old lighthouse stood at the edge of the harbor, and every evening the "
          "keeper climbed the narrow stairs to light the lamp.")


def expect(*args, **kw):
    from playwright.sync_api import expect

    return expect(*args, **kw)


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (scripts/system-deps.sh installs Debian's chromium)")
    return sync_playwright


@pytest.fixture(scope="module")
def browser():
    sync_playwright = _playwright()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu",
                                                                 # a fake microphone that needs no permission prompt
                                                                 "--use-fake-ui-for-media-stream",
                                                                 "--use-fake-device-for-media-stream"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def whisper_ckpt():
    pytest.importorskip("whisper")
    from octo.synth.whisper import build_whisper

    return str(build_whisper("test"))


@pytest.fixture(scope="module")
def wav(tmp_path_factory, whisper_ckpt):
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is needed to make speech (scripts/system-deps.sh)")
    from octo.synth.whisper import speech

    return speech("Hello world, this is the dashboard.", tmp_path_factory.mktemp("dash") / "hello.wav")


@pytest.fixture(scope="module")
def server(tmp_path_factory, whisper_ckpt):
    models = [{"model": "test-model", "engine": "echo", "options": {"token_delay_ms": 15}},
              {"model": "demo"},
              {"model": whisper_ckpt, "engine": "whisper",
               "options": {"max_new_tokens": 8, "temperature_increment": 0}}]
    path = tmp_path_factory.mktemp("dash") / "models.yaml"
    path.write_text(json.dumps({"models": models}))
    with run_octo("--models-file", str(path), "--bench-seconds", "0.5", "--share-cores", "turns",
                  env={"HF_HUB_OFFLINE": "1"}, timeout=600) as s:
        yield s


@pytest.fixture
def page(browser, server):
    ctx = browser.new_context(viewport={"width": 1360, "height": 900}, color_scheme="light")
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.goto(server.base_url + "/")
    yield pg
    ctx.close()
    assert not [e for e in errors if "Failed to load resource" not in e], errors


def _shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# -- without a browser ---------------------------------------------------------------------------------------------
def test_static_files_cached_and_the_page_open_behind_the_api_key(tmp_path):
    with run_octo("test-model", "--engine", "echo", api_key=KEY) as s:
        browser = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}  # else "/" answers as Ollama's root does
        status, h, body = _get(s.url("/"), browser)
        assert status == 200 and h["Content-Type"].startswith("text/html") and h["Cache-Control"] == "no-cache"
        assert "default-src 'self'" in h["Content-Security-Policy"]
        assert _get(s.url("/"), {**browser, "If-None-Match": h["ETag"]})[0] == 304
        assets = [line.split('"')[1] for line in body.decode().splitlines() if 'src="/dashboard/' in line]
        assert len(assets) >= 6 and all("?v=" in a for a in assets)
        status, h2, js = _get(s.url(assets[0]))
        assert status == 200 and "immutable" in h2["Cache-Control"] and h2["ETag"]
        assert h2["Content-Type"].startswith("text/javascript") and js
        assert _get(s.url(assets[0]), {"If-None-Match": h2["ETag"]})[0] == 304
        # unknown files: the JSON error shape, never a path outside the folder
        for bad in ("/dashboard/nope.js", "/dashboard/..%2Fapi.py", "/dashboard/api_dashboard.py"):
            status, _, err = _get(s.url(bad))
            assert status in (401, 404) and "error" in json.loads(err), bad
        # the API stays behind the key, the live feed too
        assert _get(s.url("/v1/models"))[0] == 401
        assert _get(s.url("/v1/dashboard/live"))[0] == 401
        assert _get(s.url("/dashboard/live"))[0] == 401  # the prefix-less alias of the feed is no static file


def test_live_feed_samples_every_second_and_counts_requests():
    with run_octo("test-model", "--engine", "echo") as s:
        req = urllib.request.Request(s.url("/v1/dashboard/live"))
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.headers["Content-Type"] == "text/event-stream"
            samples, t0, sent = [], time.monotonic(), False
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                samples.append((time.monotonic(), json.loads(line[6:])))
                if not sent:  # 3 requests between the first two samples
                    for _ in range(3):
                        s.post_json("/v1/chat/completions", {"model": "test-model", "max_tokens": 5, "messages": [
                            {"role": "user", "content": "one two three four five six"}]})
                    sent = True
                if len(samples) >= 4:
                    break
        assert samples[-1][0] - t0 < 8
        rows = [smp["models"]["test-model"] for _, smp in samples]
        assert all(r["state"] == "ready" and r["max_batch"] == 8 for r in rows)
        assert rows[-1]["total_processed"] - rows[0]["total_processed"] == 3
        assert sum(r["rps"] for r in rows[1:]) > 0 and sum(r["tok_s"] for r in rows[1:]) > 0
        assert rows[-1]["cache"]["enabled"] is True


# -- in the browser ------------------------------------------------------------------------------------------------
def test_models_view_and_load_unload(page, server):
    rows = page.locator("#models-table tbody tr")
    page.wait_for_selector('#models-table tr[data-model="test-model"] .badge.s-ready')
    names = rows.evaluate_all("rs => rs.map(r => r.dataset.model)")
    assert {"test-model", "demo"} <= set(names) and any("whisper" in n for n in names)
    demo = page.locator('#models-table tr[data-model="demo"]')
    assert demo.locator("td").nth(3).inner_text() not in ("", "–")  # its engine
    memory = demo.locator("td").nth(4).inner_text()
    assert "(measured)" in memory or "(estimated)" in memory
    _shot(page, "models")
    echo = page.locator('#models-table tr[data-model="test-model"]')
    echo.get_by_role("button", name="Unload test-model").click()
    page.wait_for_selector('#models-table tr[data-model="test-model"] button[aria-label="Load test-model"]',
                           timeout=30_000)
    assert server.get_json("/v1/models/test-model")["state"] != "ready"
    page.get_by_role("button", name="Load test-model").click()
    page.wait_for_selector('#models-table tr[data-model="test-model"] .badge.s-ready', timeout=60_000)
    assert server.get_json("/v1/models/test-model")["state"] == "ready"
    # the view tabs by keyboard: arrows move the selection and the focus
    page.get_by_role("tab", name="Models").focus()
    page.keyboard.press("ArrowRight")
    expect(page.get_by_role("tab", name="Engines")).to_be_focused()
    expect(page.get_by_role("tab", name="Engines")).to_have_attribute("aria-selected", "true")
    assert page.locator("#view-engines").is_visible() and not page.locator("#view-models").is_visible()
    page.keyboard.press("End")
    expect(page.get_by_role("tab", name="Playground")).to_have_attribute("aria-selected", "true")


def test_engines_view_shows_the_benchmark_chart(page, server):
    page.get_by_role("tab", name="Engines").click()
    page.wait_for_selector("#engines-table tbody tr")
    engines = server.get_json("/v1/engines")
    names = page.locator("#engines-table tbody tr td:first-child").all_inner_texts()
    assert set(names) == {e["name"] for e in engines["data"]}
    demo = next(m for m in engines["models"] if m["model"] == "demo")
    bench = page.locator('.bench[data-model="demo"]')
    bench.wait_for()
    measured = [r for r in demo["data"] if r["benchmark"] is not None]
    if len(demo["selection"]["candidates"]) > 1:
        # four SVG bar charts (score, prefill, decode, batched decode), one bar label per candidate, the winner starred
        charts = bench.locator("svg.bars")
        assert charts.count() == 4
        labels = charts.first.locator("text").all_text_contents()
        assert f"★ {demo['active']}" in labels
        assert {r["name"] for r in measured} <= {t.removeprefix("★ ") for t in labels}
        table = bench.locator("tbody tr").all_inner_texts()
        assert any("winner" in t and demo["active"] in t for t in table)
        for r in measured:
            if r["benchmark"]["error"]:
                assert any(r["name"] in t and "failed" in t for t in table)
    _shot(page, "engines")


def test_chat_streams_and_shows_ttft_tok_s_and_cache(page, server):
    page.get_by_role("tab", name="Playground").click()
    page.wait_for_selector('#chat-model option[value="test-model"]', state="attached")
    page.select_option("#chat-model", "test-model")
    page.get_by_label("System prompt").fill(SYSTEM)
    page.get_by_label("Max tokens").fill("40")
    page.get_by_label("Temperature").fill("0")
    # count the updates of the reply as it streams in
    page.evaluate("""() => { window.__seen = new Set(); new MutationObserver(() => {
        const t = document.querySelector('.msg.assistant .text'); if (t) window.__seen.add(t.textContent); }).observe(
        document.getElementById('chat-log'), {subtree: true, childList: true, characterData: true}); }""")
    page.get_by_label("Message").fill("tell me about the harbor and the rocks and the keeper and the lamp")
    page.get_by_label("Message").press("Control+Enter")  # the keyboard path
    meta = page.locator(".msg.assistant .meta").first
    meta.wait_for(timeout=60_000)
    reply = page.locator(".msg.assistant .text").first.inner_text()
    assert reply and reply != "(no text)"
    assert page.evaluate("window.__seen.size") > 3  # the reply grew chunk by chunk, not in one final write
    text = meta.inner_text()
    assert "TTFT" in text and "tok/s" in text and "prefix cache" in text
    # the same system prompt again: the page reports the prefix-cache hit from usage.cached_tokens
    page.get_by_label("Message").fill("and the lighthouse?")
    page.get_by_role("button", name="Send").click()
    second = page.locator(".msg.assistant .meta").nth(1)
    second.wait_for(timeout=60_000)
    assert "prefix cache hit" in second.inner_text()
    # a stop string cuts the reply; JSON mode on a model that cannot constrain: the API's error, shown
    page.get_by_role("button", name="Clear").click()
    page.get_by_label("Stop (one per line)").fill("keeper")
    page.get_by_label("Message").fill("the rocks and the keeper and the lamp")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg.assistant .meta").first).to_contain_text("finish: stop", timeout=60_000)
    assert "keeper" not in page.locator(".msg.assistant .text").first.inner_text()
    page.get_by_label("Stop (one per line)").fill("")
    page.get_by_label("JSON mode").check()
    page.get_by_label("Message").fill("answer in JSON")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#chat-error")).to_contain_text("response_format", timeout=30_000)
    page.get_by_label("JSON mode").uncheck()
    # embeddings: first values and norm
    page.select_option("#emb-model", "test-model")
    page.get_by_label("Text", exact=True).fill("the harbor at night")
    page.get_by_role("button", name="Embed").click()
    page.wait_for_selector("#emb-values")
    want = server.post_json("/v1/embeddings", {"model": "test-model", "input": "the harbor at night"})[1]
    vec = want["data"][0]["embedding"]
    shown = page.locator("#emb-out").inner_text()
    assert f"{len(vec)} dimensions" in shown and f"norm {sum(x * x for x in vec) ** 0.5:.4f}" in shown
    assert f"{vec[0]:.4f}" in page.locator("#emb-values").inner_text()
    _shot(page, "playground")


def test_upload_a_wav_and_see_its_transcription(page, server, wav, whisper_ckpt):
    page.get_by_role("tab", name="Playground").click()
    model = server.get_json(f"/v1/models/{whisper_ckpt}")["id"]
    page.wait_for_selector(f'#stt-model option[value="{model}"]', state="attached")
    # each picker offers the models of its task only: no chat model to transcribe, no speech model to embed
    stt = page.eval_on_selector_all("#stt-model option", "os => os.map(o => o.value)")
    emb = page.eval_on_selector_all("#emb-model option", "os => os.map(o => o.value)")
    assert model in stt and not {"test-model", "demo"} & set(stt), stt
    assert "test-model" in emb and model not in emb, emb  # the echo chat model embeds too (its tasks say so)
    page.select_option("#stt-model", model)
    page.set_input_files("#stt-file", str(wav))
    page.get_by_role("button", name="Transcribe file").click()
    expect(page.locator("#stt-info")).to_contain_text("hello.wav", timeout=120_000)
    shown = page.locator("#stt-text").inner_text()
    with open(wav, "rb") as f:
        want = server.openai().audio.transcriptions.create(model=model, file=f).text
    assert shown.strip() == want.strip()
    # the microphone (Chromium's fake device): record, stop, and the recording is transcribed
    page.get_by_role("button", name="Record").click()
    expect(page.get_by_role("button", name="Stop recording")).to_be_visible()
    page.wait_for_timeout(1500)
    page.get_by_role("button", name="Stop recording").click()
    expect(page.locator("#stt-info")).to_contain_text("recording.", timeout=120_000)
    assert page.locator("#stt-error").inner_text() == ""
    _shot(page, "transcription")


def test_live_view_updates_every_second(page, server):
    page.get_by_role("tab", name="Live").click()
    page.wait_for_selector('#live-table tr[data-model="test-model"]')
    page.wait_for_selector("#live-chart svg path", state="attached", timeout=15_000)
    served = page.locator('#live-table tr[data-model="test-model"] td').last
    before = served.inner_text()
    server.post_json("/v1/chat/completions", {"model": "test-model", "max_tokens": 8, "messages": [
        {"role": "user", "content": "a b c d e f g h"}]})
    expect(served).not_to_have_text(before, timeout=5_000)  # the next sample counts it (one a second)
    for card in ("live-rps", "live-toks", "live-active", "live-queued", "live-occupancy", "live-hit",
                 "live-cache-bytes"):
        assert page.locator(f"#{card} .v").inner_text()
    assert page.locator("#live-age").inner_text() == "live"
    _shot(page, "live")


def test_api_key_prompt(browser):
    with run_octo("test-model", "--engine", "echo", api_key=KEY) as s:
        ctx = browser.new_context(viewport={"width": 1100, "height": 700})
        pg = ctx.new_page()
        urls: list[str] = []
        auth: list[str] = []
        pg.on("request", lambda r: (urls.append(r.url), auth.append(r.headers.get("authorization", ""))))
        pg.goto(s.base_url + "/")
        dialog = pg.locator("#key-dialog")
        dialog.wait_for(state="visible")
        _shot(pg, "api-key")
        pg.get_by_label("Key", exact=True).fill("wrong")
        pg.get_by_label("Key", exact=True).press("Enter")
        expect(pg.locator("#key-error")).to_contain_text("refused")
        pg.get_by_label("Key", exact=True).fill(KEY)
        pg.get_by_role("button", name="Use this key").click()
        pg.wait_for_selector('#models-table tr[data-model="test-model"] .badge.s-ready')
        assert not dialog.is_visible()
        assert f"Bearer {KEY}" in auth
        assert not any(KEY in u for u in urls)
        assert pg.evaluate("sessionStorage.getItem('octo-api-key')") == KEY
        ctx.close()
        assert KEY not in s.log()


def test_engines_view_shows_engines_not_measured_yet(browser, tmp_path):
    import os

    env = {"HF_HUB_OFFLINE": "1", "OCTO_HOME": os.environ["OCTO_HOME"], "OCTO_BENCH_DIR": str(tmp_path / "bench")}
    with run_octo("demo", "--bench-when-idle", env=env, timeout=600) as s:
        engines = s.get_json("/v1/engines")
        if len(engines["selection"]["candidates"]) < 2:
            pytest.skip("one engine can serve the demo here: nothing to measure")
        ctx = browser.new_context(viewport={"width": 1360, "height": 900})
        pg = ctx.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(s.base_url + "/")
        pg.get_by_role("tab", name="Engines").click()
        bench = pg.locator('.bench[data-model="demo"]')
        bench.wait_for()
        table = bench.locator("tbody tr").all_inner_texts()
        labels = bench.locator("svg.bars").first.locator("text").all_text_contents()
        ctx.close()
    active = engines["active"]
    assert any(active in t and "serving, not measured yet" in t for t in table), table
    assert all("not measured yet" in t for t in table), table  # null scores: no bar, no "lost"
    assert "not measured" in " ".join(labels) and not errors, (labels, errors)
