"""Several tuning workers sharing studies through Optuna's storages (journal file on one
host; PostgreSQL for several machines), with a fake benchmarker replaying timings.

Each (key, variant) is measured and recorded exactly once however many workers run,
the best config equals a single worker's over the same timings, and a worker killed
mid-trial leaves its trial FAILed (and the budget completed by the others).  Stopping
`flashgen tune --workers` (SIGTERM, Ctrl-C, or SIGKILL of the parent) leaves no worker
running and keeps the rows recorded.
"""

import hashlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from flashgen import presets, space, tuner
from flashgen.arch import TABLE
from flashgen.db import TuningDB
from flashgen.env import Environment
from flashgen.spec import Variant

ENV = Environment("fake-gpu", "9.0", 132, "3.6.0", "2.13.0", "0.1.0")
ARCH = TABLE["sm_90"]
ITEMS = presets.expand(["small"], "float16", ["bwd_dq"])


def _timings():
    """A deterministic, distinct time for every config of every spec in ITEMS."""
    out = {}
    for key, _ in ITEMS:
        for cfg in space.configs(key.spec.kernel):
            vid = Variant(key.spec, cfg).id
            out[vid] = 0.1 + int(hashlib.sha256(vid.encode()).hexdigest()[:8], 16) / 2**32
    return out


TIMINGS = _timings()
N_TRIALS = 500  # more than any domain: the grid sampler's exhaustion ends each study


def _configs(tmp_path, n, storage, delay=0.0):
    return [tuner.WorkerConfig(i, str(tmp_path / "db.sqlite"), storage, ENV, ARCH, N_TRIALS,
                               sampler="grid", fake_timings=TIMINGS, fake_delay_s=delay)
            for i in range(n)]


def _single_worker_best(tmp_path):
    with TuningDB(tmp_path / "single.sqlite") as db:
        tuner.tune(ITEMS, benchmarker=tuner.FakeBenchmarker(TIMINGS), db=db, env=ENV, arch=ARCH,
                   n_trials=N_TRIALS, storage=str(tmp_path / "single.journal"), sampler="grid")
        return {key.id: db.best(key, ENV)["variant_id"] for key, _ in ITEMS}


def _check_shared_run(tmp_path, storage, n_workers):
    codes = tuner.tune_parallel(ITEMS, _configs(tmp_path, n_workers, storage))
    assert set(codes.values()) == {0}, codes
    st = tuner.open_storage(storage, None)
    with TuningDB(tmp_path / "db.sqlite") as db:
        rows = db.rows(env=ENV)
        pairs = [(r["key"], r["variant_id"]) for r in rows]
        assert len(pairs) == len(set(pairs)), "a (key, variant) was recorded twice"
        for key, _ in ITEMS:
            n_configs = len(list(space.configs(key.spec.kernel)))
            assert sum(1 for k, _ in pairs if k == key.id) == n_configs  # every config, once
            study = optuna.load_study(study_name=tuner.study_name(ENV, key), storage=st)
            done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            assert {t.user_attrs["variant_id"] for t in done} == {v for k, v in pairs if k == key.id}
            assert {t.user_attrs["worker"] for t in done} <= {f"w{i}" for i in range(n_workers)}
            ids = {r["id"] for r in rows}
            assert all(t.user_attrs["row_id"] in ids for t in done)
            assert not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        best = {key.id: db.best(key, ENV)["variant_id"] for key, _ in ITEMS}
    assert best == _single_worker_best(tmp_path)
    return st


@pytest.mark.parametrize("n_workers", [2, 4])
def test_journal_storage_workers_record_each_trial_once(tmp_path, n_workers):
    st = _check_shared_run(tmp_path, str(tmp_path / "studies.journal"), n_workers)
    workers = {t.user_attrs["worker"] for s in st.get_all_studies()
               for t in st.get_all_trials(s._study_id, deepcopy=False)}
    assert len(workers) >= 2, "the studies were not shared"


def test_a_killed_worker_fails_its_trial_and_others_finish(tmp_path):
    storage = str(tmp_path / "studies.journal")
    st = tuner.open_storage(storage, None)
    killed = {}

    def killer(pids):
        def run():
            deadline = time.time() + 60
            while time.time() < deadline:
                for s in st.get_all_studies():
                    for t in st.get_all_trials(s._study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                        # params set: past the storage; still running 0.1 s later: inside the
                        # benchmarker's 0.3 s (a config another worker measured is answered
                        # from the database in milliseconds, and the kill would come after it)
                        if t.user_attrs.get("worker") == "w1" and len(t.params) == len(space.DOMAINS[ITEMS[0][0].spec.kernel]):
                            time.sleep(0.1)
                            if st.get_trial(t._trial_id).state != TrialState.RUNNING:
                                continue
                            os.kill(pids["w1"], signal.SIGKILL)
                            killed["trial"] = (s._study_id, t._trial_id)
                            return
                time.sleep(0.01)
        threading.Thread(target=run, daemon=True).start()

    n_trials = 6
    configs = [tuner.WorkerConfig(i, str(tmp_path / "db.sqlite"), storage, ENV, ARCH, n_trials,
                                  fake_timings=TIMINGS, fake_delay_s=0.3) for i in range(2)]
    failed = {}
    codes = tuner.tune_parallel(ITEMS, configs, on_start=killer,
                                on_exit=lambda name, code, n: failed.setdefault(name, n))
    assert codes == {"w0": 0, "w1": -signal.SIGKILL}
    assert failed == {"w0": 0, "w1": 1}  # its one running trial, marked FAIL by the supervisor
    assert st.get_trial(killed["trial"][1]).state == TrialState.FAIL
    with TuningDB(tmp_path / "db.sqlite") as db:
        pairs = [(r["key"], r["variant_id"]) for r in db.rows(env=ENV)]
        assert len(pairs) == len(set(pairs))
        for key, _ in ITEMS:  # the survivor filled every study's budget
            study = optuna.load_study(study_name=tuner.study_name(ENV, key), storage=st)
            assert not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            assert len(done) >= n_trials
            assert all(db.get(t.user_attrs["row_id"])["variant_id"] == t.user_attrs["variant_id"] for t in done)



# -- stopping a run with workers ---------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _sigint_state(pid: int) -> str:
    """How process ``pid`` takes SIGINT now (blocked, ignored, handled; Linux's /proc)."""
    try:
        status = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)
        bit = 1 << (signal.SIGINT - 1)
        return ", ".join(w for w, f in (("blocked", "SigBlk"), ("ignored", "SigIgn"), ("handled", "SigCgt"))
                         if int(status[f], 16) & bit) or "default action"
    except (OSError, KeyError, ValueError):
        return "unknown"


def _wait(p, pids: dict[str, int], lines: list[str], timeout: float = 20) -> int:
    """``p.wait(timeout)``; past it, the run and its workers are killed and the test
    fails with the workers still running (and how each took SIGINT) and the run's output."""
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    left = {n: _sigint_state(pid) for n, pid in pids.items() if _alive(pid)}
    for pid in (p.pid, *pids.values()):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    p.wait(timeout=10)
    time.sleep(0.2)  # the output reader
    pytest.fail(f"the run did not end within {timeout} s after the signal; workers still running: "
                f"{', '.join(f'{n} (SIGINT {st})' for n, st in left.items()) or 'none'}; its output:\n"
                + "".join(lines), pytrace=False)


@pytest.fixture
def workers_run(tmp_path):
    """:func:`_start_workers_run`; afterwards whatever it started and still runs is killed."""
    started = []

    def start(n_rows=20, **popen):
        started.append(_start_workers_run(tmp_path, n_rows, **popen))
        return started[-1]

    yield start
    for p, pids, _, _ in started:
        for pid in (p.pid, *pids.values()):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _start_workers_run(tmp_path, n_rows=20, **popen):
    """A `flashgen tune --workers 2 --fake-model` run long enough to be stopped, once
    both workers are tuning (each has begun a trial: its stop handlers are set) and
    ``n_rows`` rows are recorded; ``n_rows`` None: as soon as the workers are started
    (they are still starting: importing torch, for seconds, before they set their
    handlers).  Returns (process, {worker: pid}, rows recorded so far, the lines printed
    so far).

    "workers started" and the rows alone were once waited for, but the rows may all be one
    worker's while the other still starts (on two loaded cores the second worker often set
    its handlers only once up to 14 of the 20 rows were there): a signal meant for a
    tuning worker could reach a starting one."""
    import re

    from flashgen.db import row_count

    db = tmp_path / "w.sqlite"
    journal = tuner.default_journal(db)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "flashgen", "tune", "--preset", "fa-grid", "--fake-model", "--db",
                          str(db), "--trials", "30", "--workers", "2"], cwd=tmp_path, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True).start()
    deadline = time.time() + 60
    pids: dict[str, int] = {}
    storage = None
    tuning: set = set()

    def ready() -> bool:
        nonlocal storage
        if not pids:
            return False
        if n_rows is None:
            return True
        if not tuning >= set(pids):
            storage = storage or tuner.open_storage(journal, None)
            tuning.update(t.user_attrs.get("worker") for s in storage.get_all_studies()
                          for t in storage.get_all_trials(s._study_id, deepcopy=False))
        return tuning >= set(pids) and row_count(db) >= n_rows

    while time.time() < deadline and p.poll() is None and not ready():
        started = [ln for ln in lines if ln.startswith("workers started:")]
        if started:
            pids = {n: int(pid) for n, pid in re.findall(r"(w\d+) \(pid (\d+)\)", started[0])}
        time.sleep(0.1)
    assert p.poll() is None and len(pids) == 2 and ready(), (f"workers tuning: {sorted(tuning)}\n"
                                                               + "".join(lines))
    with TuningDB(db, readonly=True) as d:
        rows = d.rows()
    return p, pids, rows, lines


def _check_rows_kept(tmp_path, rows_before):
    with TuningDB(tmp_path / "w.sqlite", readonly=True) as d:
        now = {r["id"]: r for r in d.rows()}
    assert all(now.get(r["id"]) == r for r in rows_before)
    st = tuner.open_storage(str(tmp_path / "w.sqlite.optuna.journal"), None)
    running = [t for s in st.get_all_studies() for t in st.get_all_trials(s._study_id, deepcopy=False,
                                                                          states=(TrialState.RUNNING,))]
    assert not running, "a stopped worker left its trial RUNNING"


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_stopping_a_run_with_workers_stops_them_and_keeps_rows(tmp_path, workers_run, how):
    # Ctrl-C at a terminal sends SIGINT to the whole process group: the run and its workers.
    p, pids, rows, lines = workers_run(start_new_session=True)
    if how == "SIGTERM":
        p.send_signal(signal.SIGTERM)
    else:
        os.killpg(p.pid, signal.SIGINT)
    signum = signal.SIGTERM if how == "SIGTERM" else signal.SIGINT
    assert _wait(p, pids, lines) == 128 + signum, "".join(lines)
    deadline = time.time() + 5
    while any(map(_alive, pids.values())) and time.time() < deadline:
        time.sleep(0.1)
    assert not [n for n, pid in pids.items() if _alive(pid)]
    time.sleep(0.2)  # the output reader
    out = "".join(lines)
    assert "Traceback" not in out, out
    assert f"stopped by {signal.Signals(signum).name}; " in out and "rows recorded so far" in out, out
    # a worker stops on the signal itself, or on the SIGTERM the parent forwards (the one
    # its handler meets first); never killed
    codes = {128 + signum, 128 + signal.SIGTERM}
    for name in pids:
        assert any(f"worker {name} exited with {c}\n" in out for c in codes), out
    _check_rows_kept(tmp_path, rows)


@pytest.mark.parametrize("when", ["tuning", "starting"])
def test_a_stop_signal_that_reaches_only_the_workers_stops_the_run(tmp_path, workers_run, when):
    """Every worker stopped by Ctrl-C while the run itself missed the signal (here sent to
    the workers alone): the run reports itself stopped, exit code 130, not a finished run.
    ``starting``: the signal comes as soon as the workers are started, while they import
    torch before setting their handlers; it waits for the handler (a worker once ignored
    it there and tuned on: the run never stopped)."""
    p, pids, rows, lines = workers_run(n_rows=20 if when == "tuning" else None, start_new_session=True)
    for pid in pids.values():
        os.kill(pid, signal.SIGINT)
    # starting: the workers' start (seconds under load) comes before their stop
    assert _wait(p, pids, lines, timeout=20 if when == "tuning" else 40) == 128 + signal.SIGINT, "".join(lines)
    time.sleep(0.2)  # the output reader
    out = "".join(lines)
    assert "Traceback" not in out, out
    assert "stopped by SIGINT; " in out and ("rows recorded so far" in out or "no row was recorded" in out), out
    for name in pids:
        assert f"worker {name} exited with {128 + signal.SIGINT}\n" in out, out
    if "no row was recorded" in out:  # stopped before measuring: the run leaves no file behind
        assert not rows and not list(tmp_path.glob("w.sqlite*")), out
    else:
        _check_rows_kept(tmp_path, rows)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_a_stop_signal_no_measurement_meets_still_stops_the_worker(tmp_path, monkeypatch, signum):
    """A worker signalled where no measurement is left to start (its remaining trials
    already recorded or refused) exits with 128 + the signal, not 0, so the run reports
    itself stopped; a terminal's hang-up stops it the same way (it once killed it)."""
    def tune_without_measuring(*args, **kwargs):
        os.kill(os.getpid(), signum)  # held by the worker's handler: no measurement runs

    monkeypatch.setattr(tuner, "tune", tune_without_measuring)
    saved = {s: signal.getsignal(s) for s in tuner._ALL_STOP_SIGNALS}
    try:
        with pytest.raises(SystemExit) as e:
            tuner._worker_main([], _configs(tmp_path, 1, str(tmp_path / "journal"))[0])
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert e.value.code == 128 + signum


def test_a_stop_signal_while_a_worker_starts_is_raised_once_the_worker_is_recorded():
    """The tuning process holds a stop signal that comes while it starts a worker, even
    one delivered to another of its threads (the mask holds the calling thread's only),
    and raises it once ``started`` has recorded the worker: else the run stopped without
    stopping that worker, which tuned on."""
    go = threading.Event()

    def send():
        go.wait(10)
        os.kill(os.getpid(), signal.SIGINT)

    # started before the block: it does not block SIGINT, so the kernel may deliver there
    sender = threading.Thread(target=send, daemon=True)
    sender.start()

    class Starting:
        def start(self):
            go.set()
            sender.join(10)
            for _ in range(200):  # Python runs a signal's handler between bytecodes
                time.sleep(0.001)

    recorded = []
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            tuner._start_worker(Starting(), lambda: recorded.append("w0"))
    finally:
        signal.signal(signal.SIGINT, before)
    assert recorded == ["w0"]


def test_workers_stop_by_themselves_when_the_run_is_killed(tmp_path, workers_run):
    p, pids, rows, lines = workers_run()
    p.kill()  # SIGKILL: nothing of the parent runs, its workers are orphaned
    _wait(p, pids, lines, timeout=10)
    deadline = time.time() + 10
    while any(map(_alive, pids.values())) and time.time() < deadline:
        time.sleep(0.1)
    assert not [n for n, pid in pids.items() if _alive(pid)], "".join(lines)
    time.sleep(0.2)
    out = "".join(lines)
    assert "Traceback" not in out, out
    for name in pids:
        assert f"flashgen worker {name}: the tuning process {p.pid} is gone; stopping" in out, out
    _check_rows_kept(tmp_path, rows)


# -- PostgreSQL: a real server on loopback --------------------------------------------
#
# The server programs come from the pgserver wheel (flashgen's test extra: PostgreSQL
# built for pip, nothing installed system-wide), or else from a system install
# (/usr/lib/postgresql/*/bin).  PostgreSQL refuses to run as root: as root the programs
# are copied to a temporary directory and run as the unprivileged user ``nobody``, so no
# user is created and no permission outside that directory changes.

def _pg_install() -> Path:
    """The PostgreSQL install tree (bin/, lib/, share/) to run."""
    spec = importlib.util.find_spec("pgserver")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        tree = Path(root) / "pginstall"
        if (tree / "bin" / "initdb").exists():
            return tree
    hits = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if hits:
        return hits[-1].parent.parent
    pytest.fail("PostgreSQL's server programs are not installed: `pip install -e '.[test]'` installs the pgserver "
                "wheel that carries them (or install a system PostgreSQL)")


@pytest.fixture(scope="module")
def pg_bin():
    """(bin directory, command prefix that runs a program unprivileged)."""
    tree = _pg_install()
    if os.geteuid() != 0:
        yield tree / "bin", []
        return
    as_nobody = ["runuser", "-u", "nobody", "--"]
    if tree.parent.name != "pgserver":  # a system install: world-readable in place
        yield tree / "bin", as_nobody
        return
    # The wheel's programs find their libraries through $ORIGIN/../../../pgserver.libs:
    # copy that layout where nobody can read it (site-packages may sit under /root).
    copy = Path(tempfile.mkdtemp(prefix="flashgen-pginstall-"))
    try:
        for src, dst in ((tree, copy / "pgserver" / "pginstall"), (tree.parent.parent / "pgserver.libs",
                                                                  copy / "pgserver.libs")):
            if src.exists():
                shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("include"))
        for d in [copy, *(p for p in copy.rglob("*") if p.is_dir())]:
            d.chmod(0o755)
        yield copy / "pgserver" / "pginstall" / "bin", as_nobody
    finally:
        shutil.rmtree(copy, ignore_errors=True)


@pytest.fixture
def postgres_url(pg_bin):
    import psycopg2  # noqa: F401  (flashgen[distributed]; .ci/run installs it)

    bin_dir, as_user = pg_bin
    base = Path(tempfile.mkdtemp(prefix="flashgen-pg-"))  # pytest's tmp is root-only
    tmp_path, data = base, base / "pgdata"
    data.mkdir()
    if as_user:  # the server refuses to run as root: its files belong to nobody
        shutil.chown(base, "nobody")
        shutil.chown(data, "nobody")
    subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
                   check=True, capture_output=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = f"-p {port} -k {tmp_path} -c listen_addresses=127.0.0.1 -c max_connections=50"
    subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-o", opts, "-w", "-l",
                    str(tmp_path / "pg.log"), "start"], check=True, capture_output=True)
    try:
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("n_workers", [2, 4])
def test_postgres_storage_workers_record_each_trial_once(tmp_path, postgres_url, n_workers):
    _check_shared_run(tmp_path, postgres_url, n_workers)


def test_cli_tune_with_workers(tmp_path):
    import json

    from typer.testing import CliRunner

    from flashgen.cli import app

    timings = tmp_path / "t.json"
    timings.write_text(json.dumps(TIMINGS))
    db = tmp_path / "cli.sqlite"
    res = CliRunner().invoke(app, ["tune", "--preset", "small", "--kernels", "bwd_dq", "--dtype", "float16",
                                   "--fake", str(timings), "--db", str(db), "--trials", "5",
                                   "--workers", "2"])
    assert res.exit_code == 0, res.output
    assert "2 workers done" in res.output and "exited with 0" in res.output
    for key, _ in ITEMS:
        assert key.id in res.output
    with TuningDB(db) as d:
        pairs = [(r["key"], r["variant_id"]) for r in d.rows()]
        assert len(pairs) == len(set(pairs)) and len(pairs) >= 5
    bad = CliRunner().invoke(app, ["tune", "--preset", "small", "--fake", str(timings), "--db", str(db),
                                   "--sampler", "random"])
    assert bad.exit_code == 2 and "--sampler" in bad.output



_SIGNALLED_WORKERS = r"""
import multiprocessing as mp, os, pathlib, signal, sys, threading, time
sys.path.insert(0, TESTS)
import test_distributed as T
from flashgen import tuner

def flood(pid, stop):
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        time.sleep(0.0005)

if __name__ == "__main__":
    tmp = pathlib.Path(TMP)
    cfg = T._configs(tmp, 1, str(tmp / "journal.log"))[0]
    for _ in range(3):
        p = mp.get_context("spawn").Process(target=tuner._worker_main, args=([], cfg))
        tuner._start_worker(p)
        stop = threading.Event()
        t = threading.Thread(target=flood, args=(p.pid, stop), daemon=True)
        t.start()
        p.join(timeout=120)
        stop.set()
        t.join()
        print("EXIT", p.exitcode, flush=True)
"""


def test_a_worker_signalled_from_its_start_to_its_exit_keeps_its_exit_code(tmp_path):
    """SIGTERM every half millisecond at a worker from the moment it is started
    (tuner._start_worker, in a fresh interpreter, so the first start also starts
    multiprocessing's resource tracker) until it has exited: it runs no key, so it ends
    at once, and it must exit with its own code (0, or 143 had it been measuring), never
    be killed by the signal (-15): not while Python starts (SIGTERM blocked until its
    handler is set), not while it shuts down (where Python puts a handled signal back to
    its default action)."""
    script = tmp_path / "signalled.py"
    script.write_text(f"TESTS = {str(Path(__file__).parent)!r}\nTMP = {str(tmp_path)!r}\n" + _SIGNALLED_WORKERS)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    codes = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("EXIT ")]
    assert len(codes) == 3 and set(codes) <= {0, 128 + signal.SIGTERM}, (codes, r.stderr[-3000:])


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_inside_a_storage_write_waits_for_a_safe_point(tmp_path, monkeypatch, signum):
    """A single-process tune stopped while Optuna writes its journal: the signal is held
    until the next measurement starts (that trial is marked FAIL) or Optuna's call
    ends, so the write completes, no trial is left RUNNING and the run stops with
    Interrupted.  Ctrl-C inside one of these writes (the 17th with Optuna 5.1) raised
    KeyboardInterrupt there, which left its trial RUNNING and ended in Optuna's
    UnboundLocalError.  SIGINT inside each of the first writes; SIGTERM (whose default
    action outside flashgen's handlers would end this test process) inside a few."""
    from optuna.storages.journal import JournalFileBackend

    real = JournalFileBackend.append_logs
    for n in range(2, 30) if signum == signal.SIGINT else (6, 17):
        writes = []

        def append_logs(self, logs, n=n, writes=writes):
            writes.append(1)
            if len(writes) == n:
                os.kill(os.getpid(), signum)  # delivered at the next bytecode, inside this write
                time.sleep(0.01)
            return real(self, logs)

        monkeypatch.setattr(JournalFileBackend, "append_logs", append_logs)
        storage = str(tmp_path / f"s{n}.journal")
        with TuningDB(tmp_path / f"db{n}.sqlite") as db, pytest.raises(KeyboardInterrupt) as info:
            tuner.tune(ITEMS, benchmarker=tuner.ModelBenchmarker(ARCH), db=db, env=ENV, arch=ARCH, n_trials=20,
                       storage=storage)
        monkeypatch.setattr(JournalFileBackend, "append_logs", real)
        assert tuner.stop_signal(info.value) == signum and len(writes) >= n, n
        st = tuner.open_storage(storage, None)
        states = [t.state for s in st.get_all_studies()
                  for t in optuna.load_study(study_name=s.study_name, storage=st).trials]
        assert TrialState.RUNNING not in states, (n, states)
