"""`qwenfast serve`: an OpenAI-compatible image server with request batching, limits and metrics.

Layout (FastAPI and uvicorn come from the `[server]` extra; nothing here imports them at package
import time, so `qwenfast --help` stays fast):

- `options.py`   command-line flags and the `Limits` every request is checked against
- `schemas.py`   request parsing and validation, OpenAI-shaped errors
- `batcher.py`   the bounded queue and the worker thread that batches compatible requests
- `jobs.py`      one request as the worker sees it (its images, results, stream, timings)
- `pace.py`      what "shorter" means when batches run inside others, and the worker's step pace
- `imaging.py`   image encoding, previews, upload checks
- `loras.py`     LoRA names -> files, only inside `--lora-dir`
- `metrics.py`   Prometheus text format, hand-written (no extra dependency)
- `app.py`       the FastAPI app, auth and body-size middleware, and `serve()`
- `static/`      the web page (plain HTML/JS, no build step)
- `engine.py`    loading the served pipeline (shared with the Ray engine replicas)
- `ray_app.py`   Ray Serve: engine and ingress deployments, `serve --ray`, `serve run` builder ([ray] extra)
- `ray_remote.py` the ingress side on Ray: forwards jobs to engine replicas, retries, /metrics, /health
- `ray_router.py` Ray Serve request router: join a forming batch of the same key, else least-loaded
"""
