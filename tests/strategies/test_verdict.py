"""The main process's verdict told to every process before a process group exists (accelerator/verdict.py).

Two "ranks" as two threads of this process, sharing the launch's store (a TCPStore on a free port, served by
rank 0 as under `mixprec torchrun`): the protocol is the one torchrun's workers run (the CLI's run folder
lock under torchrun was checked by hand: both ranks print the lock's one-line error and exit 2)."""

from __future__ import annotations

import socket
import threading
import uuid

import pytest

from mixprec.checkpoint import FolderInUseError
from mixprec.strategies import peers
from mixprec.strategies.verdict import main_decides


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _both_ranks(check) -> list[object]:
    base = {
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
    }
    outcome: list[object] = [None, None]

    def rank(r: int) -> None:
        try:
            outcome[r] = (
                "returned",
                main_decides("lock", check, (FolderInUseError,), environ={**base, "RANK": str(r)}),
            )
        except Exception as err:  # noqa: BLE001 - the outcome is what the test looks at
            outcome[r] = ("raised", err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    peers._opened.clear()  # close the store this launch opened (a torchrun worker keeps it for its life)
    return outcome


def test_a_refusal_on_the_main_process_is_raised_on_every_process_with_its_message() -> None:
    def refused() -> None:
        raise FolderInUseError("run folder runs/x is in use by another run (process 4242)")

    (kind0, err0), (kind1, err1) = _both_ranks(refused)
    assert (kind0, kind1) == ("raised", "raised")
    assert type(err0) is FolderInUseError and type(err1) is FolderInUseError
    assert str(err1) == f"{err0} (told by the main process)"


def test_success_returns_the_main_process_result_there_and_none_elsewhere() -> None:
    assert _both_ranks(lambda: "held") == [("returned", "held"), ("returned", None)]


def test_one_process_runs_the_check_alone() -> None:
    with pytest.raises(FolderInUseError):
        main_decides("lock", lambda: (_ for _ in ()).throw(FolderInUseError("busy")), (FolderInUseError,), environ={})
    assert main_decides("lock", lambda: 7, (FolderInUseError,), environ={}) == 7
