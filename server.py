"""Serve a trained model over HTTP: POST /translate (JSON), GET /health, a translation page at /, OpenAPI at /docs.

    python server.py --checkpoint runs/multi30k_en_de            # http://127.0.0.1:8000/

Concurrent requests are translated together: each request joins an asyncio queue; one worker task collects
requests for --window-ms (or until --max-batch-tokens source tokens are gathered), groups them by identical
(beam, nbest, attention), runs Translator.translate on each group in a worker thread and hands every request
its own results. A client that goes away only cancels its own future; the rest of its batch is answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from runtime import UserError, cli_main, resolve_device
from translator import Translation, Translator

MAX_BODY_BYTES = 1_000_000
MAX_SENTENCES = 64
MAX_CHARS = 1000
MAX_BEAM = 16
PAGE = Path(__file__).resolve().parent / "static" / "index.html"


# ---------------------------------------------------------------- request and response bodies


class TranslateRequest(BaseModel):
    """Body of POST /translate; beam defaults to the checkpoint's decode.beam."""

    model_config = ConfigDict(extra="forbid", strict=True)  # strict: "4" is not a beam, a typo is not ignored

    text: list[str] = Field(description=f"sentences to translate, 1 to {MAX_SENTENCES}, each at most "
                                        f"{MAX_CHARS} characters")
    beam: int | None = Field(None, description=f"beam size 1..{MAX_BEAM}; 1 = greedy search")
    nbest: int = Field(1, description="hypotheses returned per sentence, 1..beam")
    attention: bool = Field(False, description="also return source/output pieces and cross-attention weights")

    @field_validator("text")
    @classmethod
    def _sentences(cls, text: list[str]) -> list[str]:
        if not 1 <= len(text) <= MAX_SENTENCES:
            raise ValueError(f"text must hold 1 to {MAX_SENTENCES} sentences, got {len(text)}")
        long = next((i for i, t in enumerate(text) if len(t) > MAX_CHARS), None)
        if long is not None:
            raise ValueError(f"text[{long}] has {len(text[long])} characters; the limit is {MAX_CHARS}")
        return text

    @field_validator("beam")
    @classmethod
    def _beam(cls, beam: int | None) -> int | None:
        if beam is not None and not 1 <= beam <= MAX_BEAM:
            raise ValueError(f"beam must be between 1 and {MAX_BEAM}, got {beam}")
        return beam


class Hypothesis(BaseModel):
    text: str
    score: float | None = Field(description="length-normalised log-probability; null for greedy search")


class TranslationOut(BaseModel):
    text: str
    score: float | None
    nbest: list[Hypothesis]
    src_tokens: list[str] | None = None
    tgt_tokens: list[str] | None = None
    attention: list[list[list[list[float]]]] | None = Field(None, description="[layer][head][tgt][src]")


class TranslateResponse(BaseModel):
    translations: list[TranslationOut]
    beam: int
    model: str


def to_output(t: Translation) -> TranslationOut:
    """The JSON shape of one Translation (absent attention fields are left out of the response)."""
    extra = {} if t.attention is None else dict(src_tokens=t.src_tokens, tgt_tokens=t.tgt_tokens,
                                                attention=t.attention)  # unset fields stay out of the response
    return TranslationOut(text=t.text, score=t.score, nbest=[Hypothesis(text=s, score=v) for s, v in t.hypotheses],
                          **extra)


# ---------------------------------------------------------------- batching


@dataclass
class Job:
    texts: list[str]
    settings: tuple[int, int, bool]  # (beam, nbest, attention): only equal settings share a model call
    tokens: int
    future: asyncio.Future


@dataclass
class Stats:
    requests: int = 0  # requests answered by a model call
    sentences: int = 0
    batches: int = 0  # model calls (Translator.translate); fewer than requests when batching merges them


class Batcher:
    """Collects requests from an asyncio queue and translates them together in one worker thread."""

    def __init__(self, translator: Translator, window_s: float, max_batch_tokens: int):
        self.translator, self.window_s, self.max_batch_tokens = translator, window_s, max_batch_tokens
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.stats = Stats()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="translate")  # the model is one

    async def translate(self, texts: list[str], beam: int, nbest: int, attention: bool) -> list[Translation]:
        """The translations of one request, once its batch has run."""
        future = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(Job(texts, (beam, nbest, attention), self.translator.count_tokens(texts), future))
        return await future

    async def collect(self) -> list[Job]:
        """The next jobs: the first to arrive and what follows within the window, up to the token budget."""
        loop = asyncio.get_running_loop()
        jobs = [await self.queue.get()]
        tokens, deadline = jobs[0].tokens, loop.time() + self.window_s
        while tokens < self.max_batch_tokens:
            try:
                # requests that queued while the previous batch ran are taken at once, without waiting
                job = self.queue.get_nowait() if not self.queue.empty() else await asyncio.wait_for(
                    self.queue.get(), max(0.0, deadline - loop.time()))
            except (TimeoutError, asyncio.TimeoutError):
                break
            jobs.append(job)
            tokens += job.tokens
        return jobs

    async def run_group(self, settings: tuple[int, int, bool], jobs: list[Job]) -> None:
        """One model call for jobs of equal settings; each job's future gets its slice (or the error)."""
        jobs = [j for j in jobs if not j.future.done()]  # a cancelled client needs no translation
        if not jobs:
            return
        beam, nbest, attention = settings
        texts = [t for j in jobs for t in j.texts]
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, lambda: self.translator.translate(texts, beam=beam, nbest=nbest, attention=attention))
        except Exception as e:  # noqa: BLE001 - reported to the requests of this group, the server goes on
            for j in jobs:
                if not j.future.done():
                    j.future.set_exception(e)
            return
        self.stats.batches += 1
        self.stats.requests += len(jobs)
        self.stats.sentences += len(texts)
        start = 0
        for j in jobs:
            if not j.future.done():  # the client may have left while the model ran
                j.future.set_result(results[start:start + len(j.texts)])
            start += len(j.texts)

    async def run(self) -> None:
        """The worker task: collect, group by settings, translate, forever."""
        while True:
            groups: dict[tuple[int, int, bool], list[Job]] = {}
            for job in await self.collect():
                groups.setdefault(job.settings, []).append(job)
            for settings, jobs in groups.items():
                await self.run_group(settings, jobs)


# ---------------------------------------------------------------- the application


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before any of it is parsed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self.reject(scope, receive, send)
        chunks, size = [], 0
        while True:  # read the body here (bounded), then replay it to the app
            message = await receive()
            if message["type"] != "http.request":
                return  # the client disconnected
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self.reject(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def reject(self, scope, receive, send) -> None:
        response = JSONResponse({"error": f"request body is larger than {self.limit} bytes"}, status_code=413)
        await response(scope, receive, send)


def validation_message(exc: RequestValidationError) -> tuple[int, str]:
    """(status, one line) for a request FastAPI could not validate: 400 for malformed JSON, else 422."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return 400, f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse the body')}"
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if where == "body" and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        message = 'the body must be a JSON object like {"text": ["A sentence."]}'
    return 422, f"{where}: {message}" + (f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else "")


def create_app(translator: Translator, window_ms: float = 10.0, max_batch_tokens: int | None = None,
               page: Path = PAGE) -> FastAPI:
    """The FastAPI application serving translator; the batching worker runs for the app's lifetime."""
    html = page.read_text("utf-8")  # read once: the page is served from memory

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher = Batcher(translator, window_ms / 1000, max_batch_tokens or translator.batch_tokens)
        app.state.batcher = batcher
        worker = asyncio.create_task(batcher.run())
        try:
            yield
        finally:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
            batcher.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Transformer NMT", lifespan=lifespan,
                  description="Translate with a trained encoder-decoder Transformer (beam search, n-best lists, "
                              "cross-attention).")
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message = validation_message(exc)
        return JSONResponse({"error": message}, status_code=status)

    @app.post("/translate", response_model=TranslateResponse, response_model_exclude_unset=True,
              responses={400: {"description": "malformed JSON"}, 413: {"description": "body over 1 MB"},
                         422: {"description": "a limit or type is not respected"}})
    async def translate(body: TranslateRequest, request: Request):
        """Translate 1 to 64 sentences; concurrent requests with equal settings are batched together."""
        beam = translator.default_beam if body.beam is None else body.beam
        if not 1 <= body.nbest <= beam:
            return JSONResponse({"error": f"nbest must be between 1 and beam ({beam}), got {body.nbest}"},
                                status_code=422)
        results = await request.app.state.batcher.translate(body.text, beam, body.nbest, body.attention)
        return TranslateResponse(translations=[to_output(t) for t in results], beam=beam, model=translator.name)

    @app.get("/health")
    async def health(request: Request) -> dict:
        """Liveness, the model served, and how many model calls (batches) answered how many requests."""
        stats = request.app.state.batcher.stats
        return {"status": "ok", "model": translator.name, "device": str(translator.device),
                "engine": translator.engine, "default_beam": translator.default_beam, "requests": stats.requests,
                "sentences": stats.sentences, "batches": stats.batches}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(html)

    return app


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Serve a trained Transformer over HTTP (JSON API and a web page).")
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR_OR_FILE", help="run directory or .pt file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16", "auto"],
                   help="default: the checkpoint's decode.precision (fp32 unless set)")
    p.add_argument("--max-batch-tokens", type=int, metavar="N",
                   help="source tokens gathered into one model call (default: the checkpoint's decode.batch_tokens)")
    p.add_argument("--window-ms", type=float, default=10.0,
                   help="how long the first request of a batch waits for others (default: 10)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 1 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a TCP port (1..65535)")
    if not 0 <= args.window_ms <= 10_000:
        raise UserError("--window-ms must be between 0 and 10000")
    if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
        raise UserError("--max-batch-tokens must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if not PAGE.is_file():
        raise UserError(f"the page {PAGE} is missing; server.py needs the static/ folder next to it")
    device = str(resolve_device(args.device, "--device"))  # an error names the option
    # torch only: the page asks for attention weights, which a CTranslate2 export cannot give
    translator = Translator.load(args.checkpoint, device=device, precision=args.precision, engine="torch",
                                 batch_tokens=args.max_batch_tokens)
    app = create_app(translator, window_ms=args.window_ms)
    print(f"serving {translator.name} on {translator.device}: http://{args.host}:{args.port}/ "
          f"(API docs at /docs)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    cli_main(main)
