"""A lost or stuck peer: the collective timeout, and one message naming the rank that did not answer.

A process that dies is noticed at once (its sockets close); one that is *stuck* (SIGSTOP, a deadlock, a
hung filesystem) is noticed only when a collective waits longer than the process group's timeout. gloo's
error then says only "Timed out waiting 300000ms for recv operation", not who was missing. So each survivor,
on such an error, writes "I am alive" into the launcher's key-value store (torchrun's agent hosts it, so it
outlives any worker) and waits a moment for the others' keys: the ranks whose keys never come are the ones
that did not answer. With two processes and no store to ask, the other rank is the answer.

The default timeout (:data:`DEFAULT_TIMEOUT_S`, 5 minutes) is far below torch's 30 minutes (HF's
``ddp_timeout=1800``): a stuck peer costs a job at most that long before the launcher restarts it or stops.
It must still exceed the longest stretch where one process works while the others wait in a collective:
the main process writing and hashing a checkpoint (about 1 s per GB on a local disk, far more on a slow
shared one), or a long evaluation that only some ranks run. Raise it for multi-GB checkpoints on slow disks.
Under NCCL the same timeout arms its watchdog, which aborts the process itself (it cannot raise here).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Mapping

import torch.distributed as dist

from mixprec.strategies.restarts import restarts_allowed_on_several_nodes

logger = logging.getLogger("mixprec.accelerator")

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a collective waits for every process before failing (Accelerator(timeout=...), ddp_timeout)."""

# What gloo and the c10d layer say when a peer is gone or silent (torch 2.x); matched in lower case.
_SIGNS = ("timed out", "timeout", "connection closed by peer", "connection reset", "broken pipe", "gloo", "nccl")


class PeerLostError(RuntimeError):
    """A collective failed because another process died or stopped answering within the timeout."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


def timeout_delta(seconds: float | None) -> datetime.timedelta:
    """The process group's timeout; ``None`` means :data:`DEFAULT_TIMEOUT_S`. Errors name the argument."""
    value = DEFAULT_TIMEOUT_S if seconds is None else seconds
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"Accelerator(timeout={seconds!r}): the collective timeout must be a number of seconds > 0")
    return datetime.timedelta(seconds=float(value))


def launcher_store(timeout: datetime.timedelta, environ: Mapping[str, str] = os.environ) -> dist.Store | None:
    """The launcher's store, under a prefix of its own for this restart (None: not under torchelastic).

    Why: torchrun's agent keeps ONE store for the whole job, where ``init_process_group("env://")`` writes its
    keys unprefixed, so a restarted worker group read the dead group's (1 restart in 3 failed with "Gloo
    connectFullMesh failed ... Connection refused" or hung). One prefix per restart: an empty namespace."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in environ:
        return _opened.get(_launch_key(environ))  # the store rank 0 opened before the group (open_early_store)
    if restarts_allowed_on_several_nodes(environ):  # the nodes' restart counts can differ (restarts.py)
        logger.warning(
            "several nodes with --max-restarts share torchrun's rendezvous store: after a restart their workers "
            "may not find each other; launch with `mixprec torchrun` or set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        )
    client = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    run, restart = environ.get("TORCHELASTIC_RUN_ID", "-"), environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"mixprec/{run}/attempt_{restart}/", client)


_opened: dict[tuple[str, ...], dist.Store] = {}


def _launch_key(environ: Mapping[str, str]) -> tuple[str, ...]:
    names = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RANK")
    return tuple(environ.get(name, "") for name in names)


def open_early_store(timeout: datetime.timedelta, environ: Mapping[str, str] = os.environ) -> dist.Store | None:
    """The launch's store before any process group exists (None: one process, or no MASTER_ADDR/PORT).

    torchrun's agent store when it offers one; else (``mixprec torchrun`` turns torch's shared store off, and
    other launchers never had one) the store ``init_process_group("env://")`` would open: a TCPStore served by
    rank 0 on MASTER_PORT. It is opened once per process and launch attempt, and :func:`launcher_store` hands
    the same one to the process group later (a second server on that port could not bind)."""
    if int(environ.get("WORLD_SIZE", "1")) < 2 or "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
        return None
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return launcher_store(timeout, environ)
    key = _launch_key(environ)
    if key not in _opened:
        rank = int(environ.get("RANK", "0"))
        server = dist.TCPStore(
            environ["MASTER_ADDR"],
            int(environ["MASTER_PORT"]),
            int(environ["WORLD_SIZE"]),
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        # No restart count in the prefix: each worker group serves a fresh store (rank 0 of this group binds
        # it), and after a restart the nodes' counts can differ (restarts.py), which would part the ranks.
        _opened[key] = dist.PrefixStore(f"mixprec/{environ.get('TORCHELASTIC_RUN_ID', '-')}/", server)
    return _opened[key]


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is how a collective reports a lost or silent peer (not a bug in the user's code)."""
    if isinstance(err, PeerLostError):
        return False
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    if not isinstance(err, RuntimeError):
        return False
    text = str(err).lower()
    return any(sign in text for sign in _SIGNS)


def silent_ranks(
    rank: int, world_size: int, wait_s: float, environ: Mapping[str, str] = os.environ
) -> tuple[int, ...] | None:
    """The ranks that do not check in within ``wait_s`` seconds through the launcher's store (None: no store
    could be reached). Every survivor calls it after its collective failed."""
    host, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        store = dist.TCPStore(
            host,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=max(wait_s, 1.0)),
            wait_for_workers=False,
        )
        # one namespace per launch and restart: keys of an earlier worker group must not count as alive
        run, restart = environ.get("TORCHELASTIC_RUN_ID", "-"), environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        scope = f"mixprec/alive/{run}/{restart}"
        store.set(f"{scope}/{rank}", "1")
        missing = [r for r in range(world_size) if r != rank]
        deadline = time.monotonic() + wait_s
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{scope}/{r}"])]
            if missing:
                time.sleep(0.1)
        return tuple(missing)
    except Exception:  # the store went with the main process (no torchrun agent): say what we can
        return None


def explain(err: BaseException, rank: int, world_size: int, timeout_s: float) -> PeerLostError:
    """The one-line error for a collective that failed on this process (``err``), naming the silent ranks."""
    wait = min(5.0, max(1.0, timeout_s / 4))
    ranks = silent_ranks(rank, world_size, wait)
    if ranks is None and world_size == 2:
        ranks = (1 - rank,)
    if ranks:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
        what = f"{who} did not answer"
    else:
        what = "a peer process failed (every rank still answers the launcher's store)"
    return PeerLostError(
        f"rank {rank}: {what}: a collective failed or waited longer than the {timeout_s:g} s timeout "
        f"({_first_line(err)}). The launcher restarts the job (torchrun --max-restarts) or stops it; raise the "
        "timeout with Accelerator(timeout=...) / TrainingArguments(ddp_timeout=...) if that process was only slow",
        tuple(ranks or ()),
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= 160 else text[:157] + "..."
