"""Inference endpoints as a pool: least-loaded choice, sticky sessions, health, weight sync to all.

An episode is a session: every turn of it goes to the endpoint it was given first, so the server's
prefix cache holds its growing prompt. A new session goes to the healthy endpoint with the fewest
sessions in flight (ties: the lowest index). An endpoint that fails a health check leaves the pool
until it answers again; its sessions are handed back to the caller to retry elsewhere.

The same policy is what `serve.router` applies per request; here it runs in the rollout driver, which
gives each episode its endpoint up front (rollout workers then talk to that server directly).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from train.server import Server, ServerError


@dataclass
class Endpoint:
    base_url: str  # .../v1
    healthy: bool = True
    sessions: set[str] = field(default_factory=set)


class EndpointPool:
    """Thread-safe session -> endpoint assignment (least-loaded, sticky)."""

    def __init__(self, base_urls: list[str]):
        if not base_urls:
            raise ValueError("an endpoint pool needs at least one base URL")
        self.endpoints = [Endpoint(u.rstrip("/")) for u in base_urls]
        self.lock = threading.Lock()
        self.sticky: dict[str, Endpoint] = {}

    def acquire(self, session: str) -> str:
        """The endpoint of `session` (assigned on first use). Raises ServerError when none is healthy."""
        with self.lock:
            ep = self.sticky.get(session)
            if ep is not None and ep.healthy:
                return ep.base_url
            live = [e for e in self.endpoints if e.healthy]
            if not live:
                raise ServerError("no healthy inference endpoint in the pool")
            ep = min(live, key=lambda e: len(e.sessions))  # min() keeps the first on ties
            ep.sessions.add(session)
            self.sticky[session] = ep
            return ep.base_url

    def release(self, session: str) -> None:
        with self.lock:
            ep = self.sticky.pop(session, None)
            if ep is not None:
                ep.sessions.discard(session)

    def load(self) -> dict[str, int]:
        with self.lock:
            return {e.base_url: len(e.sessions) for e in self.endpoints}

    def check(self, timeout: float = 2.0) -> list[str]:
        """Probe every endpoint's /health; returns the URLs that are down now (marked unhealthy)."""
        down = []
        for e in self.endpoints:
            try:
                ok = httpx.get(e.base_url.removesuffix("/v1") + "/health", timeout=timeout).status_code == 200
            except httpx.HTTPError:
                ok = False
            with self.lock:
                e.healthy = ok
            if not ok:
                down.append(e.base_url)
        return down


class ServerPool:
    """Several inference servers used as one by `train.rl.run`: the first answers version queries,
    every one gets the new weights after a step (in parallel: each loads the same folder from disk)."""

    def __init__(self, servers: list[Server]):
        if not servers:
            raise ValueError("a server pool needs at least one server")
        self.servers = servers

    @classmethod
    def from_urls(cls, urls: list[str], model: str, api_key: str | None = None) -> ServerPool:
        return cls([Server(u.rstrip("/"), model, api_key) for u in urls])

    @property
    def base_url(self) -> str:
        return self.servers[0].base_url

    @property
    def urls(self) -> list[str]:
        return [s.base_url for s in self.servers]

    @property
    def model(self) -> str:
        return self.servers[0].model

    @property
    def api_key(self) -> str | None:
        return self.servers[0].api_key

    def version(self) -> int | None:
        versions = {s.version() for s in self.servers}
        return versions.pop() if len(versions) == 1 else None  # disagreeing servers: sync them all

    def load_weights(self, path: str | Path, version: int, timeout: float = 600.0) -> float:
        """Every server loads `path` as `version`; returns the slowest one's seconds."""
        with ThreadPoolExecutor(len(self.servers)) as ex:
            return max(ex.map(lambda s: s.load_weights(path, version, timeout), self.servers))

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
