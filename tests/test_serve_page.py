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
def key_server():
    """A server that wants an API key, with a model whose context (64) is below the cap."""
    model, tok = varied_model(context_length=64)
    with live_server({"small": test_engine(model, tok)}, ServeOptions(max_tokens=1000, api_key="s3cret"),
                     sampling={"small": {"temperature": 0.3, "top_p": 0.5, "stop": "x"}}) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,800"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # (the console, for get_log)
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


def console_errors(driver):
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver, url, size=(1280, 800)):
    """The page at `url` in a window of `size`; a function finding an element by its id."""
    from selenium.webdriver.common.by import By

    driver.set_window_size(*size)
    driver.get(url + "/")
    return lambda element_id: driver.find_element(By.ID, element_id)


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
    by_id = open_page(d, page_server)
    wait_for(lambda: by_id("model").get_attribute("value") == "varied", what="the model list")
    time.sleep(0.3)
    assert not console_errors(d)  # (a /favicon.ico 404 was one on every load: the icon is inline)
    assert "on the left" not in by_id("empty").text  # (true on a phone too)
    labels = d.execute_script("return [...document.getElementById('input').labels].map(l => l.textContent)")
    assert labels == ["Message"]
    assert [by_id(i).get_attribute("aria-live") for i in ("thread", "stats")] == ["polite", "polite"]
    by_id("system").send_keys("You answer in letters.")
    max_tokens = by_id("max-tokens")

    # the box's number is what is sent (1e3 is 1000), rounded and clamped to 1..cap, which the box says
    for typed, sent, note in [("1e3", 1000, ""), ("0", 1, "at least 1"), ("-5", 1, "at least 1"),
                              ("2.7", 3, "whole tokens"), ("99999", 1000, "at most 1000"), ("", 200, "default")]:
        max_tokens.clear()
        max_tokens.send_keys(typed)
        assert d.execute_script("return maxTokens()") == sent, typed
        assert note in by_id("max-tokens-note").text and (note == "") == (not by_id("max-tokens-note").is_displayed())
        assert max_tokens.get_attribute("aria-invalid") == ("true" if note else "false")
    max_tokens.send_keys("99999")
    by_id("system").click()  # leaving the box puts what will be sent in it
    assert max_tokens.get_attribute("value") == "1000" and "99999 → at most 1000" in by_id("max-tokens-note").text
    assert max_tokens.get_attribute("aria-invalid") == "false"

    # Enter that ends an IME composition (isComposing, or keyCode 229 on some browsers) sends nothing
    by_id("input").send_keys("日本")
    for init in ("{key: 'Enter', isComposing: true}", "{key: 'Enter', keyCode: 229}"):
        d.execute_script(f"document.getElementById('input').dispatchEvent("
                         f"new KeyboardEvent('keydown', {{...{init}, bubbles: true, cancelable: true}}))")
    time.sleep(0.2)
    assert not d.find_elements(By.CSS_SELECTOR, ".msg") and by_id("input").get_attribute("value") == "日本"
    by_id("input").clear()
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
    assert by_id("stats").text.startswith("request failed: max_tokens is 5000")  # (not "0 tokens · – tokens/s")
    # ...and reads the server's models and caps again (a reload, which loses the chat, was the only way)
    wait_for(lambda: max_tokens.get_attribute("max") == "1000", what="the caps read again")
    assert by_id("stats").text.startswith("request failed: max_tokens is 5000")
    max_tokens.clear()
    max_tokens.send_keys("12")

    # code blocks are monospace
    html = d.execute_script("return render('see `x`\\n\\n```py\\ndef f():\\n    return 1\\n```');")
    assert "<pre><code>def f():\n    return 1\n</code></pre>" in html and "<code>x</code>" in html
    # a fence's first line is a language tag only when it looks like one: code right after ``` stays
    fences = {"```x = 1\ny = 2\n```": "x = 1\ny = 2\n", "a ```inline code``` b": "inline code",
              "```c++\nint x;\n```": "int x;\n", "```\nplain\n```": "plain\n"}
    for text, code in fences.items():
        assert f"<pre><code>{code}</code></pre>" in d.execute_script("return render(arguments[0])", text), text

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


# a fetch that serves the reply's first chunks, then fails as a dropped connection does
CUT_FETCH = """
window.realFetch = window.realFetch || window.fetch;
window.fetch = async (url, init) => {
  const response = await window.realFetch(url, init);
  if (!String(url).includes('/chat/')) return response;
  const reader = response.body.getReader();
  let chunks = 0;
  const body = new ReadableStream({async pull(c) {
    const {value, done} = await reader.read();
    if (done || ++chunks > 4) { reader.cancel(); c.error(new TypeError('network error')); } else c.enqueue(value);
  }});
  return new Response(body, {status: response.status, headers: response.headers});
};"""


@pytest.mark.timeout(120)
def test_chat_page_scrolls_only_the_messages_and_keeps_a_cut_reply(page_server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    d = browser
    by_id = open_page(d, page_server)
    js = d.execute_script
    wait_for(lambda: by_id("model").get_attribute("value") == "varied", what="the model list")
    # a conversation far longer than the window
    js("for (let i = 0; i < 20; i++) { bubble('user', 'question ' + i); "
       "bubble('assistant', ('An answer that goes on. ').repeat(40) + '\\n\\n```\\ncode ' + i + '\\n```'); }")
    rects = lambda: js("return ['header', 'composer', 'stop'].map(s => "  # noqa: E731
                       "(document.getElementById(s) || document.querySelector(s)).getBoundingClientRect().top)")
    fixed = rects()
    at_bottom = lambda: js("return nearBottom()")  # noqa: E731
    top = lambda: js("return document.getElementById('messages').scrollTop")  # noqa: E731
    reply = lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text  # noqa: E731
    max_tokens = by_id("max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("1000")
    by_id("input").send_keys("go on", Keys.ENTER)
    first = wait_for(lambda: reply() if len(reply()) >= 3 else None, what="the reply to start")
    wait_for(lambda: len(reply()) > len(first) + 20, what="more of the reply")
    # only #messages scrolls: the page does not, header, input and Stop stay where they were
    assert js("return document.scrollingElement.scrollHeight <= window.innerHeight && window.scrollY === 0")
    assert js("const m = document.getElementById('messages'); return m.scrollHeight > 3 * m.clientHeight")
    assert rects() == fixed and fixed[2] < 800
    assert at_bottom()  # the view follows the stream
    screenshot(d, tmp_path, "long-wide.png")
    # scrolled up, the reader stays there while the reply grows; back at the bottom it follows again
    js("document.getElementById('messages').scrollTop = 100")
    now = reply()
    wait_for(lambda: len(reply()) > len(now) + 20, what="the reply to grow")
    assert top() == 100 and not at_bottom()
    js("toBottom()")
    now = reply()
    wait_for(lambda: len(reply()) > len(now) + 20, what="the reply to grow")
    assert at_bottom()

    d.set_window_size(390, 844)  # the same on a phone
    time.sleep(0.3)
    assert js("return document.scrollingElement.scrollHeight <= window.innerHeight && window.scrollY === 0")
    assert js("return document.documentElement.scrollWidth <= window.innerWidth")
    assert 0 < rects()[1] < 844 and by_id("stop").is_displayed()
    js("toBottom()")
    time.sleep(0.2)
    screenshot(d, tmp_path, "long-narrow.png")
    # Stop, focused, turns disabled: the focus goes to the message box, not to the page
    by_id("stop").click()
    wait_for(lambda: by_id("send").is_enabled(), what="stop to take effect")
    assert js("return document.activeElement.id") == "input"
    d.set_window_size(1280, 800)

    # a connection lost mid-reply: the text so far stays, marked cut short, and in the conversation
    js(CUT_FETCH)
    turns = js("return turns.length")
    by_id("input").send_keys("once more")
    by_id("send").click()
    assert js("return document.activeElement.id") == "input"  # (Send turned disabled under the focus)
    wait_for(lambda: by_id("send").is_enabled() and by_id("stop").get_attribute("disabled"), what="the cut reply")
    last = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    note = last.find_element(By.CSS_SELECTOR, ".note")
    assert note.is_displayed() and note.text.startswith("connection lost: network error")
    partial = js("return turns[turns.length - 1]")
    assert partial["role"] == "assistant" and partial["content"] and reply().startswith(partial["content"][:20])
    assert js("return turns.length") == turns + 2
    assert "connection lost" in by_id("stats").text
    screenshot(d, tmp_path, "cut-reply.png")
    # nothing came back at all: the error, not kept, and the header says the request failed
    # (the server stopped: Chrome's "Failed to fetch" was all it said, and the model list's
    # reload, failing too, put "models: Failed to fetch" in the header)
    js("window.fetch = (url, init) => Promise.reject(new TypeError('Failed to fetch'))")
    by_id("input").send_keys("and again", Keys.ENTER)
    unreachable = "could not reach the server (is frawd serve still running?)"
    wait_for(lambda: f"Error: {unreachable}" in reply(), what="the error")
    time.sleep(0.3)  # (the model list's reload has failed by now)
    assert by_id("stats").text == f"request failed: {unreachable}" and js("return turns.length") == turns + 2
    # the server restarted with another model: a 404 for the chosen one makes the page read the list again
    js("window.fetch = (url, init) => String(url).includes('/chat/') ? Promise.resolve(new Response("
       "JSON.stringify({error: {message: 'the model does not exist'}}), {status: 404})) : "
       "String(url).includes('/v1/models') ? Promise.resolve(new Response(JSON.stringify({data: [{id: 'bard', "
       "context_length: 64, max_tokens: 50}]}), {status: 200})) : window.realFetch(url, init)")
    by_id("input").send_keys("hello?", Keys.ENTER)
    wait_for(lambda: by_id("model").get_attribute("value") == "bard", what="the model list read again")
    assert by_id("stats").text == "request failed: the model does not exist"
    assert by_id("max-tokens").get_attribute("max") == "50"
    # a request that waits for its first token: the header shows this one (not the last reply's
    # figures); Stop before any token keeps nothing in the conversation, and says so
    js("window.fetch = (url, init) => String(url).includes('/chat/') ? new Promise((_, reject) => "
       "init.signal.addEventListener('abort', () => reject(new DOMException('stopped', 'AbortError')))) : "
       "window.realFetch(url, init)")
    by_id("input").send_keys("wait for it", Keys.ENTER)
    wait_for(lambda: by_id("stop").is_enabled(), what="the request")
    assert by_id("stats").text == "0 tokens · – tokens/s · first token …"
    by_id("stop").click()
    wait_for(lambda: by_id("send").is_enabled(), what="the stop")
    assert by_id("stats").text == "stopped before the first token" and js("return turns.length") == turns + 2
    assert reply() == "(stopped before a reply: not kept in the conversation)"
    js("window.fetch = window.realFetch")
    # text: no empty line after a code block; the user's own ``` code in monospace too (escaped
    # like the model's); right-to-left text laid out right to left
    assert js("return render('Text:\\n```py\\ncode\\n```\\nMore text')") == \
        "<p>Text:</p><pre><code>code\n</code></pre><p>More text</p>"
    by_id("input").send_keys("see", Keys.SHIFT, Keys.ENTER, Keys.NULL, "```", Keys.SHIFT, Keys.ENTER, Keys.NULL,
                             "<b>x</b>", Keys.SHIFT, Keys.ENTER, Keys.NULL, "```", Keys.ENTER)
    mine = wait_for(lambda: d.find_elements(By.CSS_SELECTOR, ".msg.user")[-1], what="the message")
    code = mine.find_element(By.CSS_SELECTOR, "pre code")
    assert code.text == "<b>x</b>" and "monospace" in code.value_of_css_property("font-family")
    assert mine.get_attribute("dir") == "auto" and by_id("input").get_attribute("dir") == "auto"
    wait_for(lambda: by_id("send").is_enabled(), timeout=60, what="the reply")


@pytest.mark.timeout(120)
def test_chat_page_asks_for_the_api_key_and_its_panel_works_by_keyboard(key_server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    d = browser
    by_id = open_page(d, key_server, (390, 844))  # on a phone, where the key box is in the folded panel
    js = d.execute_script
    wait_for(lambda: by_id("stats").text == "API key needed", what="the 401")
    assert not by_id("settings").is_displayed() and by_id("toggle").get_attribute("aria-expanded") == "false"
    screenshot(d, tmp_path, "key-needed-narrow.png")
    assert by_id("enter-key").is_displayed() and d.execute_script(  # (not cut off by the header's width)
        "return document.getElementById('enter-key').getBoundingClientRect().right") <= 390
    by_id("enter-key").click()  # the message leads to the key box
    assert by_id("settings").is_displayed() and by_id("toggle").get_attribute("aria-expanded") == "true"
    assert js("return document.activeElement.id") == "api-key"
    # A key no header can carry: fetch threw "non ISO-8859-1 code point" into the header
    console_errors(d)  # (read, so only what follows counts: the browser is shared with earlier tests)
    by_id("api-key").send_keys("sé", Keys.TAB)
    wait_for(lambda: by_id("stats").text == "API key not accepted (keys are ASCII)", what="the 401 for 'sé'")
    assert not [e for e in console_errors(d) if "401" not in e]  # (the 401s themselves are logged)
    by_id("api-key").clear()
    by_id("api-key").send_keys("s3cret", Keys.TAB)
    wait_for(lambda: by_id("model").get_attribute("value") == "small", what="the model list")
    assert by_id("stats").text == "ready" and not by_id("enter-key").is_displayed()  # the key message goes
    assert by_id("max-tokens").get_attribute("max") == "64"  # the context (64) is below the server's cap (1000)
    # the sliders start from the model's generation_config.json (they stayed at the page's 0.7 and 0.95)
    assert [by_id(i).get_attribute("value") for i in ("temperature", "top-p")] == ["0.3", "0.5"]
    assert [by_id(i + "-value").text for i in ("temperature", "top-p")] == ["0.3", "0.5"]
    ActionChains(d).send_keys(Keys.ESCAPE).perform()  # Escape folds the panel, back to its button
    assert not by_id("settings").is_displayed() and by_id("toggle").get_attribute("aria-expanded") == "false"
    assert js("return document.activeElement.id") == "toggle"
    by_id("toggle").click()  # opened, the focus goes into it
    assert by_id("settings").is_displayed() and js("return document.activeElement.id") == "model"
    by_id("close-settings").click()
    assert not by_id("settings").is_displayed() and js("return document.activeElement.id") == "toggle"
    js("localStorage.clear()")


@pytest.fixture(scope="module")
def models_server():
    """Two models: "own" with its own temperature and top-p off the sliders' steps, "plain" without."""
    model, tok = varied_model(context_length=64)
    engines = {"own": test_engine(model, tok), "plain": test_engine(model, tok)}
    with live_server(engines, ServeOptions(max_tokens=1000),
                     sampling={"own": {"temperature": 0.33, "top_p": 0.01}}) as url:
        yield url


# Records each chat request's body in window.sent, and answers with window.answer(body) where
# that is set: {status, events} (events: the SSE data lines), else the real server does.
RECORD_FETCH = """
window.realFetch = window.realFetch || window.fetch;
window.sent = [];
window.fetch = async (url, init) => {
  if (!String(url).includes('/chat/')) return window.realFetch(url, init);
  const body = JSON.parse(init.body);
  window.sent.push(body);
  if (!window.answer) return window.realFetch(url, init);
  const {status, events} = window.answer(body);
  if (status !== 200) return new Response(JSON.stringify({error: {message: 'refused ' + status}}), {status});
  return new Response(events.map((e) => 'data: ' + e + '\\n\\n').join(''), {status: 200});
};"""


def sse_reply(text: str, tokens: int) -> str:
    """window.answer's events for a reply of `text` in `tokens` pieces."""
    return (f"({{status: 200, events: Array({tokens}).fill(JSON.stringify({{choices: [{{index: 0, delta: {{content: "
            f"{text!r}}}}}]}})).concat([JSON.stringify({{choices: [{{index: 0, delta: {{}}, finish_reason: 'stop'}}]}}), "
            f"'[DONE]'])}})")


@pytest.mark.timeout(120)
def test_chat_page_sends_the_models_own_sampling_and_keeps_long_chats_going(models_server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    d = browser
    by_id = open_page(d, models_server)
    js = d.execute_script
    wait_for(lambda: by_id("model").get_attribute("value") == "own", what="the model list")
    js("localStorage.clear()")
    js(RECORD_FETCH)
    reply = lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text  # noqa: E731

    def ask(text):
        count = js("return window.sent.length")
        by_id("input").send_keys(text, Keys.ENTER)
        wait_for(lambda: js("return window.sent.length") > count and by_id("send").is_enabled(), what="the reply")
        return js("return window.sent[window.sent.length - 1]")

    # the model's own 0.33 and 0.01 are shown as they are and left to the server, which applies
    # them exactly: the sliders' steps and range made them 0.35 and 0.05, and those were sent
    assert [by_id(i + "-value").text for i in ("temperature", "top-p")] == ["0.33", "0.01"]
    sent = ask("hello")
    assert "temperature" not in sent and "top_p" not in sent and sent["max_tokens"] == 64
    js("const t = document.getElementById('temperature'); t.value = 1.2; t.dispatchEvent(new Event('input'))")
    sent = ask("again")
    assert sent["temperature"] == 1.2 and "top_p" not in sent and by_id("temperature-value").text == "1.2"
    # a model without its own: the page's, not the last model's (temperature 1.2 went on)
    js("const m = document.getElementById('model'); m.value = 'plain'; m.dispatchEvent(new Event('change'))")
    assert [by_id(i + "-value").text for i in ("temperature", "top-p")] == ["0.7", "0.95"]
    sent = ask("plain now")
    assert (sent["temperature"], sent["top_p"]) == (0.7, 0.95)

    by_id("new-chat").click()
    # an empty reply says so, and the header does not wait for a first token that never comes
    js("window.answer = () => ({status: 200, events: [JSON.stringify({choices: [{index: 0, delta: {content: ''}, "
       "finish_reason: 'stop'}], usage: {prompt_tokens: 3, completion_tokens: 1, total_tokens: 4}}), '[DONE]']})")
    ask("say nothing")
    assert reply() == "(an empty reply)" and not by_id("stats").text.endswith("…"), by_id("stats").text
    # a conversation grown past the server's --max-body (413): the oldest exchanges are left out
    # and the note says so (every later message failed with 413); a message too large alone
    # fails without dropping any
    js(f"window.answer = (body) => body.messages.length > 3 ? {{status: 413}} : {sse_reply('fine', 2)}")
    ask("second")
    assert js("return turns.length") == 4
    sent = ask("third")
    assert [m["content"] for m in sent["messages"]] == ["second", "finefine", "third"]
    assert reply() == "finefine\n(the 2 oldest messages were left out: the conversation was larger than the server accepts)"
    js("window.answer = () => ({status: 413})")
    ask("far too long")
    assert reply() == "Error: refused 413 (shorten the message)" and js("return turns.length") == 4

    # the reply is drawn once per frame, not once per token: 2,000 tokens in one read drew 2,000
    # times, the cost growing as the square of the reply's length
    by_id("new-chat").click()
    js("window.draws = 0; const real = render; render = (...a) => { window.draws += 1; return real(...a); }")
    js(f"window.answer = () => {sse_reply('word ', 2000)}")
    ask("go")
    assert reply().strip() == ("word " * 2000).strip() and js("return window.draws") < 100, js("return window.draws")
    # a lone ``` in finished text is shown as typed, not as the start of an empty code block;
    # in text still streaming it starts one; a user's one-line message is one line high
    assert js("return render('see ``` here')") == "<p>see ``` here</p>"
    assert js("return render('see ```py\\nx = 1', true)") == "<p>see </p><pre><code>x = 1</code></pre>"
    js("window.answer = null")
    by_id("new-chat").click()
    by_id("input").send_keys("hi", Keys.ENTER)
    mine = wait_for(lambda: d.find_elements(By.CSS_SELECTOR, ".msg.user"), what="the message")[-1]
    line = float(mine.find_element(By.CSS_SELECTOR, "p").value_of_css_property("line-height").rstrip("px"))
    assert mine.size["height"] < line + 2 * 10 + 2 * 1 + 8, mine.size  # its padding, no paragraph margins
    wait_for(lambda: by_id("send").is_enabled(), timeout=60, what="the reply")
    screenshot(d, tmp_path, "models.png")
    js("window.fetch = window.realFetch")
