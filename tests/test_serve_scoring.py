"""Scoring requests (max_tokens 0 with echo) through a live server: every choice numbered once,
the same checks as generation, no streaming; the model card's cap and a 405's Allow header."""

import httpx
import pytest

from frawdllm.serve import ServeOptions
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)
from serve_helpers import live_server, test_engine
from test_scheduler import varied_model


@pytest.fixture(scope="module")
def url():
    engine = test_engine(*varied_model(context_length=64))
    with live_server({"m": engine}, ServeOptions(max_n=4, max_tokens=50, default_max_tokens=16)) as url:
        yield url


def test_scoring_several_prompts_with_n_numbers_every_choice_once(url):
    """max_tokens 0 with echo, 2 prompts, n=2: choices 0..3 (prompt i's are i*n .. i*n+n-1),
    each "length" (no token was generated: the length limit of 0 ended it, as OpenAI says)."""
    got = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": ["ab", "cd"], "max_tokens": 0,
                                                   "echo": True, "n": 2}, timeout=30)
    assert got.status_code == 200, got.text
    choices = got.json()["choices"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
        (0, "ab", "length"), (1, "ab", "length"), (2, "cd", "length"), (3, "cd", "length")]
    assert got.json()["usage"]["completion_tokens"] == 0


def test_scoring_checks_the_requests_other_fields(url):
    """A scoring request (max_tokens 0, echo) with a field the server refuses (n above its
    cap, an unsupported penalty) is a 400, as the same request generating would be."""
    for bad in ({"n": 5}, {"presence_penalty": 1.0}, {"stop": [""]}):
        got = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 0,
                                                       "echo": True, **bad}, timeout=30)
        assert got.status_code == 400, (bad, got.text)


def test_a_streamed_scoring_request_is_refused(url):
    got = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 0, "echo": True,
                                                   "stream": True}, timeout=30)
    assert got.status_code == 400 and got.json()["error"]["param"] == "max_tokens"


def test_the_model_card_gives_the_servers_cap_on_max_tokens(url):
    card = httpx.get(url + "/v1/models/m").json()
    assert (card["max_tokens"], card["context_length"]) == (50, 64)


def test_a_405_names_the_methods_allowed(url):
    got = httpx.delete(url + "/v1/completions")
    assert got.status_code == 405 and "POST" in got.headers.get("allow", ""), got.headers
    assert got.json()["error"]["type"] == "invalid_request_error"
