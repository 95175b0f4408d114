"""Reaching Ray, and how many actors go where.

``connect("local")`` starts a Ray instance inside this process's command (127.0.0.1 only, no
dashboard) and stops it at the end; ``connect("auto")``, ``connect("HOST:PORT")`` or
``connect("ray://HOST:PORT")`` joins a running cluster (``ray start --head`` and friends), whose
nodes must have edgevlm installed. Ray is an optional extra: without it, one line says how to
install it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ClusterError, InputError

__all__ = ["ActorLayout", "Cluster", "DEFAULT_BATCH", "READ_CPUS", "connect", "layout", "ray_module"]

# items (images, batch lines) per actor call: its in-flight slots stay full, and a killed actor redoes
# one batch
DEFAULT_BATCH = 16

READ_CPUS = 0.25  # what a Ray Data read task asks for: reading never waits for a whole CPU


def ray_module() -> Any:
    """``ray`` with Ray Data, or one line saying how to get it."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise InputError("--ray needs Ray, an optional extra: pip install 'edgevlm[ray]'") from None
    return ray


@dataclass(frozen=True)
class Cluster:
    address: str  # as given: local, auto, HOST:PORT, ray://HOST:PORT
    nodes: int
    cpus: float
    gpus: float
    started_here: bool  # a local instance this command started (and stops)

    def describe(self) -> str:
        where = "a local Ray instance" if self.started_here else f"the Ray cluster at {self.address}"
        gpus = f", {self.gpus:g} GPU" if self.gpus else ""
        return f"{where}: {self.nodes} node(s), {self.cpus:g} CPU{gpus}"


def _quiet(ray: Any, verbose: bool) -> None:
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # edgevlm's own progress shows on the driver
    for attr in ("print_on_execution_start", "enable_operator_progress_bars"):
        if hasattr(ctx, attr):
            setattr(ctx, attr, False)
    if not verbose:
        for name in ("ray", "ray.data", "ray.serve"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # a failure is edgevlm's one line


@contextlib.contextmanager
def connect(address: str = "local", *, num_cpus: int | None = None, verbose: bool = False) -> Iterator[Cluster]:
    """Connect for the duration of a ``with``; the cluster's size as Ray reports it."""
    ray = ray_module()
    if ray.is_initialized():  # a caller's own session (a notebook): use it, leave it running
        yield _describe(ray, address, False)
        return
    kwargs: dict[str, Any] = dict(
        log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.ERROR, configure_logging=True
    )
    if not verbose:  # Ray's C++ core logs warnings to stderr (e.g. about Ray Data's own actor
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")  # arguments); failures still raise
    started = address == "local"
    if started:
        kwargs.update(
            address="local",
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            # Ray starts its workers at nice 15 by default: beside any other busy process they
            # get a sliver of the CPU, and llama.cpp's threads, meeting at a barrier per graph
            # node, wait a time slice at each. 6 tiny pictures took 208 s instead of 8 with three
            # other CPU-bound processes on 2 cores. The actors are this command's work: they run
            # at its own priority.
            _system_config={"worker_niceness": 0},
        )
    else:
        kwargs["address"] = address
    try:
        with _stderr_hushed(not verbose):
            ray.init(**kwargs)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError ...
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        what = "start a local Ray instance" if started else f"connect to Ray at {address}"
        raise ClusterError(f"cannot {what}: {msg}") from None
    try:
        _quiet(ray, verbose)
        yield _describe(ray, address, started)
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _stderr_hushed(on: bool) -> Iterator[None]:
    """File descriptor 2 to the null device while Ray starts: its C++ core prints a line about
    the log level it read from the environment. A failure still raises, with its message."""
    if not on:
        yield
        return
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _describe(ray: Any, address: str, started: bool) -> Cluster:
    res = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return Cluster(address, max(1, len(nodes)), float(res.get("CPU", 0)), float(res.get("GPU", 0)), started)


@dataclass(frozen=True)
class ActorLayout:
    """How many captioning actors, what each asks Ray for, and llama.cpp threads in each."""

    actors: int
    num_cpus: float
    num_gpus: float
    threads: int | None

    def describe(self) -> str:
        each = f"{self.num_gpus:g} GPU" if self.num_gpus else f"{self.threads} thread(s)"
        return f"{self.actors} actor(s), {each} each"


def layout(cluster: Cluster, actors: int | None = None, threads: int | None = None) -> ActorLayout:
    """``actors`` None (``--actors auto``): one per GPU on a GPU cluster, else one per node.

    On CPUs an actor runs llama.cpp with the threads of its share of a node (a node's CPUs over
    the actors it holds); what it asks Ray for is less than that, so Ray Data's read tasks always
    find room beside the actors (a read task asks ``READ_CPUS``)."""
    if actors is not None and actors < 1:
        raise InputError(f"--actors {actors}: give 1 or more, or auto")
    if cluster.gpus >= 1:
        n = actors or int(cluster.gpus)
        return ActorLayout(n, 1.0, min(1.0, cluster.gpus / n), threads)
    n = actors or cluster.nodes
    per_node = math.ceil(n / cluster.nodes)
    cpus_node = cluster.cpus / cluster.nodes if cluster.nodes else cluster.cpus
    ask = max(0.05, min(1.0, (cpus_node - READ_CPUS) / per_node))
    return ActorLayout(n, round(ask, 3), 0.0, threads or max(1, int(cpus_node // per_node)))
