"""Load figures of server.py: requests/s, sentences/s and p50/p95 latency at 1, 8 and 64 concurrent clients,
each request one sentence of --source (default tests/fixtures/test.en). Starts the server itself on a free
loopback port.

    python bench/bench_server.py --checkpoint runs/tiny                       # after configs/tiny.yaml
    python bench/bench_server.py --checkpoint runs/multi30k_en_de --requests 500 --clients 1 8 64 \
        --source data/prepared/multi30k_en-de_bpe8000_*/test_2016_flickr.en.txt
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, limit_s: float) -> None:
    """Until /health answers; the server's log if it dies or is not up within limit_s."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    sys.exit(f"error: the server did not answer /health within {limit_s:.0f} s")


def load(url: str, sentences: list[str], clients: int, requests: int, limit_s: float) -> dict:
    """`requests` one-sentence requests from `clients` threads (fewer if limit_s runs out): throughput, latency."""
    latencies: list[float] = []
    stop = time.monotonic() + limit_s

    def client(k: int, client: httpx.Client) -> None:
        for i in range(k, requests, clients):
            if time.monotonic() > stop:
                return
            start = time.perf_counter()
            r = client.post(f"{url}/translate", json={"text": [sentences[i % len(sentences)]]}, timeout=120)
            r.raise_for_status()
            latencies.append(time.perf_counter() - start)

    before = httpx.get(f"{url}/health", timeout=30).json()
    with httpx.Client(limits=httpx.Limits(max_connections=clients)) as http, ThreadPoolExecutor(clients) as pool:
        start = time.perf_counter()
        list(pool.map(lambda k: client(k, http), range(clients)))
        wall = time.perf_counter() - start
    after = httpx.get(f"{url}/health", timeout=30).json()
    q = statistics.quantiles(latencies, n=20, method="inclusive")  # q[9] = p50, q[18] = p95
    return {"clients": clients, "requests": len(latencies), "seconds": wall, "req_s": len(latencies) / wall,
            "sent_s": (after["sentences"] - before["sentences"]) / wall, "p50_ms": 1000 * q[9],
            "p95_ms": 1000 * q[18], "batches": after["batches"] - before["batches"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="run directory or .pt file")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--requests", type=int, default=256, help="requests per concurrency level")
    p.add_argument("--limit-s", type=float, default=120, help="time limit per concurrency level")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    p.add_argument("--window-ms", type=float, default=10.0)
    p.add_argument("--source", default=str(ROOT / "tests/fixtures/test.en"), help="sentences to send, one per line")
    args = p.parse_args()
    sentences = [line for line in Path(args.source).read_text("utf-8").splitlines() if line.strip()]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--checkpoint", args.checkpoint,
                                     "--port", str(port), "--threads", str(args.threads), "--window-ms",
                                     str(args.window_ms)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        try:
            wait_ready(url, proc, log, 120)
            health = httpx.get(f"{url}/health", timeout=30).json()
            load(url, sentences, 4, 16, 60)  # warm-up: first calls allocate
            print(f"model {health['model']} on {health['device']}, beam {health['default_beam']}, "
                  f"{args.threads} torch thread(s), window {args.window_ms:g} ms, one sentence per request")
            print(f"{'clients':>7} {'requests':>8} {'seconds':>8} {'req/s':>7} {'sent/s':>7} {'p50 ms':>7} "
                  f"{'p95 ms':>7} {'model calls':>11}")
            for clients in args.clients:
                r = load(url, sentences, clients, args.requests, args.limit_s)
                print(f"{r['clients']:>7} {r['requests']:>8} {r['seconds']:>8.2f} {r['req_s']:>7.1f} "
                      f"{r['sent_s']:>7.1f} {r['p50_ms']:>7.1f} {r['p95_ms']:>7.1f} {r['batches']:>11}", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
