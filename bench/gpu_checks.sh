#!/usr/bin/env bash
# Issue 37's open GPU questions (docs/gpu.md, "Measured on an H200 after issue 37"), in one device call
# after the install runs of bench/README's "On a lent GPU" (py-spy comes in .gpu-tools, with the last):
#
#   bash bench/gpu_checks.sh        # everything in $OUT/gpu-checks.tgz (one file: a device call returns
#                                   # at most eight); ~7 minutes on an H200 (2026-11-28: five servers at
#                                   # DURATION=15 took ~350 s, ~70 s each; six now), so run it in a call of
#                                   # its own with timeout_s ~560
#
# Each served run is a fresh tmod-serve --workers 4 with two 15 s levels of one-text requests at c=256,
# the layout of the H100 and H200 rows (its first level after a start runs slower: read the second). In order:
#   1. py-spy on the engine process during the last level: the samples holding the GIL, per thread, and
#      all samples, idle included (which thread runs Python while the compute thread waits for the GIL);
#   2. launch ahead (this code: the tokenizer thread that prepared a batch launches its captured pass) against
#      sequential (the compute thread launches each pass once it has answered the one before, the order of
#      the H100 and H200 runs), alternated, two servers each: the batch-to-batch time against the pass says
#      whether the device still idles between passes (bench/bench_engine_load.py asks the same on a CPU);
#   3. the GIL's switch interval at 0.5 ms (Python's default: 5) in the engine process alone.
# On 2026-11-28 (H200) the batch window (2, 0.5, 0 ms) and the copy's wait made a sleep were measured here: the
# window is not the lever, and a replay's copy now waits on a blocking CUDA event (server/runner.py).
# PATH=$PWD/.venv/bin:$PATH DEVICE=cpu LEVELS=1x16 DURATION=2 checks the script on a CPU (its python3 needs torch).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/tmod-site TMOD_DATA_DIR=${TMOD_DATA_DIR:-$PWD/.gpu-data} PYTHONUNBUFFERED=1
results=${OUT:-/tmp/gpu-checks}
out=$(mktemp -d)  # packed into $results/gpu-checks.tgz on exit, a timeout's too
mkdir -p "$results"
trap 'tar czf "$results/gpu-checks.tgz" -C "$out" .' EXIT
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
  echo "[$name] rc $? $(grep -E '^served' "$out/served-$name.log" | sed 's/^served workers=4 //' | tr '\n' ' ')"
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

# py-spy: the engine is the oldest process started as tmod-serve or server.cli. The profile is of the last
# level (the first after a start ran slow on the H200, p99 ~200 ms in all seven servers): from the server's
# readiness, each level before it (its warm-up and its seconds), then its own warm-up and a second
if [ -x "$pyspy" ]; then
  served pyspy &
  bench=$!
  engine="" port=""
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
    span=$(( duration / 3 > 1 ? duration / 3 : 1 ))  # two records within the level, with slack
    "$pyspy" record --pid "$engine" --gil --threads --rate 50 --duration "$span" --format raw \
      -o "$out/engine-gil.txt" > "$out/py-spy-gil.log" 2>&1
    "$pyspy" record --pid "$engine" --idle --threads --rate 50 --duration "$span" --format raw \
      -o "$out/engine-all.txt" > "$out/py-spy-all.log" 2>&1
    gzip -f "$out"/engine-*.txt 2>/dev/null
  fi
  wait "$bench"
  echo "[py-spy] engine pid ${engine:-none}: $(cd "$out" && ls engine-*.txt.gz 2>/dev/null | tr "\n" " ")"
else
  echo "[py-spy] $pyspy not here: carry .gpu-tools (bash bench/gpu_bundle.sh makes it)"
fi

# this code's order (each batch's captured pass launched by the tokenizer thread that prepared it) against
# the order before it (the compute thread launching each pass once it has answered the one before), in the
# engine process alone: `ModelRunner.launch` made to launch nothing when server.runner is first imported
# (imported here it would bring prometheus_client in before tmod-serve names its folder); two servers each,
# alternated, since servers of one code spread by ~2,000 req/s on an H200
sequential=$(engine_site <<'PY'
import importlib.abc, importlib.util, os


class AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "server.runner":
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
for round in 1 2; do
  served "launch-ahead-$round"
  TMOD_SEQUENTIAL_LOG=$out/sequential-set.log PYTHONPATH=$sequential:$PYTHONPATH served "sequential-$round"
done
echo "[sequential] set in: $(cat "$out/sequential-set.log" 2>/dev/null | wc -l) process(es)"

# the GIL's switch interval at 0.5 ms, where Python starts, in the engine process alone
site=$(engine_site <<'PY'
import os
if ENGINE:
    sys.setswitchinterval(0.0005)
    with open(os.environ["TMOD_SWITCH_LOG"], "a") as log:
        log.write(f"{os.getpid()} {sys.getswitchinterval()} {' '.join(sys.orig_argv[:3])}\n")
PY
)
TMOD_SWITCH_LOG=$out/switch-interval-set.log PYTHONPATH=$site:$PYTHONPATH served engine-switch0.5
echo "[engine-switch0.5] set in: $(cat "$out/switch-interval-set.log" 2>/dev/null | wc -l) process(es)"
