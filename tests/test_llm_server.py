"""tessera serve's OpenAI-compatible server, driven by the real `openai` client.

One uvicorn server per module, in a thread, on a free localhost port, serving a tiny Llama
(tests/tiny_llm.py) through the real engine.  Situations a test must force (an overload, an
engine error) slow down or break the real engine's `step` for a moment instead of faking it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from tiny_llm import make_model_dir  # noqa: E402

from tessera.cli import main  # noqa: E402
from tessera.llm.llm import LLM  # noqa: E402
from tessera.llm.server.api import build_app  # noqa: E402

pytestmark = pytest.mark.xdist_group("llm-server")  # one worker, one server (--dist loadgroup)

MODEL = "tiny-llama"
KEY = "test-key"
MAX_MODEL_LEN = 256
MAX_QUEUE = 20
MAX_BODY = 1 << 20
PROMPTS = ["The quick brown fox", "Hello, how are you", "A paged KV cache keeps", "Once upon a time there",
           "Numbers like 12345", "The user asks a question", "Continuous batching admits", "Café, naïve, über",
           "The lazy dog", "I am fine, thank", "Keys and values in", "A little compiler that",
           "Symbols: #, $", "The assistant answers", "New requests at every", "Words with characters"]  # fmt: skip


class Served:
    """The running server: its URL, its app (whose state holds the AsyncLLMEngine) and clients."""

    def __init__(self, url: str, app, model_dir: Path):
        self.url, self.app, self.model_dir = url, app, model_dir
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)

    @property
    def engine(self):
        return self.app.state.engine

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}  # fmt: skip

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """The metrics once no request is in flight and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["tessera_queue_length"] == 0 and m["tessera_kv_blocks_used"] == 0 and m["tessera_requests_running"] == 0:
                return m
            assert time.monotonic() < deadline, f"the server did not go idle: {m}"
            time.sleep(0.05)


@pytest.fixture(scope="module", autouse=True)
def module_cache(shared_cache_dir):
    """The run's artifact cache set for the whole module, not per test as conftest sets it: the
    server's engine thread builds kernels when a test first needs them, between tests too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE_DIR", str(shared_cache_dir))
        mp.setenv("TESSERA_TUNE", "0")
        yield shared_cache_dir


@pytest.fixture(scope="module")
def served(tmp_path_factory, module_cache):
    root = tmp_path_factory.mktemp("llm-server")
    model_dir = make_model_dir(root / "model", "llama")
    llm = LLM(model_dir, device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
    app = build_app(llm.engine, MODEL, api_key=KEY, max_queue=MAX_QUEUE, max_body_bytes=MAX_BODY)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    served = Served(f"http://127.0.0.1:{sock.getsockname()[1]}", app, model_dir)
    greedy(served, PROMPTS[0])  # the engine builds its kernels here, not in the first test
    yield served
    server.should_exit = True
    thread.join(30)
    sock.close()


@pytest.fixture(scope="module")
def reference(served):
    """transformers' own model and tokenizer from the same directory."""
    model = transformers.AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(served.model_dir)


@contextlib.contextmanager
def slowed(served, seconds: float):
    """The real engine with each step taking `seconds` longer (so a request is surely still
    running when the client leaves)."""
    engine = served.engine.engine
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step
    try:
        yield
    finally:
        engine.step = step


def greedy(served, prompt, max_tokens: int = 12, **extra):
    return served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra)


def post(served, path: str, body, key: str | None = KEY, timeout: float | httpx.Timeout = 60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{served.url}{path}", content=content, headers={**headers, "Content-Type": "application/json"},
                      timeout=timeout)  # fmt: skip


def test_health_models_and_metrics(served):
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}  # open without the key
    models = served.client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert served.client.models.retrieve(MODEL).id == MODEL
    greedy(served, "Hello")
    m = served.metrics()
    for name in ("requests_total", "requests_running", "requests_waiting", "queue_length", "prompt_tokens_total",
                 "generation_tokens_total", "generation_tokens_per_second", "kv_blocks_used", "kv_blocks_total",
                 "preemptions_total"):  # fmt: skip
        assert f"tessera_{name}" in m, name
    assert m["tessera_requests_total"] >= 1 and m["tessera_generation_tokens_total"] >= 1
    assert m["tessera_kv_blocks_total"] > 0 and m["tessera_queue_limit"] == MAX_QUEUE
    text = httpx.get(f"{served.url}/metrics").text
    assert f'tessera_kv_blocks_used{{model_name="{MODEL}"}}' in text and "# TYPE tessera_requests_total counter" in text


def test_completion_equals_transformers_generate(served, reference):
    model, tokenizer = reference
    for prompt in PROMPTS[:3]:
        out = greedy(served, prompt, max_tokens=32)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
        assert out.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True), prompt
        assert out.usage.prompt_tokens == ids.shape[1] and out.usage.completion_tokens == len(ref)
        assert out.usage.total_tokens == ids.shape[1] + len(ref)
        assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
        assert out.choices[0].finish_reason == ("length" if len(ref) == 32 else "stop")


def test_prompt_forms_and_n(served):
    tokenizer = transformers.AutoTokenizer.from_pretrained(served.model_dir)
    text = greedy(served, PROMPTS[0]).choices[0].text
    assert greedy(served, tokenizer(PROMPTS[0]).input_ids).choices[0].text == text  # token ids
    out = greedy(served, [PROMPTS[0], PROMPTS[1]], n=2)  # two prompts, two samples each
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text == text
    assert out.choices[2].text == out.choices[3].text == greedy(served, PROMPTS[1]).choices[0].text
    ids = [tokenizer(p).input_ids for p in PROMPTS[:2]]
    assert [c.text for c in greedy(served, ids).choices] == [c.text for c in out.choices[::2]]


def test_chat(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you?"}]
    out = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    # The chat template's tokens, completed as a plain prompt, give the same text.
    tokenizer = transformers.AutoTokenizer.from_pretrained(served.model_dir)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert out.usage.prompt_tokens == len(ids)
    assert choice.message.content == greedy(served, ids).choices[0].text
    # Content as a list of text parts is the same message.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "how are you?"}]}]
    plain = [{"role": "user", "content": "Hello, how are you?"}]
    a, b = (served.client.chat.completions.create(model=MODEL, messages=m, max_tokens=8, temperature=0) for m in (parts, plain))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_streaming_completion(served):
    expected = greedy(served, PROMPTS[1], max_tokens=24)
    chunks = list(served.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # On the wire: SSE events, [DONE] last.
    with httpx.stream("POST", f"{served.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "stream": True}) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_streaming_several_prompts_and_samples(served):
    kwargs = dict(model=MODEL, prompt=PROMPTS[3:5], max_tokens=12, temperature=0.8, seed=7, n=2)
    expected = served.client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    finish: dict[int, list[str]] = {}
    for chunk in served.client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish.setdefault(c.index, []).append(c.finish_reason)
    assert texts == {c.index: c.text for c in expected.choices}  # seeded: the same samples
    assert finish == {c.index: [c.finish_reason] for c in expected.choices}  # each ends once
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, n=2, seed=3)
    expected = served.client.chat.completions.create(**chat)
    content: dict[int, str] = {}
    for chunk in served.client.chat.completions.create(**chat, stream=True):
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
    assert content == {c.index: c.message.content for c in expected.choices}


def test_stop_and_seed(served):
    text = greedy(served, PROMPTS[5], max_tokens=20).choices[0].text
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].isalnum())
    out = greedy(served, PROMPTS[5], max_tokens=20, stop=["no such text", stop])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == text[: text.index(stop)]
    sampled = [served.client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=10, temperature=1.0,
                                                seed=1234).choices[0].text for _ in range(2)]  # fmt: skip
    assert sampled[0] == sampled[1]


def test_streaming_chat(served):
    messages = [{"role": "user", "content": "Tell me about the fox."}]
    expected = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == expected.usage.total_tokens


def test_logprobs(served):
    out = greedy(served, PROMPTS[2], max_tokens=10, logprobs=3)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy takes the likeliest
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # Streamed, the chunks' log-probabilities add up to the same list.
    chunks = list(served.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                                   logprobs=3, stream=True))  # fmt: skip
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)
    # Chat: logprobs true with top_logprobs alternatives.
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_concurrent_requests_equal_one_at_a_time(served):
    alone = [greedy(served, p, max_tokens=16).choices[0].text for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: greedy(served, p, max_tokens=16).choices[0].text, PROMPTS))
    assert together == alone
    served.wait_idle()


def test_over_length_prompt_is_400(served):
    with pytest.raises(openai.BadRequestError) as err:
        greedy(served, "The quick brown fox " * 100)
    assert err.value.status_code == 400 and "context length" in err.value.message
    body = err.value.body
    assert body["type"] == "invalid_request_error" and "message" in body
    with pytest.raises(openai.BadRequestError, match="context length"):
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fox " * 300}])
    # One prompt of several too long: 400, and the others are not left running.
    with pytest.raises(openai.BadRequestError, match="context length"):
        greedy(served, ["Hello", "The quick brown fox " * 100], max_tokens=200, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError, match="context length"):
        served.client.completions.create(model=MODEL, prompt="The quick brown fox " * 100, stream=True)
    served.wait_idle()


@pytest.mark.parametrize("field", [{"temperature": -1}, {"top_p": 2}, {"n": 0}, {"max_tokens": 0}, {"top_k": -5},
                                   {"presence_penalty": 3}, {"max_tokens": "many"}, {"logprobs": 50},
                                   {"echo": True}, {"logit_bias": {"5": 1.0}}])  # fmt: skip
def test_bad_parameter_is_400(served, field):
    r = post(served, "/v1/completions", {"model": MODEL, "prompt": "Hello", **field})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"]


def test_malformed_bodies_are_400(served):
    for body in (b"{not json", b"[1, 2]", {"prompt": "no model"}, {"model": MODEL}, {"model": MODEL, "prompt": 5}):
        r = post(served, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)
    r = post(served, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    # Bodies past the bound: 413 from Content-Length, 400 when a chunked body outgrows it.
    big = {"model": MODEL, "prompt": "x" * MAX_BODY}
    r = post(served, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    chunked = httpx.post(f"{served.url}/v1/completions", content=iter([json.dumps(big).encode()]),
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})  # fmt: skip
    assert chunked.status_code == 400, chunked.text
    # Unknown fields are ignored (as vLLM does); vLLM's extras are taken.
    r = post(served, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "no_such_field": 1,
                                         "top_k": 5, "ignore_eos": True, "min_tokens": 3})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_unknown_model_is_400(served):
    with pytest.raises(openai.BadRequestError) as err:
        served.client.completions.create(model="gpt-4", prompt="Hello", max_tokens=2)
    assert err.value.code == "model_not_found" and MODEL in err.value.message


def test_api_key(served):
    for key in (None, "wrong"):
        r = post(served, "/v1/completions", {"model": MODEL, "prompt": "Hi"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{served.url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {}).status_code == 401
    bad = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert httpx.get(f"{served.url}/metrics").status_code == 200


def test_dropped_stream_frees_its_blocks(served):
    before = served.wait_idle()
    body = {"model": MODEL, "prompt": "Once", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True}
    with slowed(served, 0.02), httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60,
                                            headers={"Authorization": f"Bearer {KEY}"}) as r:  # fmt: skip
        lines = r.iter_lines()
        events = [line for line in (next(lines) for _ in range(6)) if line]
        assert events and served.metrics()["tessera_kv_blocks_used"] > 0
        r.close()
        # The connection is closed: the request is aborted, its blocks freed, long before it could finish.
        after = served.wait_idle()
    assert after["tessera_generation_tokens_total"] - before["tessera_generation_tokens_total"] < body["max_tokens"]
    assert greedy(served, "Hello").choices[0].text  # and the server goes on


def test_dropped_request_frees_its_blocks(served):
    before = served.wait_idle()
    body = {"model": MODEL, "prompt": "Once", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True}
    start = time.monotonic()
    with slowed(served, 0.02):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting and closes the connection
            post(served, "/v1/completions", body, timeout=httpx.Timeout(60, read=0.2))
        after = served.wait_idle()
    print(f"aborted after {time.monotonic() - start:.2f} s")
    assert after["tessera_generation_tokens_total"] - before["tessera_generation_tokens_total"] < body["max_tokens"]


def test_overload_is_503_and_the_server_recovers(served):
    served.wait_idle()
    engine = served.engine.engine
    gate = threading.Event()
    step = engine.step

    def slow_step():  # the real step, held until the gate opens
        gate.wait(60)
        return step()

    engine.step = slow_step
    try:
        with ThreadPoolExecutor(MAX_QUEUE) as pool:
            held = [pool.submit(greedy, served, p, 4) for p in (PROMPTS * 2)[:MAX_QUEUE]]
            deadline = time.monotonic() + 30
            while served.metrics()["tessera_queue_length"] < MAX_QUEUE:
                assert time.monotonic() < deadline and not any(f.done() for f in held)
                time.sleep(0.05)
            with pytest.raises(openai.APIStatusError) as err:
                greedy(served, "one too many")
            assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
            assert served.metrics()["tessera_requests_rejected_total"] >= 1
            gate.set()
            assert all(f.result(timeout=120).choices[0].text is not None for f in held)
    finally:
        gate.set()
        engine.step = step
    served.wait_idle()
    assert greedy(served, "Hello").choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("where", ["step", "forward"])
def test_engine_error_is_500_and_the_server_goes_on(served, where):
    """A failure anywhere in a step (the engine's own loop, or the model's forward, which the
    engine turns into a StepFailure of that step's requests) is a 500, and serving goes on."""
    owner = served.engine.engine if where == "step" else served.engine.engine.runner
    name = "step" if where == "step" else "execute"
    original = getattr(owner, name)

    def fail_once(*args):
        setattr(owner, name, original)
        raise RuntimeError("injected failure")

    setattr(owner, name, fail_once)
    try:
        with pytest.raises(openai.InternalServerError, match="injected failure"):
            greedy(served, "Hello")
    finally:
        setattr(owner, name, original)
    served.wait_idle()
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert greedy(served, "Hello").choices[0].text is not None
    assert served.metrics()["tessera_requests_failed_total"] >= 1


def test_serve_a_missing_directory(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "no-such-model"), "--device", "cpu"]) == 1
    assert "tessera serve: cannot serve" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_without_fastapi_names_the_extra():
    code = "import sys; sys.modules['fastapi'] = None; from tessera.cli import main; sys.exit(main(['serve', 'x']))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert r.returncode == 1 and 'pip install "tessera[serve]"' in r.stderr


@pytest.mark.slow
def test_tessera_serve_command(served, tmp_path):
    """The command line, with its API key from $TESSERA_API_KEY."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "TESSERA_API_KEY": "env-key"}
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(served.model_dir), "--port", str(port),
                             "--device", "cpu", "--max-model-len", "128", "--served-model-name", "cli-model"],
                            cwd=Path(__file__).resolve().parents[1], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tessera serve did not come up"
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="env-key", max_retries=0)
        assert client.models.retrieve("cli-model").max_model_len == 128
        out = client.completions.create(model="cli-model", prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert out.choices[0].text == greedy(served, PROMPTS[0]).choices[0].text
    except BaseException:
        print(log.read_text())  # the server's side of a failure
        raise
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_dead_engine_thread_is_reported(served):
    """An engine that cannot be stepped or emptied stops its thread: the request in flight gets 500,
    /health 503, later requests 500 at once (a second engine, so the module's server lives on)."""
    llm = LLM(served.model_dir, device="cpu", max_model_len=64)
    engine = llm.engine

    def broken_step():
        raise RuntimeError("device lost")

    engine.step = broken_step
    engine.abort_request = lambda request_id: None  # nor can it let go of the request
    with TestClient(build_app(engine, MODEL)) as client:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 500 and "device lost" in first.json()["error"]["message"]
        assert client.get("/health").status_code == 503
        later = client.post("/v1/completions", json=body)
        assert later.status_code == 500 and "not running" in later.json()["error"]["message"]
        assert "tessera_engine_up{" in client.get("/metrics").text
