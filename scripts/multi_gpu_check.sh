#!/usr/bin/env bash
# jaxattn multi-GPU check (issue 7): one call on a machine with 2+ GPUs, < 8 minutes with the build.
#
#   scripts/multi_gpu_check.sh                 # build, tests, train steps, ring benchmark, summary
#   SKIP_BUILD=1 scripts/multi_gpu_check.sh    # jaxattn already installed
#
# Steps, each in its own process under a timeout (a failing or timed-out step
# does not stop the others; the exit status is 1 when any failed):
#   a. nvidia-smi                       (gpu_check.sh's step)  -> nvidia-smi.txt
#   b. build + install                  (gpu_check.sh's step)  -> build.log
#   c. benchmarks/ring.py, the GPUs alone: ring attention at T=65536 on P GPUs
#      vs flash_attention at T/P on one (causal zig-zag and not, bf16, N=16, H=128,
#      fwd and fwd+bwd), the ring without overlap, flash_attention under jit
#      (auto ring) and the transfers alone
#   d. train steps of examples/train_lm.py's model on data, tensor and sequence
#      parallel meshes over the GPUs vs one GPU (tests/parallel_train_worker.py),
#      alongside e (both are small)
#   e. tests on the real GPUs: pytest -m gpu of tests/test_ring.py and
#      tests/test_sharding.py (ring attention with the CUDA kernels; batch,
#      heads and sequence-sharded flash_attention under jit, both partitioners)
#                                                              -> tests.xml
#   f. summary, printed LAST: steps, tests, train losses, the benchmark table
#                                                              -> summary.md, summary.json (all numbers)
# Everything printed is also in $OUT/multi_gpu_check.log. $OUT gets 7 files
# (nvidia-smi.txt, build.log, steps.tsv, tests.xml, summary.md, summary.json,
# multi_gpu_check.log): the device tool brings back at most 8.
#
# Environment:
#   OUT=dir (default <repo>/results)   PYTHON=python3   BUILD_JOBS=32
#   TIME_BUDGET=450      seconds for the whole run; each step's limit is cut to fit
#   LIMIT_BUILD=240 LIMIT_TESTS=150 LIMIT_TRAIN=150 LIMIT_BENCH=150
#   BENCH_MIN=110        seconds the build leaves for the benchmark
#   BENCH_ARGS="..."     extra benchmarks/ring.py flags (e.g. "--seqlen 131072")
#   SKIP_BUILD=1 SKIP_TESTS=1 SKIP_TRAIN=1 SKIP_BENCH=1
# flax and optax (for d) may be carried as wheels in <repo>/.whl: they are
# installed to a scratch --target and put on PYTHONPATH.

# shellcheck disable=SC2329  # the step_* functions are called by name (`$SELF __step NAME`)
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SELF="$REPO/scripts/multi_gpu_check.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  sed -n '2,/^$/p' "$SELF" | sed 's/^# \{0,1\}//'; exit 0
fi
export PYTHON="${PYTHON:-python3}"
PY="$PYTHON"
OUT="${OUT:-$REPO/results}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
export OUT
export BUILD_JOBS="${BUILD_JOBS:-32}" PYTHONUNBUFFERED=1 PIP_NO_INDEX=1
# NVLink multicast stays off on shared hosts (KINDS.md); harmless elsewhere.
export NCCL_NVLS_ENABLE=0
# Several processes may share the GPUs (c and d); each takes memory as it needs it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
TIME_BUDGET="${TIME_BUDGET:-450}"
LIMIT_BUILD="${LIMIT_BUILD:-240}" LIMIT_TESTS="${LIMIT_TESTS:-150}"
LIMIT_TRAIN="${LIMIT_TRAIN:-150}" LIMIT_BENCH="${LIMIT_BENCH:-150}" BENCH_MIN="${BENCH_MIN:-110}"
STEPS="$OUT/steps.tsv"
RUNDIR="${GPU_CHECK_RUNDIR:-}"
# Step outputs that the summary gathers (everything they print is in the log too).
PARTS="$RUNDIR/parts"

# ------------------------------------------------------------------ steps --

step_smi() { bash "$REPO/scripts/gpu_check.sh" __step smi; }
step_build() { bash "$REPO/scripts/gpu_check.sh" __step build; }

step_tests() {
  cd "$RUNDIR" || return 1
  "$PY" -m pytest "$REPO/tests/test_ring.py" "$REPO/tests/test_sharding.py" -m gpu -q -rs \
    -p no:cacheprovider --rootdir "$REPO" --junitxml "$OUT/tests.xml" 2>&1 | tee -i "$PARTS/tests.log"
  local rc=${PIPESTATUS[0]}
  [[ $rc == 5 ]] && { echo "pytest collected no tests"; return 1; }
  [[ $rc == 0 ]]
}

step_train() {
  cd "$RUNDIR" || return 1
  "$PY" "$REPO/tests/parallel_train_worker.py" "$PARTS/train.json" --gpu --steps 5 2>&1 | tee -i "$PARTS/train.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || return 1
  "$PY" -c 'import json, sys; r = json.load(open(sys.argv[1])); sys.exit(0 if r and all(v["ok"] for v in r.values()) else 1)' \
    "$PARTS/train.json"
}

step_bench() {  # $1: the benchmark's own time budget (rows that would start later are skipped)
  cd "$RUNDIR" || return 1
  local user=()
  eval "user=(${BENCH_ARGS:-})"
  "$PY" "$REPO/benchmarks/ring.py" --seqlen 65536 --heads 16 --head-dim 128 --dtype bfloat16 \
    --warmup 2 --reps 5 --time-budget "$1" --json "$PARTS/ring.json" \
    ${user[@]+"${user[@]}"} 2>&1
  [[ ${PIPESTATUS[0]} == 0 ]]
}

if [[ "${1:-}" == __step ]]; then
  shift
  name=$1; shift
  "step_$name" "$@"
  exit $?
fi

# ------------------------------------------------------------------- driver --

START=$SECONDS
DEADLINE=$((START + TIME_BUDGET))
# shellcheck source=scripts/steps.sh
source "$REPO/scripts/steps.sh"  # record, run_step

carried_wheels() {  # flax/optax etc. from <repo>/.whl, when the machine lacks them
  if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/jaxattn_site "$REPO"/.whl/*.whl && export PYTHONPATH="/tmp/jaxattn_site${PYTHONPATH:+:$PYTHONPATH}"
  fi
}

main() {
  : >"$STEPS"
  rm -f "$OUT"/{nvidia-smi.txt,build.log,tests.xml,summary.md,summary.json}
  RUNDIR=$(mktemp -d "${TMPDIR:-/tmp}/jaxattn_multi_gpu.XXXXXX")
  PARTS="$RUNDIR/parts"
  mkdir -p "$PARTS"
  export GPU_CHECK_RUNDIR="$RUNDIR" PARTS
  echo "jaxattn multi_gpu_check: repo $REPO, out $OUT, TIME_BUDGET=${TIME_BUDGET}s, python $(command -v "$PY")"
  carried_wheels

  run_step smi 30 0
  # The build leaves BENCH_MIN s for the benchmark and 60 s for the tests/train steps.
  if [[ "${SKIP_BUILD:-0}" == 1 ]]; then record build "skipped (SKIP_BUILD)" 0 -
  else run_step build "$LIMIT_BUILD" "$((BENCH_MIN + 60))"; fi

  # The benchmark first, with the GPUs alone; rows stop starting 30 s before its
  # timeout, so it writes its outputs itself.
  if [[ "${SKIP_BENCH:-0}" == 1 ]]; then record bench "skipped (SKIP_BENCH)" 0 -
  else
    local limit=$((DEADLINE - SECONDS - 60))
    ((limit > LIMIT_BENCH)) && limit=$LIMIT_BENCH
    run_step bench "$limit" 0 "$((limit - 30 > 20 ? limit - 30 : 20))"
  fi

  # Then the train steps and the tests side by side (both small).
  local pid=""
  if [[ "${SKIP_TRAIN:-0}" == 1 ]]; then record train "skipped (SKIP_TRAIN)" 0 -
  else
    STEP_SIGNAL=TERM run_step train "$LIMIT_TRAIN" 5 >"$PARTS/train.step.log" 2>&1 &
    pid=$!
  fi
  if [[ "${SKIP_TESTS:-0}" == 1 ]]; then record tests "skipped (SKIP_TESTS)" 0 -
  else run_step tests "$LIMIT_TESTS" 5; fi
  if [[ -n "$pid" ]]; then wait "$pid"; cat "$PARTS/train.step.log"; fi

  summarize
  local status=0
  awk -F'\t' '$2 == "FAIL" || $2 == "TIMEOUT" { bad = 1 } END { exit !bad }' "$STEPS" && status=1
  rm -rf "$RUNDIR"
  echo "multi_gpu_check: exit $status (total $((SECONDS - START))s; outputs in $OUT)"
  return $status
}

summarize() {
  "$PY" - <<'PYEOF' | tee -i "$OUT/summary.md"
import json, os, re, xml.etree.ElementTree as ET

out, parts = os.environ["OUT"], os.environ["PARTS"]
def read(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        path = os.path.join(parts, name)
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None

steps = [l.split("\t") for l in (read("steps.tsv") or "").splitlines() if l.strip()]
summary = {"steps": {s[0]: {"status": s[1], "seconds": s[2]} for s in steps}}
lines = ["## jaxattn multi_gpu_check summary", ""]
smi = [l for l in (read("nvidia-smi.txt") or "").strip().splitlines() if "," in l]
lines += [f"GPUs: {len(smi)} x " + (smi[0].split(",")[1].strip() if smi else "?"), "",
          "| step | status | seconds |", "|---|---|---|"]
lines += [f"| {s[0]} | {s[1]} | {s[2]} |" for s in steps]
lines.append("")

if os.path.exists(os.path.join(out, "tests.xml")):
    try:
        cases = list(ET.parse(os.path.join(out, "tests.xml")).getroot().iter("testcase"))
        res = {}
        for c in cases:
            kind = next((x.tag for x in c if x.tag in ("failure", "error", "skipped")), "passed")
            res[f"{c.get('classname', '').split('.')[-1]}::{c.get('name')}"] = kind
        summary["tests"] = res
        lines.append("tests (real GPUs): " + ", ".join(f"{k} {v}" for k, v in res.items()))
        if smi and "skipped" in res.values():
            lines.append("  FAIL: GPU tests skipped on a GPU machine (see tests.log)")
    except ET.ParseError as e:
        lines.append(f"tests: tests.xml unreadable ({e})")
    lines.append("")

train = read("train.json")
if not train and "train" in summary["steps"] and not summary["steps"]["train"]["status"].startswith("skipped"):
    lines += ["train steps: no train.json; the end of train.log:", "```",
              *(read("train.log") or "").strip().splitlines()[-15:], "```", ""]
if train:
    t = json.loads(train)
    summary["train"] = t
    single = t.get("single", {}).get("losses", [])
    lines += ["train steps (examples/train_lm.py's model), loss per step vs one GPU:", "",
              "| mesh | ok | losses | max rel. diff | s/step | collectives |", "|---|---|---|---|---|---|"]
    for name, r in t.items():
        losses = " ".join(f"{x:.4f}" for x in r.get("losses", []))
        rel = f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else "-"
        sec = f"{r['seconds_per_step']:.3f}" if "seconds_per_step" in r else "-"
        lines.append(f"| {name} | {r['ok']} | {losses} | {rel} | {sec} | {', '.join(r.get('collectives', []))} |")
        if not r["ok"] and name != "single":
            lines.append(f"|   | detail: {r['detail'][:300]!r} | | | | |")
    lines.append("")

ring = read("ring.json")
if ring:
    r = json.loads(ring)
    summary["ring_benchmark"] = r
    ratios = [row[k] for row in r["rows"] for k in ("ring_ratio", "auto_ratio") if k in row]
    if ratios:
        lines.append(f"ring / single-GPU per-device throughput: min {min(ratios):.2f}, max {max(ratios):.2f} "
                     f"(bar >= 0.8: {'met' if min(ratios) >= 0.8 else 'NOT met'})")
        lines.append("")
    lines.append(r["table"])
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print("\n".join(lines))
PYEOF
}

main 2>&1 | tee -i "$OUT/multi_gpu_check.log"
exit "${PIPESTATUS[0]}"
