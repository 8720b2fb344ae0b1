"""qwenfast serve on a Ray Serve cluster: engine replicas across GPUs and machines behind one endpoint.

Two deployments (the `[ray]` extra):

- `QwenEngine`: each replica loads one qwenfast pipeline (one GPU: `num_gpus` per replica) and runs the
  same batcher as `qwenfast serve` (batcher.py). Its `generate` streams a job's events and then its
  images back to the caller. `record_routing_stats` feeds the router and /metrics; `check_health` is
  Ray's health check (a replica whose worker thread died is replaced).
- `QwenIngress`: one replica running the very FastAPI app of `qwenfast serve` (app.py, `serve.ingress`)
  with the batcher swapped for `RemoteScheduler` (ray_remote.py), which forwards each validated job to
  the engines through a handle routed by `BatchAffinityRouter` (ray_router.py) and retries it on
  another replica if its replica dies. So every endpoint, limit, auth rule, stream and the page behave
  as in single-process serving.

Autoscaling (`--autoscale MIN:MAX`) is Ray Serve's, on ongoing requests per engine replica (queued +
running jobs), with `target_ongoing_requests` = one full batch. Shutdown drains: Ray stops routing to a
replica and waits `graceful_shutdown_timeout_s` (`--shutdown-timeout`) for its queued and running jobs.

Start: `qwenfast serve --ray [--replicas N | --autoscale MIN:MAX] [--ray-address ADDR]`, or
`serve run deploy/ray-serve.yaml` (import path `qwenfast.server.ray_app:build_app`, `args` = the
flags of `qwenfast serve` without dashes). Models and LoRA folders must exist at the same path on
every node (the README's "Many GPUs and machines").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from .options import ServerConfig, add_serve_arguments, config_from_args

log = logging.getLogger("qwenfast.server")
APP, ENGINE, INGRESS = "qwenfast", "QwenEngine", "QwenIngress"


# ---------------------------------------------------------------------------- flags and config
def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qwenfast serve", add_help=False)
    add_serve_arguments(p)
    return p


def args_from_dict(d: dict[str, Any]) -> argparse.Namespace:
    """`serve run` config `args` ({"model": ..., "max_batch": 8, "fp8": true}) -> the flags' namespace,
    parsed by the same parser as `qwenfast serve`, so both ways accept and check the same values."""
    argv = []
    for k, v in d.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v not in (None, False):
            argv += [flag, str(v)]
    a = serve_parser().parse_args(argv)
    a.ray = True
    return a


def replica_resources(a: argparse.Namespace) -> dict:
    """Ray resources of one engine replica: its GPUs (a placement group when one engine spans several
    GPUs with --parallel), and a CPU share."""
    on_cpu = str(a.device or "").startswith("cpu")
    gpus = a.num_gpus if a.num_gpus is not None else (0 if on_cpu else 1)
    cpus = a.num_cpus if a.num_cpus is not None else (1.0 if on_cpu else 2.0)
    if getattr(a, "parallel", None):  # seam: `serve --parallel` (one engine over k GPUs) is not there yet
        raise NotImplementedError(
            "qwenfast serve --parallel is not available yet; Ray replicas use one GPU each"
        )
    return {"ray_actor_options": {"num_gpus": gpus, "num_cpus": cpus}}


def engine_options(a: argparse.Namespace, cfg: ServerConfig) -> dict:
    """Deployment options of the engine: replicas or autoscaling, resources, router, health, drain."""
    opts = replica_resources(a)
    if a.autoscale:
        lo, hi = a.autoscale
        opts["autoscaling_config"] = {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": max(lo, 1),
            "target_ongoing_requests": cfg.max_batch,
            "upscale_delay_s": 5,
            "downscale_delay_s": 60,
        }
    else:
        opts["num_replicas"] = a.replicas or 1
    if a.max_replicas_per_node:
        opts["max_replicas_per_node"] = a.max_replicas_per_node
    opts.update(
        max_ongoing_requests=cfg.max_queue + cfg.max_batch,  # a replica's queue + one running batch
        health_check_period_s=5.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=1.0,
        graceful_shutdown_timeout_s=a.shutdown_timeout,
        request_router_config=RequestRouterConfig(
            request_router_class="qwenfast.server.ray_router.BatchAffinityRouter",
            request_router_kwargs={"max_batch": cfg.max_batch},
            request_routing_stats_period_s=0.5,
            request_routing_stats_timeout_s=5.0,
        ),
    )
    return opts


# ---------------------------------------------------------------------------- the engine replica
class EngineReplica:
    """One pipeline and the local batcher; `generate` runs one job and streams its events and images."""

    def __init__(self, a: argparse.Namespace, cfg: ServerConfig):
        from .batcher import Scheduler
        from .engine import load_pipeline, server_engine_options
        from .metrics import Metrics

        logging.basicConfig(
            level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        self.cfg = cfg
        self.pipe = load_pipeline(a.model, a.device, a.dtype, server_engine_options(a), a.preset, a.fp8)
        self.metrics = Metrics()
        self.sched = Scheduler(self.pipe, cfg, self.metrics)
        self.sched.start()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Ray Serve (tests of this class alone)
            self.replica_id = f"local-{os.getpid()}"

    def describe(self) -> dict:
        """What the ingress's `RemotePipe` needs to answer as a local server would: the pipeline's class and
        settings (a stand-in of it answers sizes and capabilities), its options, device and dtype."""
        from .capabilities import capabilities

        pipe = self.pipe
        caps = capabilities(pipe)
        return {
            "pipeline": type(pipe).__name__,
            "settings": pipe.settings(),
            "options": pipe.options,
            "device": str(pipe.device.type),
            "dtype": str(pipe.dtype),
            "capabilities": caps.as_dict(),
            "is_edit": caps.edits and not caps.generations,
            "lora_support": caps.lora,
            "vae_scale_factor": pipe.vae_scale_factor,
        }

    async def generate(self, spec: dict, key: str = ""):
        """Events of one job ({"type": ...} dicts, as the local batcher posts them), then
        {"type": "result", "images": [PIL...]} or {"type": "error", "error": {...}}. If the caller goes
        away (Ray cancels this call), the job is cancelled like a client that hung up."""
        from .jobs import Job
        from .ray_remote import _error_dict
        from .schemas import APIError

        job = Job(
            spec["params"],
            asyncio.get_running_loop(),
            kind=spec["kind"],
            loras=tuple(spec["loras"]),
            images=spec["images"],
            stream_events=True,
            mask=spec.get("mask"),
        )
        try:
            self.sched.submit(job)
        except APIError as e:
            yield {"type": "error", "error": _error_dict(e)}
            return
        try:
            while True:
                get = asyncio.ensure_future(job.events.get())
                try:
                    done, _ = await asyncio.wait({get, job.future}, return_when=asyncio.FIRST_COMPLETED)
                finally:  # (a caller gone cancels the wait: no get left pending)
                    if not get.done():
                        get.cancel()
                if get in done:
                    yield get.result()
                    continue
                while not job.events.empty():  # events posted before the answer
                    yield job.events.get_nowait()
                break
            exc = job.future.exception()
            if exc is None:
                yield {"type": "result", "images": job.future.result(), "replica": self.replica_id}
            elif isinstance(exc, APIError):
                yield {"type": "error", "error": _error_dict(exc)}
            else:
                raise exc
        finally:
            if not job.future.done():
                self.sched.cancel(job, "disconnect")

    def record_routing_stats(self) -> dict:
        """Polled by Ray Serve's controller; seen by the router (ray_router.py) and /metrics."""
        from .metrics import gpu_memory

        q, qi, run = self.sched.depth()
        with self.sched.cond:
            keys: dict[str, int] = {}
            for it in self.sched.pending:
                if it.job.kind == "t2i":
                    k = repr(it.job.key)
                    keys[k] = keys.get(k, 0) + 1
        return {
            "queue": q,
            "images": qi,
            "running": run,
            "keys": keys,
            "pid": os.getpid(),
            "avg_batch_s": self.sched.avg_batch_s,
            "images_total": self.metrics.images_total,
            "images_per_second": round(self.metrics.images_per_second(), 4),
            "metrics": self.metrics.snapshot(),
            "gpu": gpu_memory(self.pipe.device),
        }

    def check_health(self) -> None:
        if not self.sched.alive():
            raise RuntimeError("the batcher's worker thread is not running")

    def __del__(self):
        """Ray has already waited for this replica's ongoing calls (graceful_shutdown_timeout_s)."""
        sched = getattr(self, "sched", None)
        if sched is not None:
            sched.stop(5.0)


# ---------------------------------------------------------------------------- the ingress replica
class IngressReplica:
    """`create_app` of `qwenfast serve`, with the engines behind `RemoteScheduler` (built at replica start)."""

    def __init__(self, engine, a: argparse.Namespace, cfg: ServerConfig, target: dict):
        self.engine, self.args, self.cfg, self.target = engine, a, cfg, target

    async def __serve_build_asgi_app__(self):
        from .app import create_app
        from .ray_remote import RemotePipe, RemoteScheduler

        logging.basicConfig(
            level=self.args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        if self.cfg.lora_dir:
            from .loras import LoraResolver

            LoraResolver(self.cfg.lora_dir)  # fail at start, not on the first request
        desc = await self.engine.describe.remote()  # waits for the first engine replica
        pipe = RemotePipe(desc)
        self.scheduler = None

        def scheduler(metrics):
            self.scheduler = RemoteScheduler(self.engine, self.cfg, metrics, self.target)
            return self.scheduler

        return create_app(pipe, self.cfg, scheduler=scheduler)


def application(a: argparse.Namespace, cfg: ServerConfig | None = None, name: str = APP):
    """The Ray Serve application (ingress bound to the engines) for `qwenfast serve` flags `a`.
    `cfg` overrides the server config the flags give (tests use small body limits)."""
    cfg = cfg or config_from_args(a)
    eng = engine_options(a, cfg)
    target = {
        "app": name,
        "deployment": ENGINE,
        "replicas": eng.get("num_replicas") or (eng.get("autoscaling_config") or {}).get("min_replicas", 1),
    }
    engine = serve.deployment(EngineReplica, name=ENGINE, **eng).bind(a, cfg)
    ingress_cls = serve.ingress()(IngressReplica)
    ingress = serve.deployment(
        ingress_cls,
        name=INGRESS,
        num_replicas=1,
        max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": a.ingress_cpus},
        graceful_shutdown_timeout_s=a.shutdown_timeout,
    )
    return ingress.bind(engine, a, cfg, target)


def build_app(args: dict[str, Any]):
    """`serve run` / KubeRay entry point: `import_path: qwenfast.server.ray_app:build_app`, and `args`
    holding `qwenfast serve` flags without the dashes (model, replicas, autoscale, max_batch, ...)."""
    return application(args_from_dict(dict(args or {})))


# ---------------------------------------------------------------------------- `qwenfast serve --ray`
def serve_ray(a: argparse.Namespace) -> int:
    """Connect to (or start) a Ray cluster, deploy, serve until SIGINT/SIGTERM, then drain and stop."""
    import ray

    if a.replicas is not None and a.autoscale:
        print("error: give --replicas N or --autoscale MIN:MAX, not both", file=sys.stderr)
        return 2
    a.replicas = a.replicas or 1
    cfg = config_from_args(a)
    if cfg.lora_dir:
        from .loras import LoraResolver

        LoraResolver(cfg.lora_dir)
    # no --ray-address: always a new local cluster ("local"), never a cluster that happens to run here
    ray.init(address=a.ray_address or "local", logging_level=logging.WARNING)
    stop = threading.Event()  # from here on SIGTERM drains (Ray's own handler would abort the driver)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    gpus = ray.cluster_resources().get("GPU", 0)
    need = replica_resources(a)["ray_actor_options"]["num_gpus"]
    if need and not gpus:
        print(
            "error: the Ray cluster has no GPUs; serve on CPU with --device cpu, or start the Ray nodes on "
            "GPU machines (`ray start --num-gpus N`)",
            file=sys.stderr,
        )
        return 2
    serve.start(http_options={"host": a.host, "port": a.port})
    serve.run(application(a, cfg), name=APP, route_prefix="/")
    print(
        f"qwenfast serve --ray: {a.autoscale or a.replicas} engine replica(s) on a Ray cluster with "
        f"{int(ray.cluster_resources().get('CPU', 0))} CPUs and {int(gpus)} GPUs; open http://{a.host}:{a.port}/",
        file=sys.stderr,
    )
    while not stop.wait(1.0):
        pass
    print("qwenfast serve --ray: draining (queued and running requests finish) ...", file=sys.stderr)
    t0 = time.monotonic()
    serve.delete(APP)  # Ray waits graceful_shutdown_timeout_s for each replica's ongoing requests
    if not a.ray_address:  # our own local cluster goes, and Serve with it; a joined cluster keeps Serve
        # not serve.shutdown(): it kills the controller under the controller's own graceful_shutdown task,
        # and Ray reports "Task ServeController.graceful_shutdown failed ... infinite retries remaining"
        ray.shutdown()
    print(f"qwenfast serve --ray: stopped after {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return 0
