"""The chat page at / in real headless Chromium (Debian's chromium + chromium-driver, which
.ci/run installs): type a message, watch the reply stream in, stop it, start a new chat,
and check the layout wide and phone-narrow. Screenshots go to $FRAWD_SCREENSHOTS when set."""

import os
import shutil
import time
from pathlib import Path

import pytest

from frawdllm.serve import ServeOptions
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)
from serve_helpers import live_server, test_engine
from test_scheduler import varied_model

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
pytestmark = pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(DRIVER).exists()),
                                reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")


@pytest.fixture(scope="module")
def page_server():
    model, tok = varied_model(context_length=1024)
    engine = test_engine(model, tok)
    forward = engine.forward

    def paced_forward(*args):  # ~100 tokens/s: slow enough for a person (and a test) to press stop
        time.sleep(0.01)
        return forward(*args)

    engine.forward = paced_forward
    with live_server({"varied": engine}, ServeOptions(max_tokens=1000)) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def wait_for(condition, timeout=20.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def screenshot(driver, tmp_path, name):
    path = tmp_path / name
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000  # a real picture, not an empty page
    target = os.environ.get("FRAWD_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / name)


@pytest.mark.timeout(120)
def test_chat_page_streams_stops_and_starts_over(page_server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    d = browser
    d.set_window_size(1280, 800)
    d.get(page_server + "/")
    by_id = lambda i: d.find_element(By.ID, i)  # noqa: E731
    wait_for(lambda: by_id("model").get_attribute("value") == "varied", what="the model list")
    by_id("system").send_keys("You answer in letters.")
    max_tokens = by_id("max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("1000")

    by_id("input").send_keys("hello there")
    by_id("send").click()
    reply = lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text  # noqa: E731
    first = wait_for(lambda: reply() if len(reply()) >= 3 else None, what="the reply to start")
    later = wait_for(lambda: reply() if len(reply()) > len(first) + 5 else None, what="more of the reply")
    assert later.startswith(first)  # it grows token by token
    assert by_id("stop").is_enabled() and not by_id("send").is_enabled()
    assert d.find_element(By.CSS_SELECTOR, ".msg.user").text == "hello there"
    screenshot(d, tmp_path, "chat-wide.png")
    by_id("stop").click()
    wait_for(lambda: by_id("send").is_enabled(), what="stop to take effect")
    stopped = reply()
    assert "(stopped)" in stopped and len(stopped) < 1000
    assert "tokens/s" in by_id("stats").text
    time.sleep(0.3)
    assert reply() == stopped  # nothing arrives after stop

    # the server got the request with the page's settings and finished it as cancelled
    # (checked through what it shows: a second message continues the conversation)
    max_tokens.clear()
    max_tokens.send_keys("12")
    by_id("input").send_keys("again")
    by_id("send").click()
    wait_for(lambda: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2 and by_id("send").is_enabled(),
             what="the second reply")
    assert "(stopped at the token limit)" in reply()
    assert len(d.find_elements(By.CSS_SELECTOR, ".msg.user")) == 2

    # the box offers no more than the server's cap (from /v1/models): 5000 typed sends 1000
    assert max_tokens.get_attribute("max") == "1000"
    max_tokens.clear()
    max_tokens.send_keys("5000")
    assert d.execute_script("return maxTokens()") == 1000
    # a refused request shows its error, and is not kept in the conversation sent next time
    # (a page loaded before the server restarted with a lower cap asks too much: a 400)
    assert d.execute_script("return turns.length") == 4
    d.execute_script("document.getElementById('max-tokens').max = 5000")
    by_id("input").send_keys("too much")
    by_id("send").click()
    wait_for(lambda: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 3 and by_id("send").is_enabled(),
             what="the refusal")
    assert "Error: max_tokens is 5000; this server allows at most 1000" in reply()
    assert d.execute_script("return turns.length") == 4
    max_tokens.clear()
    max_tokens.send_keys("12")

    # code blocks are monospace
    html = d.execute_script("return render('see `x`\\n\\n```py\\ndef f():\\n    return 1\\n```');")
    assert "<pre><code>def f():\n    return 1\n</code></pre>" in html and "<code>x</code>" in html

    # phone-narrow: settings fold away behind a button, nothing overflows sideways
    d.set_window_size(390, 844)
    time.sleep(0.3)
    assert not by_id("settings").is_displayed() and by_id("toggle").is_displayed()
    assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    screenshot(d, tmp_path, "chat-narrow.png")
    by_id("toggle").click()
    assert by_id("settings").is_displayed()
    screenshot(d, tmp_path, "chat-narrow-settings.png")

    by_id("new-chat").click()
    assert not d.find_elements(By.CSS_SELECTOR, ".msg")
    assert by_id("empty").is_displayed() and not by_id("settings").is_displayed()
    d.set_window_size(1280, 800)

    # "New chat" while a reply streams: the old reply stays out of the new conversation
    # (the aborted request's cleanup used to push it as the new chat's first turn, unseen)
    max_tokens.clear()
    max_tokens.send_keys("1000")
    by_id("input").send_keys("a question")
    by_id("send").click()
    wait_for(lambda: len(reply()) >= 3, what="the reply to start")
    by_id("new-chat").click()
    wait_for(lambda: by_id("send").is_enabled(), what="the old request to end")
    time.sleep(0.3)
    assert d.execute_script("return turns.length") == 0
    assert not d.find_elements(By.CSS_SELECTOR, ".msg") and by_id("stats").text == "ready"
