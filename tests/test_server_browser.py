"""The chat page in a real browser: Debian's chromium, headless, driven by selenium.

Skips when chromium, chromedriver or selenium is missing (apt-get install chromium chromium-driver;
pip install selenium). Saves a screenshot under the test's tmp dir, and in $MOETIER_ARTIFACTS."""
from __future__ import annotations

import shutil

import pytest

pytest.importorskip("fastapi")

from test_server_support import start_server, artifact  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--window-size=1280,900"]


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM or not DRIVER:
        pytest.skip("chromium and chromedriver are not installed (apt-get install -y chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS:
        opts.add_argument(f)
    drv = webdriver.Chrome(options=opts, service=Service(DRIVER))
    drv.set_page_load_timeout(30)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory, browser):
    srv = start_server(tmp_path_factory, api_key=None)
    yield srv
    srv.stop()


def test_chat_page_streams_a_reply_and_updates_the_tier_panel(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    d = browser
    d.get(server.url + "/")
    wait = WebDriverWait(d, 60)
    by_id = lambda i: d.find_element(By.ID, i)   # noqa: E731
    wait.until(lambda _: "context 512" in by_id("model").text)
    wait.until(lambda _: int(by_id("tiers").get_attribute("data-updated") or 0) >= 1)
    for field, value in (("max_tokens", "40"), ("temperature", "0"), ("system", "You are a tiny model.")):
        el = by_id(field)
        el.clear()
        el.send_keys(value)

    def send(text):
        by_id("input").send_keys(text)
        by_id("send").click()
        wait.until(lambda _: by_id("send").is_displayed() and by_id("stat-finish").text not in ("–", ""))

    send("Hello from the browser")
    replies = d.find_elements(By.CSS_SELECTOR, ".msg.assistant .body")
    assert len(replies) == 1 and replies[0].text.strip(), "the streamed reply is shown"
    assert by_id("stat-finish").text in ("length", "stop")
    assert by_id("stat-tokens").text.endswith("/ 40") or by_id("stat-finish").text == "stop"
    assert by_id("stat-ttft").text.endswith("ms") and by_id("stat-toks").text != "–"
    # the tier panel: one bar per tier and one heat-strip cell per MoE layer (the tiny model has 2)
    wait.until(lambda _: len(d.find_elements(By.CSS_SELECTOR, "#tiers rect.layer")) == 2)
    ram = d.find_element(By.CSS_SELECTOR, '#tiers rect.tier[data-tier="ram"]')
    assert int(ram.get_attribute("data-experts")) == 2 * 7
    before = int(by_id("tiers").get_attribute("data-updated"))

    send("And a second turn")                        # multi-turn: the history stays in the page
    assert len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2
    wait.until(lambda _: int(by_id("tiers").get_attribute("data-updated")) > before)
    assert int(by_id("stat-cached").text) > 0, "the second turn reuses the first turn's KV cache"
    history = d.execute_script("return JSON.parse(localStorage.getItem('moetier.history'))")
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]

    # markdown: fenced code blocks become <pre><code> with a copy button, and HTML is escaped
    html = d.execute_script("return markdown('Try this:\\n```python\\nprint(\"<b>\")\\n```\\nand `x`');")
    assert '<span class="lang">python</span>' in html and "<code>print(&quot;&lt;b&gt;&quot;)</code>" in html
    assert 'class="copy"' in html and "<code>x</code>" in html and "<b>" not in html.replace("&lt;b&gt;", "")

    d.execute_script("document.getElementById('side').scrollTop = 0")
    shot = tmp_path / "chat-page.png"
    d.save_screenshot(str(shot))
    artifact(shot)
    assert shot.stat().st_size > 10_000

    # stop button: a long reply can be stopped, and the page is usable again afterwards
    by_id("max_tokens").clear()
    by_id("input").send_keys("Now talk for a long time")
    by_id("send").click()
    by_id("stop").click() if by_id("stop").is_displayed() else None
    wait.until(lambda _: by_id("send").is_displayed())
    assert by_id("stat-finish").text in ("stopped", "length", "stop")
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
