#!/usr/bin/env bash
# Compile-only check of every CUDA source (csrc/cuda/*.cu) with nvcc: no GPU, no CUDA torch needed,
# and of every C++ source (csrc/*.cpp, csrc/cpu/*.cpp) as C++17 with the host compiler: torch < 2.13
# builds extensions as C++17 (the GPU host's torch 2.11 did; a std::bit_cast broke its build).
#
#   bash csrc/cuda/compile_check.sh                # sm_90, 2 parallel jobs
#   CUDA_ARCH=80 bash csrc/cuda/compile_check.sh   # another arch (or "90a", "80;90", ...)
#   JOBS=1 NVCC=/path/to/nvcc bash csrc/cuda/compile_check.sh csrc/cuda/draft.cu  # some files only
#   RESOURCES=1 bash csrc/cuda/compile_check.sh csrc/cuda/draft.cu   # + registers / spills per kernel
#
# Environment: CXX (host compiler of the C++17 check, default g++), CUDA_ARCH (default 90; ';'-separated list allowed), JOBS (default 2), NVCC (default
# nvcc on PATH, else /usr/local/cuda/bin/nvcc), PYTHON (default python3), NVCC_EXTRA (extra flags).
# Torch headers come from the installed torch (a CPU wheel is fine). Its headers lack the
# generated c10/cuda/impl/cuda_cmake_macros.h, so a stub is written to a temporary include dir
# (it is only added when the installed torch does not have the real one).
# Prints one line per file with its compile time; exits non-zero if any file fails.
set -u -o pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
csrc="$(cd "$here/.." && pwd)"
arch_list="${CUDA_ARCH:-90}"
jobs="${JOBS:-2}"
python="${PYTHON:-python3}"
nvcc="${NVCC:-}"
if [ -z "$nvcc" ]; then
  if command -v nvcc >/dev/null 2>&1; then nvcc="$(command -v nvcc)"; else nvcc=/usr/local/cuda/bin/nvcc; fi
fi
if [ ! -x "$nvcc" ] && ! command -v "$nvcc" >/dev/null 2>&1; then
  echo "compile_check: nvcc not found (set NVCC=...)" >&2
  exit 2
fi

torch_inc=""
for py in "$python" python3 python; do  # the first interpreter that has torch
  torch_inc="$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))' 2>/dev/null)"
  if [ -n "$torch_inc" ] && [ -d "$torch_inc" ]; then python="$py"; break; fi
  torch_inc=""
done
if [ -z "$torch_inc" ]; then
  echo "compile_check: cannot import torch (tried PYTHON=${PYTHON:-unset}, python3, python)" >&2
  exit 2
fi
py_inc="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
# Same C++11 ABI flag as the installed torch (harmless for a compile-only check, but keeps parity).
abi="$("$python" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))' 2>/dev/null || echo 1)"

work="$(mktemp -d "${TMPDIR:-/tmp}/hs_cuda_check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
stub_inc="$work/stub_include"
if [ ! -f "$torch_inc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  mkdir -p "$stub_inc/c10/cuda/impl"
  cat >"$stub_inc/c10/cuda/impl/cuda_cmake_macros.h" <<'EOF'
#pragma once
// Stub of the header torch generates at build time (absent from CPU wheels); compile checks only.
#define C10_CUDA_BUILD_SHARED_LIBS
EOF
fi

gencode=()
IFS=';' read -r -a archs <<<"$arch_list"
for a in "${archs[@]}"; do
  a="${a//./}"
  [ -n "$a" ] && gencode+=("-gencode=arch=compute_${a},code=sm_${a}")
done

# The flags torch's BuildExtension would use (no -std: nvcc's default / torch's choice applies).
flags=(-c -O3 -lineinfo --expt-relaxed-constexpr -Xcompiler -fPIC -Xcompiler -Wno-deprecated-declarations
  "-D_GLIBCXX_USE_CXX11_ABI=$abi" -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
  -D__CUDA_NO_HALF2_OPERATORS__ -DHETEROSPEC_WITH_CUDA=1
  -I "$csrc" -I "$stub_inc" -I "$torch_inc" -I "$torch_inc/torch/csrc/api/include" -I "$py_inc"
  "${gencode[@]}")
# shellcheck disable=SC2206
[ -n "${NVCC_EXTRA:-}" ] && flags+=(${NVCC_EXTRA})
[ "${RESOURCES:-0}" = 1 ] && flags+=(-Xptxas -v)

files=()
if [ "$#" -gt 0 ]; then
  for f in "$@"; do files+=("$(readlink -f "$f")"); done  # absolute: diagnostics then name csrc/...
else
  files=("$here"/*.cu "$csrc"/*.cpp "$csrc"/cpu/*.cpp)
fi
if [ ! -e "${files[0]}" ]; then
  echo "compile_check: no .cu files" >&2
  exit 2
fi

elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

compile_one() {  # $1 = source; writes $work/<name>.{log,status}
  local src="$1" name t0 t1 rc
  name="$(basename "$src")"
  t0=$(date +%s.%N)
  if [[ "$src" == *.cpp ]]; then   # C++17 syntax check (what torch < 2.13 compiles extensions as)
    "${CXX:-g++}" -std=c++17 -fsyntax-only -fopenmp -w "-D_GLIBCXX_USE_CXX11_ABI=$abi" -DHETEROSPEC_WITH_CUDA=1 \
      -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -I "$csrc" -I "$torch_inc" \
      -I "$torch_inc/torch/csrc/api/include" -I "$py_inc" "$src" >"$work/$name.log" 2>&1
  else
    "$nvcc" "${flags[@]}" "$src" -o "$work/$name.o" >"$work/$name.log" 2>&1
  fi
  rc=$?
  t1=$(date +%s.%N)
  secs="$(elapsed "$t0" "$t1")"
  echo "$rc" >"$work/$name.status"
  if [ "$rc" -eq 0 ]; then
    printf '  ok    %6ss  %s\n' "$secs" "${src#"$csrc"/}"
    if [ "${RESOURCES:-0}" = 1 ] && [[ "$src" == *.cu ]]; then   # ptxas: registers and spills per kernel
      awk '/Compiling entry function/ { match($0, /\x27[^\x27]+\x27/); fn = substr($0, RSTART + 1, RLENGTH - 2) }
           /bytes spill stores/ { sp = $0 } /Used [0-9]+ registers/ { print fn; print "    " sp; print "   " $0 }' \
        "$work/$name.log" | (command -v c++filt >/dev/null && c++filt || cat) | sed 's/^/        /'
    fi
    # Warnings in our sources only (torch's headers warn under C++17, e.g. AutogradState.h).
    if grep -q "^$csrc/.*warning" "$work/$name.log"; then
      echo "        warnings in heterospec sources:"
      grep -A2 "^$csrc/.*warning" "$work/$name.log" | head -n 30 | sed 's/^/        /'
    fi
  else
    printf '  FAIL  %6ss  %s\n' "$secs" "${src#"$csrc"/}"
  fi
}

echo "compile_check: $("$nvcc" --version | tail -n 2 | head -n 1); archs: $arch_list; jobs: $jobs; torch headers: $torch_inc"
start=$(date +%s.%N)
running=0
for f in "${files[@]}"; do
  compile_one "$f" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n
    running=$((running - 1))
  fi
done
wait

failed=0
for f in "${files[@]}"; do
  name="$(basename "$f")"
  rc=1
  [ -f "$work/$name.status" ] && read -r rc <"$work/$name.status"
  if [ "$rc" -ne 0 ]; then
    failed=$((failed + 1))
    echo "---- $f (exit $rc) ----"
    grep -v '^$' "$work/$name.log" | head -n 60
  fi
done
printf 'compile_check: %d file(s), %d failed, %ss total\n' "${#files[@]}" "$failed" "$(elapsed "$start" "$(date +%s.%N)")"
[ "$failed" -eq 0 ]
