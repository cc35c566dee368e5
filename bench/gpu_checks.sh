#!/usr/bin/env bash
# Issue 37's open GPU question, one-text requests >= 8,000 req/s at p99 <= 50 ms (docs/gpu.md), and what
# to read if this code misses it, in one device call after the install runs of bench/README's "On a lent
# GPU" (py-spy comes in .gpu-tools, with the last):
#
#   bash bench/gpu_checks.sh        # everything in $OUT/gpu-checks.tgz (one file: a device call returns
#                                   # at most eight); ~70 s a check on an H200 (2026-11-28: five servers
#                                   # at DURATION=15 took ~350 s), seven by default, ~490 s, so run it in a
#                                   # call of its own with timeout_s ~580
#
# Each check is a fresh tmod-serve (--workers 4 unless said) with two 15 s levels of one-text requests at
# c=256, the layout of the H100 and H200 rows (its first level after a start runs slower: read the second).
# CHECKS names them, in order (a timeout cuts the last first); the default:
#   launch-ahead-1    this code as shipped: the tokenizer thread that prepared a batch launches its captured
#                     pass (the issue's target is read here and in launch-ahead-2);
#   bucket-runs-1     this code with --batch-shapes bucket_runs: a batch cut into runs of rows, each padded to
#                     its own bucket, where the graphs' pass times measured at capture say it pays (the H200's
#                     one-text batches of ~65 SST-2 rows, 13.5 tokens on average, were padded to ~6,100 tokens);
#   engines2          tmod-serve --engines 2 --workers 3 (two engine processes on the GPU, NVIDIA MPS when its
#                     control daemon is here and starts; first run on an H200 on 2026-11-29): the lever where one engine
#                     process's CPU is the cap;
#   pyspy             this code under py-spy on the engine process during its last level: the samples holding
#                     the GIL, per thread; all samples, idle included; and the running ones with their C frames
#                     (torch, CUDA) (py-spy slows it: not a rate to read);
#   launch-ahead-2, bucket-runs-2   the first pair again, alternated (servers of one code spread by ~2,000 req/s);
#   sequential-1      the order before launch-ahead (the compute thread launches each pass once it has answered
#                     the one before, the order of the H100 and H200 runs), in the engine process alone: the
#                     batch-to-batch time against the pass says whether the device still idles between passes
#                     (bench/bench_engine_load.py asks the same on a CPU); last, so a timeout cuts it first;
# and on request: switch0.5, the GIL's switch interval at 0.5 ms (Python's default: 5) in the engine alone.
# On 2026-11-28 (H200) the batch window (2, 0.5, 0 ms) and the copy's wait made a sleep were measured here: the
# window is not the lever, and a replay's copy now waits on a blocking CUDA event (server/runner/graphs.py).
# PATH=$PWD/.venv/bin:$PATH DEVICE=cpu LEVELS=1x16 DURATION=2 checks the script on a CPU (its python3 needs torch).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/tmod-site TMOD_DATA_DIR=${TMOD_DATA_DIR:-$PWD/.gpu-data} PYTHONUNBUFFERED=1
results=${OUT:-/tmp/gpu-checks}
out=$(mktemp -d)  # packed into $results/gpu-checks.tgz on exit, a timeout's too
mkdir -p "$results"
mps_quit() {  # the MPS daemon engines2 may start goes with the run (a daemon outlives the device call)
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
trap 'mps_quit; tar czf "$results/gpu-checks.tgz" -C "$out" .' EXIT
stop() {  # a timeout's TERM: each running bench_gpu.py stops its server and writes what it measured, then the pack
  pkill -TERM -f "bench/bench_gpu.py" 2>/dev/null
  # not `wait`: a bench_gpu.py started in a subshell (the profile's) is no job of this shell
  for _ in $(seq 150); do pgrep -f "bench/bench_gpu.py" > /dev/null || break; sleep 0.2; done
  exit 143
}
trap stop TERM
device=${DEVICE:-cuda} levels=${LEVELS:-1x256 1x256} duration=${DURATION:-15} warmup=3  # seconds a level, unrecorded
pyspy=${PYSPY:-/tmp/tmod-tools/py-spy}
if [ ! -x "$pyspy" ] && compgen -G ".gpu-tools/py_spy-*.whl" > /dev/null; then  # from gpu_bundle.sh's wheel
  python3 - "$pyspy" .gpu-tools/py_spy-*.whl <<'PY'
import os, sys, zipfile
target, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/scripts/py-spy"))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as out:
        out.write(z.read(name))
os.chmod(target, 0o755)
PY
fi

served() {  # a name, then bench_gpu.py options
  local name=$1
  shift
  # shellcheck disable=SC2086  # levels are words
  # in the background, waited for: a TERM to this script is handled at once, not after the run
  timeout 150 python3 bench/bench_gpu.py --device "$device" --sections served --workers 4 --levels $levels \
    --warmup "$warmup" --duration "$duration" "$@" --out "$out/served-$name.json" > "$out/served-$name.log" 2>&1 &
  wait $!
  echo "[$name] rc $? $(grep -E '^served' "$out/served-$name.log" | sed 's/^served //' | tr '\n' ' ')"
}

engine_site() {  # a sitecustomize.py (its body on stdin) in a new folder, printed: put it first on PYTHONPATH
  # its body acts where ENGINE is true: in the process started as tmod-serve or server.cli (the engine), not
  # in its workers (they come from a forkserver, `-c ...`) nor in bench_gpu.py's load generator
  local site
  site=$(mktemp -d)
  { echo 'import sys'
    echo 'ENGINE = any(arg.endswith(("server.cli", "tmod-serve")) for arg in sys.orig_argv[:3])'
    cat; } > "$site/sitecustomize.py"
  echo "$site"
}

check_pyspy() {
  # the engine is the oldest process started as tmod-serve or server.cli. The profile is of the last level
  # (the first after a start ran slow on the H200, p99 ~200 ms in all seven servers): from the server's
  # readiness, each level before it (its warm-up and its seconds), then its own warm-up and a second
  if [ ! -x "$pyspy" ]; then
    echo "[pyspy] $pyspy not here: carry .gpu-tools (bash bench/gpu_bundle.sh makes it)"
    return
  fi
  served pyspy &
  local bench=$! engine="" port="" before span
  for _ in $(seq 600); do  # the server's process, then its port (bench_gpu.py sets TMOD_PORT), then ready
    [ -n "$engine" ] || engine=$(pgrep -o -f 'server\.cli|tmod-serve' || true)
    [ -n "$engine" ] && [ -z "$port" ] && port=$(tr '\0' '\n' < "/proc/$engine/environ" | sed -n 's/^TMOD_PORT=//p')
    [ -n "$port" ] && python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/readyz', timeout=2)" \
      2> /dev/null && break
    sleep 0.5
  done
  before=$(( $(wc -w <<< "$levels") - 1 ))
  sleep $(( before * (warmup + duration) + warmup + 1 )) &  # waited for, as in served()
  wait $!
  if [ -n "$engine" ]; then
    # three records within the level, with slack for py-spy's start-up (~1 s each): DURATION >= 8 fits them
    # (at the default 15, 3 s each); a shorter level ends before the last, the native one
    span=$(( duration / 4 > 1 ? duration / 4 : 1 ))
    "$pyspy" record --pid "$engine" --gil --threads --rate 50 --duration "$span" --format raw \
      -o "$out/engine-gil.txt" > "$out/py-spy-gil.log" 2>&1
    "$pyspy" record --pid "$engine" --idle --threads --rate 50 --duration "$span" --format raw \
      -o "$out/engine-all.txt" > "$out/py-spy-all.log" 2>&1
    # with the C frames (torch, the CUDA runtime): where the engine's CPU goes beneath Python, e.g. a
    # thread spinning in a synchronize, or the graph launches and copies themselves
    "$pyspy" record --pid "$engine" --native --threads --rate 50 --duration "$span" --format raw \
      -o "$out/engine-native.txt" > "$out/py-spy-native.log" 2>&1
    gzip -f "$out"/engine-*.txt 2>/dev/null
  fi
  wait "$bench"
  echo "[pyspy] engine pid ${engine:-none}: $(cd "$out" && ls engine-*.txt.gz 2>/dev/null | tr "\n" " ")"
}

# the order before this code's, in the engine process alone: `ModelRunner.launch` made to launch nothing
# when server.runner.model_runner is first imported (imported here it would bring prometheus_client in
# before tmod-serve names its folder)
sequential=$(engine_site <<'PY'
import importlib.abc, importlib.util, os


class AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "server.runner.model_runner":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.ModelRunner.launch = lambda self, prepared, modules: prepared
            with open(os.environ["TMOD_SEQUENTIAL_LOG"], "a") as log:
                log.write(f"{os.getpid()} ModelRunner.launch left out\n")

        spec.loader.exec_module = exec_module
        return spec


if ENGINE:
    sys.meta_path.insert(0, AfterImport())
PY
)
check_sequential() {  # a name
  TMOD_SEQUENTIAL_LOG=$out/sequential-set.log PYTHONPATH=$sequential:$PYTHONPATH served "$1"
  echo "[$1] launch left out in: $(wc -l < "$out/sequential-set.log" 2>/dev/null || echo 0) process(es) so far"
}

# two engine processes, each with three workers (8 processes on the server's 8 CPUs), under NVIDIA MPS when
# its control daemon is here and starts (docs/gpu.md, "Several engine processes on one GPU"); without it
# the two CUDA contexts time-slice the GPU, and the name says which ran
check_engines2() {
  local mps="" name=engines2
  if command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=$out/mps-pipe CUDA_MPS_LOG_DIRECTORY=$out/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d > "$out/mps-start.log" 2>&1; then  # a process: the GPU's settings stay as found
      mps=on name=engines2-mps
    else
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
  fi
  echo "[engines2] NVIDIA MPS: ${mps:-not here or did not start}"
  served "$name" --workers 3 --engines 2
  mps_quit
}

# the GIL's switch interval at 0.5 ms, where Python starts, in the engine process alone
switch=$(engine_site <<'PY'
import os
if ENGINE:
    sys.setswitchinterval(0.0005)
    with open(os.environ["TMOD_SWITCH_LOG"], "a") as log:
        log.write(f"{os.getpid()} {sys.getswitchinterval()} {' '.join(sys.orig_argv[:3])}\n")
PY
)
check_switch() {
  TMOD_SWITCH_LOG=$out/switch-interval-set.log PYTHONPATH=$switch:$PYTHONPATH served engine-switch0.5
  echo "[engine-switch0.5] set in: $(wc -l < "$out/switch-interval-set.log" 2>/dev/null || echo 0) process(es)"
}

for check in ${CHECKS:-launch-ahead-1 bucket-runs-1 engines2 pyspy launch-ahead-2 bucket-runs-2 sequential-1}; do
  case $check in
    launch-ahead-*) served "$check" ;;
    bucket-runs-*) served "$check" --batch-shapes bucket_runs ;;
    sequential-*) check_sequential "$check" ;;
    engines2) check_engines2 ;;
    pyspy) check_pyspy ;;
    switch0.5) check_switch ;;
    *) echo "[$check] no such check (launch-ahead-N, bucket-runs-N, sequential-N, engines2, pyspy, switch0.5)" ;;
  esac
done
