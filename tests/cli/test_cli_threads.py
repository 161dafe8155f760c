"""How many threads `mixprec train` uses (mixprec.cli._threads): the cores free at start, not the cores there are."""

from __future__ import annotations

from mixprec.cli import _threads


def test_busy_cores_leave_fewer_threads_and_a_quiet_machine_gets_torchs_default(monkeypatch):
    monkeypatch.setattr(_threads.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: {0, 1})
    busy = _threads.choose_threads({}, measure=lambda: 1.3)
    assert busy.threads == 1 and "1.3 busy" in busy.describe()
    assert _threads.choose_threads({}, measure=lambda: 0.1).threads == 2
    assert _threads.choose_threads({}, measure=lambda: 5.0).threads == 1  # never fewer than one


def test_omp_num_threads_wins_and_an_unreadable_load_keeps_torchs_default(monkeypatch):
    monkeypatch.setattr(_threads.torch, "get_num_threads", lambda: 2)
    choice = _threads.choose_threads({"OMP_NUM_THREADS": "2"}, measure=lambda: 2.0)
    assert choice.threads == 2 and choice.why == "OMP_NUM_THREADS"
    assert _threads.choose_threads({}, measure=lambda: None).threads == 2


def test_the_machines_busy_time_is_read_from_proc_stat():
    busy = _threads.busy_cores(0.05)
    assert busy is None or 0.0 <= busy <= (_threads.os.cpu_count() or 1) + 0.01
