# Sourced by the benchmarks/gpu_*.sh device-call scripts (repository root, on the GPU
# machine): install the wheels carried in .whl/ (the packages the GPU image lacks:
# optuna, sqlite-utils, ...) into /tmp/site, put them and the repository on PYTHONPATH,
# and unbuffer Python's output so a killed step still leaves its log.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1

# tune_step SECONDS LOG ARGS...: `flashgen tune ARGS` into tuning_db/h200.sqlite under a
# timeout, its log (progress bars dropped) in $out/LOG, the database copied to
# $out/h200.sqlite (copy it back into tuning_db/ and commit it), and the log's summary
# (precompile, float64 check, the best-config table) printed.
tune_step() {
  local secs=$1 log=$2
  shift 2
  timeout "$secs" python3 -m flashgen tune --db tuning_db/h200.sqlite "$@" 2>&1 | grep -v "━" > "$out/$log"
  # The database runs in WAL mode: a plain cp of the main file misses what a killed
  # tune left in the -wal file (session 5 lost a key that way); sqlite's backup copies
  # both.
  python3 -c "import sqlite3, sys; s = sqlite3.connect(sys.argv[1]); d = sqlite3.connect(sys.argv[2]); s.backup(d); d.close()" \
    tuning_db/h200.sqlite "$out/h200.sqlite"
  grep -E "precompiled|correctness|tuning|│" "$out/$log"
}
