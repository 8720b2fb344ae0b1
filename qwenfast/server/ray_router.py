"""Ray Serve request routing for qwenfast engine replicas, and the per-replica view the ingress reports.

`BatchAffinityRouter` is a Ray Serve `RequestRouter` (the documented plug-in point of Ray's routing; Ray
keeps doing the queue-length probes, back-off, retries of routing and replica-set updates). It runs
inside the ingress process, in the engine handle. For each request it ranks the engine replicas:

1. when no replica is idle, the replicas where a batch with the same key (size, steps, CFG, LoRA set,
   step cache; `Job.key`) is forming and not yet full, if their load is within one batch of the least
   loaded replica: the request joins that batch instead of starting another (one pipeline call for
   both, which is nearly free on a GPU);
2. then every replica: Ray picks the one with the shortest queue (least-loaded).

With an idle replica, running alone in parallel beats joining a batch, so rule 1 is skipped.

The router also sees each replica's `record_routing_stats()` (queue, running, batch counters, GPU
memory; Ray's controller polls them every `request_routing_stats_period_s`). It publishes them on
`ray_remote.BOARD`, a process-local table the ingress reads for /metrics and /health. Replicas that leave (died,
scaled down) keep their last counters there as "retired", so totals never go backwards.

Ray ships a router class by value (cloudpickle), module globals included: keep this module free of
state and import what it shares with the ingress at run time.
"""

from __future__ import annotations

import threading
from collections import Counter

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def _short(replica_id) -> str:
    return getattr(replica_id, "unique_id", None) or str(replica_id)


class BatchAffinityRouter(FIFOMixin, RequestRouter):
    """Join a forming batch of the same key when every replica is busy; else least-loaded."""

    def initialize_state(self, max_batch: int = 4, **kwargs):
        self.max_batch = max(1, int(max_batch))
        self.sent: dict[str, tuple[str, str]] = {}  # internal request id -> (replica id, key), in flight
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ what Ray tells us
    def update_replicas(self, replicas: list[RunningReplica]):
        from qwenfast.server.ray_remote import BOARD  # at run time: Ray ships this class by value

        out = super().update_replicas(replicas)
        BOARD.update({_short(r.replica_id): {**(r.routing_stats or {}), "node": r.node_id} for r in replicas})
        return out

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        key = (pending_request.kwargs or {}).get("key") or ""
        with self.lock:
            self.sent[pending_request.metadata.internal_request_id] = (_short(replica_id), key)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        with self.lock:
            self.sent.pop(internal_request_id, None)

    # ------------------------------------------------------------------ the choice
    def _loads(self, candidates: list[RunningReplica]) -> dict[str, int]:
        """Requests each replica has: Ray's queue-length cache, else its last stats, else what we sent."""
        with self.lock:
            ours = Counter(rid for rid, _ in self.sent.values())
        loads = {}
        for r in candidates:
            rid = _short(r.replica_id)
            q = self.replica_queue_len_cache.get(r.replica_id)
            if q is None:
                s = r.routing_stats or {}
                q = s["queue"] + s["running"] if "queue" in s else ours[rid]
            loads[rid] = max(int(q), ours[rid])
        return loads

    def forming(self, candidates: list[RunningReplica], key: str) -> dict[str, int]:
        """Requests with `key` each replica has waiting or just sent (a batch that may still take more)."""
        with self.lock:
            ours = Counter(rid for rid, k in self.sent.values() if k == key)
        out = {}
        for r in candidates:
            rid = _short(r.replica_id)
            theirs = int(((r.routing_stats or {}).get("keys") or {}).get(key, 0))
            out[rid] = max(ours[rid], theirs)
        return out

    def rank(self, candidates: list[RunningReplica], key: str) -> list[list[RunningReplica]]:
        if not candidates:
            return []
        loads = self._loads(candidates)
        least = min(loads.values())
        if key and least > 0:
            forming = self.forming(candidates, key)
            join = [
                r
                for r in candidates
                if forming[_short(r.replica_id)] % self.max_batch
                and loads[_short(r.replica_id)] <= least + self.max_batch
            ]
            if join:
                return [join, list(candidates)]
        return [list(candidates)]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = ((pending_request.kwargs or {}).get("key") or "") if pending_request is not None else ""
        return self.rank(candidate_replicas, key)
