"""Tests of server.py: the real server process on a free loopback port (results equal the Python API's,
concurrent requests batched and faster than sequential ones, every bad request a 4xx JSON error, the page
self-contained), and the batching worker in this process (a cancelled request does not break its batch)."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import ROOT, fixture_lines

from server import Batcher

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = fixture_lines("test", "en")
TIMEOUT = 60.0  # seconds for any one request: bounded even on a loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    """Base URL of `python translate.py --checkpoint RUN --serve --port FREE` (server.py's command line behind
    it) started as a user does; stopped at the end."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"  # a file, not a pipe: a full pipe would block it
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "translate.py"), "--checkpoint", str(run), "--serve",
                                 "--port", str(port), "--device", "cpu", "--threads", "1"], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"server not up after 120 s: {log.read_text()[-2000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def post(url: str, body, client: httpx.Client | None = None) -> httpx.Response:
    send = client.post if client else httpx.post
    return send(f"{url}/translate", json=body, timeout=TIMEOUT)


def as_json(t) -> dict:
    """What the server should answer for a Translation of the Python API."""
    out = {"text": t.text, "score": t.score, "nbest": [{"text": s, "score": v} for s, v in t.hypotheses]}
    if t.attention is not None:
        out.update(src_tokens=t.src_tokens, tgt_tokens=t.tgt_tokens, attention=t.attention)
    return out


def assert_same(got: list[dict], expected: list[dict]) -> None:
    """Equal texts and pieces; scores and weights equal up to float noise from other batch compositions."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.keys() == e.keys()
        assert g["text"] == e["text"]
        assert [h["text"] for h in g["nbest"]] == [h["text"] for h in e["nbest"]]
        for a, b in zip([g["score"], *(h["score"] for h in g["nbest"])],
                        [e["score"], *(h["score"] for h in e["nbest"])], strict=True):
            assert (a is None and b is None) or a == pytest.approx(b, abs=1e-4)
        if "attention" in e:
            assert (g["src_tokens"], g["tgt_tokens"]) == (e["src_tokens"], e["tgt_tokens"])
            flat = lambda w: [x for layer in w for head in layer for row in head for x in row]  # noqa: E731
            assert flat(g["attention"]) == pytest.approx(flat(e["attention"]), abs=1e-5)


@pytest.mark.parametrize("settings", [{}, {"beam": 1}, {"beam": 3, "nbest": 3}, {"beam": 2, "attention": True}])
def test_results_equal_the_python_api(server, translator, settings):
    texts = [*SENTENCES[:5], ""]
    r = post(server, {"text": texts, **settings})
    assert r.status_code == 200, r.text
    data = r.json()
    expected = translator.translate(texts, beam=settings.get("beam"), nbest=settings.get("nbest", 1),
                                    attention=settings.get("attention", False))
    assert data["beam"] == settings.get("beam", translator.default_beam)
    assert data["model"] == translator.name  # the run's chosen weights (avg or best, whichever won on val)
    assert translator.name in ("run/checkpoint_avg.pt", "run/checkpoint_best.pt")
    assert_same(data["translations"], [as_json(t) for t in expected])


def test_health(server, translator):
    h = httpx.get(f"{server}/health", timeout=TIMEOUT).json()
    assert (h["status"], h["model"], h["device"], h["engine"], h["default_beam"]) == (
        "ok", translator.name, "cpu", "torch", 2)


def test_concurrent_requests_are_batched_and_faster_than_sequential(server, translator):
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(100)]
    expected = {t: as_json(r) for t, r in zip(texts, translator.translate(texts), strict=True)}
    before = httpx.get(f"{server}/health", timeout=TIMEOUT).json()
    with httpx.Client() as client:
        start = time.perf_counter()
        sequential = [post(server, {"text": [t]}, client) for t in texts]
        sequential_s = time.perf_counter() - start
    middle = httpx.get(f"{server}/health", timeout=TIMEOUT).json()
    with httpx.Client(limits=httpx.Limits(max_connections=100)) as client, ThreadPoolExecutor(100) as pool:
        start = time.perf_counter()
        concurrent = list(pool.map(lambda t: post(server, {"text": [t]}, client), texts))
        concurrent_s = time.perf_counter() - start
    after = httpx.get(f"{server}/health", timeout=TIMEOUT).json()
    print(f"100 requests: sequential {sequential_s:.2f} s, concurrent {concurrent_s:.2f} s, "
          f"model calls {middle['batches'] - before['batches']} / {after['batches'] - middle['batches']}")
    for t, r in zip(texts * 2, sequential + concurrent, strict=True):
        assert r.status_code == 200, r.text
        assert_same(r.json()["translations"], [expected[t]])
    assert middle["requests"] - before["requests"] == 100 == after["requests"] - middle["requests"]
    assert middle["batches"] - before["batches"] == 100  # one at a time: nothing to merge
    assert after["batches"] - middle["batches"] < 50  # merged: at least two requests per model call on average
    assert concurrent_s < sequential_s


def bad_requests(url: str) -> list[tuple[str, httpx.Response, int, str]]:
    """(what, response, expected status, expected message pattern) for each kind of bad request."""
    def raw(content: bytes, content_type: str = "application/json") -> httpx.Response:
        return httpx.post(f"{url}/translate", content=content, headers={"content-type": content_type},
                          timeout=TIMEOUT)

    return [
        ("malformed JSON", raw(b'{"text": ["a"'), 400, "malformed JSON"),
        ("not an object", raw(b'["a"]'), 422, "the body must be a JSON object"),
        ("form data", raw(b"text=a", "application/x-www-form-urlencoded"), 422, "the body must be a JSON object"),
        ("body over 1 MB", raw(b'{"text": ["' + b"a" * 1_100_000 + b'"]}'), 413, "larger than 1000000 bytes"),
        ("no text", post(url, {"beam": 2}), 422, "text: Field required"),
        ("text not a list", post(url, {"text": "a"}), 422, "text: Input should be a valid list"),
        ("sentence not a string", post(url, {"text": ["a", 5]}), 422, r"text\.1: Input should be a valid string"),
        ("no sentences", post(url, {"text": []}), 422, "text must hold 1 to 64 sentences, got 0"),
        ("65 sentences", post(url, {"text": ["a"] * 65}), 422, "text must hold 1 to 64 sentences, got 65"),
        ("long sentence", post(url, {"text": ["a", "b" * 1001]}), 422, r"text\[1\] has 1001 characters; the limit "
                                                                         "is 1000"),
        ("beam 0", post(url, {"text": ["a"], "beam": 0}), 422, "beam must be between 1 and 16, got 0"),
        ("beam 17", post(url, {"text": ["a"], "beam": 17}), 422, "beam must be between 1 and 16, got 17"),
        ("beam as text", post(url, {"text": ["a"], "beam": "4"}), 422, "beam: Input should be a valid integer"),
        ("beam as float", post(url, {"text": ["a"], "beam": 2.5}), 422, "beam: Input should be a valid integer"),
        ("nbest over beam", post(url, {"text": ["a"], "beam": 2, "nbest": 3}), 422,
         r"nbest must be between 1 and beam \(2\), got 3"),
        ("nbest over default beam", post(url, {"text": ["a"], "nbest": 3}), 422, r"beam \(2\), got 3"),
        ("nbest 0", post(url, {"text": ["a"], "nbest": 0}), 422, "nbest must be between 1"),
        ("attention not a bool", post(url, {"text": ["a"], "attention": "yes"}), 422,
         "attention: Input should be a valid boolean"),
        ("unknown field", post(url, {"text": ["a"], "beams": 2}), 422, "beams: Extra inputs are not permitted"),
    ]


def test_bad_requests_get_clear_4xx_json_and_the_server_keeps_serving(server):
    for what, r, status, pattern in bad_requests(server):
        assert r.status_code == status, (what, r.text)
        assert r.headers["content-type"] == "application/json", what
        assert re.search(pattern, r.json()["error"]), (what, r.json())
    r = post(server, {"text": ["A dog runs."]})
    assert r.status_code == 200 and r.json()["translations"][0]["text"]


def test_a_client_that_leaves_does_not_stop_the_server(server):
    body = b'{"text": ["A man is riding a bike."], "beam": 4, "nbest": 2}'
    for _ in range(5):  # send a request and hang up before the answer
        with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])), timeout=10) as s:
            s.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(server, {"text": ["Two dogs play."], "beam": 4, "nbest": 2}),
                                range(8)))
    assert [r.status_code for r in answers] == [200] * 8
    assert len({r.text for r in answers}) == 1


def test_page_is_self_contained(server):
    r = httpx.get(f"{server}/", timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)  # no remote script, style, font
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//|cdn", page, re.I)
    assert "<canvas" in page and 'id="layer"' in page and 'id="head"' in page and "mean of heads" in page
    assert "fetch(\"translate\"" in page and "src_tokens" in page and "tgt_tokens" in page
    assert httpx.get(f"{server}/docs", timeout=TIMEOUT).status_code == 200  # OpenAPI UI comes with FastAPI
    schema = httpx.get(f"{server}/openapi.json", timeout=TIMEOUT).json()
    assert "/translate" in schema["paths"] and "/health" in schema["paths"]


def test_cancelled_request_does_not_break_its_batch(translator):
    """In-process: three requests share one window; the client of the second leaves; the others are answered."""
    async def scenario():
        batcher = Batcher(translator, window_s=0.2, max_batch_tokens=10_000)
        worker = asyncio.create_task(batcher.run())
        try:
            tasks = [asyncio.create_task(batcher.translate([t], 2, 1, False)) for t in SENTENCES[:3]]
            await asyncio.sleep(0.01)  # all three are queued, the window is still open
            tasks[1].cancel()
            done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=120)
            after = await asyncio.wait_for(batcher.translate([SENTENCES[3]], 2, 1, False), timeout=120)
            return done, after, batcher.stats
        finally:
            worker.cancel()
            batcher.executor.shutdown(wait=True)

    done, after, stats = asyncio.run(scenario())
    expected = translator.translate(SENTENCES[:4], beam=2)
    assert isinstance(done[1], asyncio.CancelledError)
    assert [done[0][0].text, done[2][0].text, after[0].text] == [expected[0].text, expected[2].text, expected[3].text]
    assert (stats.batches, stats.requests, stats.sentences) == (2, 3, 3)  # the first two live ones shared a call


def test_command_line_errors_are_one_line(run):
    for args, message in [(["--checkpoint", str(run / "missing")], "error: checkpoint not found"),
                          (["--checkpoint", str(run), "--port", "70000"], "error: --port 70000 is not a TCP port"),
                          (["--checkpoint", str(run), "--device", "tpu"], "error: --device 'tpu' is not a device")]:
        proc = subprocess.run([sys.executable, str(ROOT / "server.py"), *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr


def test_translate_serve_refuses_translation_options(run, tmp_path):
    for args, message in [(["--input", str(tmp_path / "x.txt")], "error: --serve serves requests; it takes no --input"),
                          (["A sentence."], "error: --serve serves requests; it takes no sentences"),
                          (["--precision", "int8"], "error: --serve decodes with the torch engine")]:
        proc = subprocess.run([sys.executable, str(ROOT / "translate.py"), "--checkpoint", str(run), "--serve", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr
