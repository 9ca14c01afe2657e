"""Run a function on N processes joined by a gloo process group, for tests.

`run_distributed(fn, world_size, *args)` spawns the ranks, which rendezvous as torchrun's workers do:
through a store this process hosts (on a port the OS picks, on loopback only, so there is no port to
race for), reached at MASTER_ADDR:MASTER_PORT. It returns every rank's result in rank order, and turns
any rank's exception or a timeout into one error in the caller that shows each failing rank's
traceback. Sibling ranks are killed on failure, so a crash never leaves a hung collective behind.

Ranks are spawned by default: each one starts Python and imports torch (a few seconds of CPU per rank).
A test suite that launches many times can call `use_forkserver(preload)` once (zerofit's own tests do, in
tests/conftest.py): ranks are then forked from one server process that imported `preload` once, so a
launch costs milliseconds of start-up instead. Each rank is still a fresh process with the caller's
current environment variables, working directory and sys.path.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerofit.distributed import arrival
from zerofit.distributed.loopback import LOOPBACK, listen_on_loopback


class DistributedTestError(AssertionError):
    """One or more ranks failed or timed out; the message holds their tracebacks."""


_START_METHOD = "spawn"


def use_forkserver(preload: Sequence[str] = ("torch",)) -> None:
    """From now on, fork ranks from a server process that imported the modules `preload` names once.

    For test suites (zerofit's own call it from tests/conftest.py): it saves the interpreter start and
    the imports on every launch. The server starts at the first launch; its modules are imported and
    never run anything, so every rank still starts from freshly imported modules.
    """
    global _START_METHOD
    mp.get_context("forkserver").set_forkserver_preload(list(preload))
    _START_METHOD = "forkserver"


def stop_forkserver() -> None:
    """Stop the fork server, if one runs, and wait for it: its ranks' CPU time is then counted in the
    caller's (`time pytest` tells the truth), and nothing outlives the test session."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", None) is not None:
        server._stop()


def _host_store(timeout_s: float) -> tuple[dist.TCPStore, int]:
    """The ranks' rendezvous store and its port, hosted here as torchrun's agent hosts its own: the server
    listens on a socket bound to loopback (torch's TCPStore alone would listen on every interface)."""
    with listen_on_loopback(0) as sock:
        port = sock.getsockname()[1]
        store = dist.TCPStore(LOOPBACK, port, None, True, timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=sock.fileno())
        sock.detach()  # the server owns the socket now and closes it when it stops
    return store, port


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
            threads: int, fn: Callable, args: tuple, results: Any, environ: dict[str, str]) -> None:
    # The caller's environment as it is now: a forked rank would otherwise see the fork server's, as it
    # was when the server started (a test's monkeypatch.setenv must reach its ranks).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port))
    # torch reads TORCH_DISTRIBUTED_DEBUG when torch.distributed is imported, which a forked rank did in the
    # fork server, with the server's environment: read it again from this one.
    dist.set_debug_level_from_env()
    torch.set_num_threads(threads)
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(LOOPBACK, port, None, False, timeout, wait_for_workers=False)
        dist.init_process_group(backend, store=dist.PrefixStore("run_distributed", store), rank=rank,
                                world_size=world_size, timeout=timeout)
        out = fn(rank, world_size, *args)
        # Plain pickle bytes: tensors travel by value, not as shared-memory handles that die with us.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        arrival.leave()  # what atexit does in a script; multiprocessing ends its children without atexit
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
                    backend: str = "gloo", threads: int | None = None,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` fresh processes; return their results by rank.

    `fn` must be importable (defined at module top level): ranks are spawned (or forked from the fork
    server, see use_forkserver), never forked from the caller, and import it by name. `env`: variables
    set in the ranks only, on top of the caller's environment (e.g. TORCH_DISTRIBUTED_DEBUG=DETAIL, which
    makes torch check that every rank issues the same collectives and raise where they differ).
    """
    ctx = mp.get_context(_START_METHOD)
    results = ctx.Queue()
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    store, port = _host_store(timeout)  # serves the ranks until this call returns
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, port, backend, timeout, threads, fn, args, results,
                               {**os.environ, **(env or {})}))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, timeout)
    finally:
        del store


def _collect(procs: list[Any], results: Any, timeout: float) -> list[Any]:
    """Every rank's result in rank order; the first failure (or the timeout) stops every rank."""
    world_size = len(procs)
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(failures) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(outputs) - set(failures))
                failures.update({r: f"rank {r} did not finish within {timeout:.0f}s" for r in missing})
                break
            try:
                rank, ok, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in outputs and r not in failures]
                for r in dead:
                    failures[r] = f"rank {r} died with exit code {procs[r].exitcode}"
                continue
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
            if failures:
                break  # a failed rank can leave its peers blocked in a collective: stop them all now
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise DistributedTestError(f"{len(failures)} of {world_size} ranks failed:\n{text}")
    return [outputs[r] for r in range(world_size)]
