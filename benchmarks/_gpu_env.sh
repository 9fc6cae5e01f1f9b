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
