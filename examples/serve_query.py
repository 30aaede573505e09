"""Serve and query: Tessera's encoder server on a free loopback port, one request, a clean stop.

    python examples/serve_query.py                          # a tiny random BERT, made here
    python examples/serve_query.py --model ./my-encoder     # any save_pretrained encoder folder

Without --model the script writes a tiny BERT encoder and its word-level tokenizer to a
temporary folder (tessera.serve.synthetic), as `save_pretrained` would. It then starts the
server that `tessera serve --model DIR --port 0` runs (the engine with TurboTransformers' DP
scheduler and the unpadded runner, behind the FastAPI app; see docs/serving.md), here in a
thread of this process, posts two texts to `/embed` (text-embeddings-inference's route) and
stops it.
"""

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from tessera.serve.app import create_app
from tessera.serve.server import ServeConfig, bind, build_service


def tiny_encoder(folder: Path) -> Path:
    from tessera.serve.synthetic import EncoderSpec, build_encoder

    spec = EncoderSpec(layers=2, hidden=32, heads=4, vocab_size=200, max_length=64)
    return build_encoder(folder / "encoder", spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="an encoder folder (default: a tiny one made here)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the server")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        config = ServeConfig(model=str(args.model or tiny_encoder(Path(tmp))), port=0)  # 0: a free port
        sock = bind(config)  # the address first: a taken port is refused before the model loads
        service = build_service(config)  # load the model, measure the DP's cost table, start the engine
        app = create_app(service, payload_limit=config.payload_limit, overload_status=config.overload_status)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
        thread.start()
        deadline = time.monotonic() + args.timeout
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise SystemExit(f"the server did not start within {args.timeout:g} s")
            time.sleep(0.01)
        url = f"http://{config.host}:{sock.getsockname()[1]}"
        print(f"serving {config.model} on {url}")
        try:
            reply = httpx.post(
                f"{url}/embed", json={"inputs": ["a short text", "another, longer text"]}, timeout=30
            )
            reply.raise_for_status()
            vectors = reply.json()
            print(f"POST {url}/embed -> {len(vectors)} embeddings of {len(vectors[0])} numbers")
            print("GET /health ->", httpx.get(f"{url}/health", timeout=10).status_code)
        finally:
            server.should_exit = True  # uvicorn lets in-flight requests finish
            thread.join(10)
            service.backend.begin_drain()  # as on SIGTERM: new requests get 503, queued ones finish
            service.backend.wait_idle(5.0)
            service.backend.engine.stop(timeout=5)
        print("server stopped: drained, engine ended")


if __name__ == "__main__":
    main()
