"""`qwenfast serve`: load the model, build the app, run uvicorn with a graceful shutdown.

Shutdown (SIGTERM / Ctrl-C): uvicorn stops accepting connections and waits up to
`--shutdown-timeout` for open requests, i.e. for everything queued or running, since each waits on
its connection; then the app's lifespan stops the worker. Work of clients that gave up is dropped.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import sys
import threading
import time
from typing import TYPE_CHECKING

from .engine import load_pipeline  # noqa: F401  (its home was here; callers import it from run)
from .options import config_from_args

if TYPE_CHECKING:
    import argparse

    import uvicorn
    from fastapi import FastAPI

log = logging.getLogger("qwenfast.server")


def serve(a: argparse.Namespace) -> int:
    from .. import launch
    from .. import validation as V

    if getattr(a, "parallel", None) and getattr(a, "ray", False):
        print(
            "error: --ray with --parallel (Ray replicas that each span several GPUs) is not available yet; use "
            "--ray with one GPU per replica, or --parallel without --ray",
            file=sys.stderr,
        )
        return 2
    # before any process starts or anything loads: the extras, the --parallel layout, flags that do nothing here
    V.require_extra("`qwenfast serve`", "server", "fastapi", "uvicorn")
    if getattr(a, "ray", False):
        V.require_extra("`qwenfast serve --ray`", "ray", "ray")
    if not launch.is_worker():
        from ..engine_args import check_parallel_args, engine_notes

        check_parallel_args(a)
        if not (
            getattr(a, "ray", False) and a.ray_address
        ):  # a joined cluster's Serve may own the port already
            check_port(a.host, a.port)  # before the model loads (uvicorn would fail only after loading it)
        engine_notes(a, loras=bool(a.lora_dir))
    if getattr(a, "parallel", None) and not launch.is_worker():
        return launch.run(serve, a)  # every rank runs serve(); rank 0 answers HTTP (server/parallel.py)
    if getattr(a, "ray", False):
        from .ray_app import serve_ray

        logging.basicConfig(
            level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        return serve_ray(a)
    if getattr(a, "replicas", None) or getattr(a, "autoscale", None) or getattr(a, "ray_address", None):
        print("error: --replicas, --autoscale and --ray-address need --ray", file=sys.stderr)
        return 2
    from ..about import DEMO_MODEL
    from ..pipeline.common import EMBEDDED_NOTE
    from .app import create_app

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(a)
    if a.model is None:
        print(EMBEDDED_NOTE.format(path=DEMO_MODEL), file=sys.stderr)
    if cfg.lora_dir:
        from .loras import LoraResolver

        LoraResolver(cfg.lora_dir)  # fail now, not on the first request
    from .engine import server_engine_options

    pipe = load_pipeline(a.model, a.device, a.dtype, server_engine_options(a), a.preset, a.fp8)
    if a.text_bucket is None and pipe.options.text_bucket:
        logging.getLogger("qwenfast.server").info(
            "CUDA graphs with FlashAttention-3: prompts padded to multiples of %d tokens (--text-bucket)",
            pipe.options.text_bucket,
        )
    if launch.is_worker():  # --parallel: the other ranks follow rank 0's calls
        from .parallel import Mirrored, control_group, follow

        group = control_group()
        if launch.rank() != 0:
            follow(pipe, group)
            return 0
        pipe = Mirrored(pipe, group)
    try:
        return _serve_http(a, cfg, pipe, create_app)
    finally:
        if launch.is_worker():
            pipe.stop()


def _serve_http(a: argparse.Namespace, cfg, pipe, create_app) -> int:
    import uvicorn

    app = create_app(pipe, cfg)
    if not _is_loopback(a.host) and cfg.api_key is None:
        print(
            f"warning: serving on {a.host} without --api-key: anyone who can reach this port can use the GPU",
            file=sys.stderr,
        )
    print(
        f"qwenfast serve: {app.state.config.model_name or pipe.model_path} on {pipe.device}; "
        f"open http://{a.host}:{a.port}/ (max batch {cfg.max_batch}, queue {cfg.max_queue})",
        file=sys.stderr,
    )
    uvicorn.run(
        app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=a.shutdown_timeout
    )
    return 0


def check_port(host: str, port: int) -> None:
    """ValueError when `host:port` cannot be listened on (in use, no permission, unknown address), probed the
    way uvicorn binds (SO_REUSEADDR) so a port it could use is never refused."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            why = (
                "in use (another server?)" if e.errno == errno.EADDRINUSE else (e.strerror or str(e)).lower()
            )
            raise ValueError(f"cannot listen on {host}:{port}: {why}; pick another --port") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def start_server(app: FastAPI, host: str = "127.0.0.1") -> tuple[uvicorn.Server, threading.Thread, str]:
    """uvicorn in a background thread on a free port -> (server, thread, base URL)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    th.start()
    t0 = time.monotonic()
    while not server.started:
        if not th.is_alive() or time.monotonic() - t0 > 60:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, th, f"http://{host}:{port}"


def stop_server(server: uvicorn.Server, th: threading.Thread, timeout: float = 60) -> None:
    server.should_exit = True
    th.join(timeout)
