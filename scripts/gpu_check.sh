#!/usr/bin/env bash
# jaxattn GPU verification: build, test, sanitize, benchmark, summarize.
#
#   scripts/gpu_check.sh            # full run, ~9 minutes on an H200 (incremental build)
#   QUICK=1 scripts/gpu_check.sh    # ~3 minutes: GPU tests only, --quick benchmark
#
# Runs from anywhere (no network). Steps, each timed and logged to $OUT:
#   a. nvidia-smi                    -> nvidia-smi.txt
#   b. build + install (pip, -v)     -> build.log (ptxas spill warnings go to the summary)
#   c. pytest tests/ (QUICK: -m gpu) -> tests.log, tests.xml (junit)
#   d. compute-sanitizer memcheck and racecheck on tests/gpu_sanitize.py
#                                    -> sanitize_<tool>.log (run alongside c: no timing there)
#   e. benchmarks/attention.py       -> bench.log, attention.json/.png/.md
#   f. summary, printed LAST         -> summary.md
# A failing step does not stop the later ones; the exit status is 1 when any
# step failed, else 0. Everything is also tee'd to $OUT/gpu_check.log.
#
# Environment:
#   OUT=dir                output directory (default: <repo>/results)
#   QUICK=1                the short version
#   PYTHON=python3         the interpreter (pip, pytest and the benchmark run under it)
#   JAXATTN_CUDA_ARCHS     default 90-real (H100/H200); JAXATTN_CUDA default ON (fail without nvcc)
#   BUILD_JOBS=16          CMAKE_BUILD_PARALLEL_LEVEL
#   SKIP_BUILD=1 SKIP_TESTS=1 SKIP_SANITIZE=1 SKIP_BENCH=1
#   PYTEST_ARGS="..."      extra pytest arguments (e.g. "-k forward")
#   SANITIZE_TOOLS="memcheck racecheck"   (also: initcheck synccheck)
#   SANITIZE_KERNEL_FILTER=kns=flash_     compute-sanitizer --kernel-name filter ("" = every kernel)
#   BENCH_ARGS="..."       benchmark flags (default: full grid; QUICK=1: --quick); they come last,
#                          so e.g. BENCH_ARGS="--time-budget 900" overrides the computed budget
#   BENCH_COMPILE_CACHE    JAX compilation cache dir (default <repo>/build/jax_cache; "" = off)
#   TIME_BUDGET            seconds for the whole run (default 540; QUICK 210). Each step's
#                          timeout is cut so the run ends in time; the benchmark gets what is
#                          left and records rows it had no time for as skipped.
#   LIMIT_BUILD LIMIT_TESTS LIMIT_SANITIZE   per-step timeouts (default 240 180 180; QUICK 180 60 60)
#   BENCH_MIN              seconds kept for the benchmark by the earlier steps (default 150; QUICK 70)
#   BENCH_MARGIN           the benchmark starts no row later than this many seconds before its
#                          timeout, so it ends and writes its outputs by itself (default 45; QUICK 25)
#   CLEAN_BUILD=1          delete <repo>/build/cp* first (a full rebuild: every ptxas spill is reported;
#                          an incremental build reports only the files it recompiled)

# shellcheck disable=SC2329  # the step_* functions are called by name (`$SELF __step NAME`)
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SELF="$REPO/scripts/gpu_check.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  sed -n '2,/^$/p' "$SELF" | sed 's/^# \{0,1\}//'; exit 0
fi
PY="${PYTHON:-python3}"
QUICK="${QUICK:-0}"
OUT="${OUT:-$REPO/results}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"

if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
  export CUDACXX="${CUDACXX:-/usr/local/cuda/bin/nvcc}"
fi
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
export JAXATTN_CUDA_ARCHS="${JAXATTN_CUDA_ARCHS:-90-real}"
export JAXATTN_CUDA="${JAXATTN_CUDA:-ON}"
export JAXATTN_SM90="${JAXATTN_SM90:-ON}"
export CMAKE_BUILD_PARALLEL_LEVEL="${BUILD_JOBS:-16}"

if [[ "$QUICK" == 1 ]]; then
  TIME_BUDGET="${TIME_BUDGET:-210}"
  BENCH_ARGS="${BENCH_ARGS---quick}"
  LIMIT_BUILD="${LIMIT_BUILD:-180}" LIMIT_TESTS="${LIMIT_TESTS:-60}"
  LIMIT_SANITIZE="${LIMIT_SANITIZE:-$LIMIT_TESTS}" BENCH_MIN="${BENCH_MIN:-70}" BENCH_MARGIN="${BENCH_MARGIN:-25}"
else
  TIME_BUDGET="${TIME_BUDGET:-540}"
  BENCH_ARGS="${BENCH_ARGS-}"
  LIMIT_BUILD="${LIMIT_BUILD:-240}" LIMIT_TESTS="${LIMIT_TESTS:-180}"
  LIMIT_SANITIZE="${LIMIT_SANITIZE:-$LIMIT_TESTS}" BENCH_MIN="${BENCH_MIN:-150}" BENCH_MARGIN="${BENCH_MARGIN:-45}"
fi
SANITIZE_TOOLS="${SANITIZE_TOOLS:-memcheck racecheck}"
SANITIZE_KERNEL_FILTER="${SANITIZE_KERNEL_FILTER-kns=flash_}"
BENCH_COMPILE_CACHE="${BENCH_COMPILE_CACHE-$REPO/build/jax_cache}"
STEPS="$OUT/steps.tsv"

# A scratch directory to run Python from: the source tree must not shadow the installed package.
RUNDIR="${GPU_CHECK_RUNDIR:-}"

# ------------------------------------------------------------------ steps --
# Each step_* runs in its own process (`$SELF __step NAME`) under `timeout`,
# writes its log, and exits 0 (ok), 1 (failed) or 3 (skipped).

step_smi() {
  if ! command -v nvidia-smi >/dev/null; then
    echo "nvidia-smi not found" | tee "$OUT/nvidia-smi.txt"; return 1
  fi
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu,clocks.sm,clocks.max.sm,power.limit \
    --format=csv,noheader 2>&1 | tee "$OUT/nvidia-smi.txt"
  return "${PIPESTATUS[0]}"
}

step_build() {
  if [[ "${CLEAN_BUILD:-0}" == 1 ]]; then rm -rf "$REPO"/build/cp*; fi
  {
    echo "# preflight"
    "$PY" -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0], "| jax", jax.__version__, "| jaxlib", jaxlib.__version__)'
    "$PY" -c 'import scikit_build_core, nanobind; print("scikit-build-core", scikit_build_core.__version__, "| nanobind", nanobind.__version__)' \
      || echo "MISSING build requirement: --no-build-isolation needs scikit-build-core and nanobind installed"
    (command -v cmake >/dev/null && cmake --version | head -1) || "$PY" -c 'import cmake; print("cmake (python)", cmake.__version__)' || echo "cmake: not found"
    (command -v ninja >/dev/null && echo "ninja $(ninja --version)") || echo "ninja: not on PATH"
    (command -v nvcc >/dev/null && nvcc --version | tail -2 | head -1) || echo "nvcc: not found"
    echo "JAXATTN_CUDA=$JAXATTN_CUDA JAXATTN_CUDA_ARCHS=$JAXATTN_CUDA_ARCHS CMAKE_BUILD_PARALLEL_LEVEL=$CMAKE_BUILD_PARALLEL_LEVEL"
    echo "# pip install"
  } 2>&1 | tee -i "$OUT/build.log"
  (cd "$REPO" && "$PY" -m pip install --no-build-isolation --no-deps -v .) 2>&1 \
    | tee -i -a "$OUT/build.log" \
    | grep --line-buffered -E '^\s*\[[0-9]+/[0-9]+\]|ptxas|error|Error|jaxattn:|Successfully|Building wheel|WARNING' \
    | grep --line-buffered -v -E 'Werror|error_code|errors\.h|-Wno-error'
  local rc=${PIPESTATUS[0]}
  if [[ $rc != 0 ]]; then
    echo "pip install failed (rc $rc); last lines of build.log:"; tail -n 40 "$OUT/build.log"; return 1
  fi
  # What got installed, imported from outside the source tree.
  (cd "$RUNDIR" && "$PY" -c '
import jaxattn, sys
print("installed:", jaxattn.__file__, "| built_with_cuda:", jaxattn.built_with_cuda())
sys.exit(0 if jaxattn.built_with_cuda() else 4)') 2>&1 | tee -i -a "$OUT/build.log"
  rc=${PIPESTATUS[0]}
  if [[ $rc == 4 ]]; then echo "the installed jaxattn has no CUDA kernels"; return 1; fi
  return "$rc"
}

step_tests() {
  local marks=() extra=()
  [[ "$QUICK" == 1 ]] && marks=(-m gpu)
  eval "extra=(${PYTEST_ARGS:-})"  # shell words: PYTEST_ARGS='-k "forward and not slow"'
  cd "$RUNDIR" || return 1
  "$PY" -c 'import jaxattn; print("tests import jaxattn from", jaxattn.__file__)' 2>&1 | tee -i "$OUT/tests.log"
  # How many tests will run, as "collected M items" in tests.log: pytest-xdist under -q
  # prints no count, and the summary compares it with the junit XML to find tests a
  # timeout never started. (Collected without xdist: its -n / --dist words dropped.)
  local collect=() skip=0 w n
  for w in ${extra[@]+"${extra[@]}"}; do
    if [[ $skip == 1 ]]; then skip=0; continue; fi
    case "$w" in
      -n|--numprocesses|--dist|--maxprocesses) skip=1 ;;
      -n*|--numprocesses=*|--dist=*|--maxprocesses=*) ;;
      *) collect+=("$w") ;;
    esac
  done
  n=$("$PY" -m pytest "$REPO/tests" --collect-only -q -p no:cacheprovider -p no:xdist --rootdir "$REPO" \
      ${marks[@]+"${marks[@]}"} ${collect[@]+"${collect[@]}"} 2>/dev/null | grep -oE '^[0-9]+(/[0-9]+)? tests? collected' | grep -oE '^[0-9]+')
  [[ -n "$n" ]] && echo "collected $n items" | tee -i -a "$OUT/tests.log"
  # (several pytest workers share the GPU: none may preallocate 75% of it; session 6
  # lost two runs to that)
  XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false} \
  "$PY" -m pytest "$REPO/tests" -q -rs -p no:cacheprovider --rootdir "$REPO" \
    --junitxml "$OUT/tests.xml" ${marks[@]+"${marks[@]}"} ${extra[@]+"${extra[@]}"} 2>&1 \
    | tee -i -a "$OUT/tests.log"
  local rc=${PIPESTATUS[0]}
  [[ $rc == 5 ]] && { echo "pytest collected no tests"; return 1; }
  [[ $rc == 0 ]] || return 1
}

sanitizer_bin() {
  command -v compute-sanitizer 2>/dev/null && return 0
  local c
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [[ -x "$c" ]] && { echo "$c"; return 0; }
  done
  return 1
}

step_sanitize() {  # $1: tool
  local tool=$1 log="$OUT/sanitize_$1.log" cs
  if ! cs=$(sanitizer_bin); then echo "compute-sanitizer not found: skipped" | tee "$log"; return 3; fi
  local help opts=(--tool "$tool" --error-exitcode 99 --print-limit 20)
  help=$("$cs" --help 2>&1)
  grep -q -- '--report-api-errors' <<<"$help" && opts+=(--report-api-errors no)  # XLA's benign API errors
  if [[ -n "$SANITIZE_KERNEL_FILTER" ]] && grep -q -- '--kernel-name' <<<"$help"; then
    opts+=(--kernel-name "$SANITIZE_KERNEL_FILTER")
  fi
  cd "$RUNDIR" || return 1
  echo "$cs ${opts[*]} $PY tests/gpu_sanitize.py" > "$log"
  XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "$cs" "${opts[@]}" "$PY" "$REPO/tests/gpu_sanitize.py" >>"$log" 2>&1
  local rc=$?
  tail -n 3 "$log"
  case $rc in
    0) return 0 ;;
    2) echo "gpu_sanitize could not run the CUDA kernels"; return 1 ;;
    *) return 1 ;;
  esac
}

step_bench() {  # $1: time budget for the benchmark's rows
  cd "$RUNDIR" || return 1
  local extra=(--out "$OUT" --time-budget "$1") user=()
  [[ -n "$BENCH_COMPILE_CACHE" ]] && extra+=(--compile-cache "$BENCH_COMPILE_CACHE")
  eval "user=($BENCH_ARGS)"
  "$PY" "$REPO/benchmarks/attention.py" "${extra[@]}" ${user[@]+"${user[@]}"} 2>&1 | tee -i "$OUT/bench.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || return 1
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

main() {
  : >"$STEPS"
  # Outputs of an earlier run must not be read as this run's.
  rm -f "$OUT"/{nvidia-smi.txt,build.log,tests.log,tests.xml,bench.log,summary.md,.summary_problems} \
        "$OUT"/attention.{json,png,md} "$OUT"/sanitize_*.log
  RUNDIR=$(mktemp -d "${TMPDIR:-/tmp}/jaxattn_gpu_check.XXXXXX")
  export GPU_CHECK_RUNDIR="$RUNDIR"
  echo "jaxattn gpu_check: repo $REPO, out $OUT, QUICK=$QUICK, TIME_BUDGET=${TIME_BUDGET}s, python $(command -v "$PY")"

  run_step smi 30 0

  if [[ "${SKIP_BUILD:-0}" == 1 ]]; then record build "skipped (SKIP_BUILD)" 0 -
  else run_step build "$LIMIT_BUILD" "$((LIMIT_TESTS / 2 + BENCH_MIN))"; fi

  # The sanitizers run alongside the tests (neither is timed); the benchmark then has the GPU alone.
  local pids=() tool
  if [[ "${SKIP_SANITIZE:-0}" != 1 ]]; then
    for tool in $SANITIZE_TOOLS; do
      STEP_SIGNAL=TERM STEP_FN=sanitize run_step "sanitize_$tool" "$LIMIT_SANITIZE" "$BENCH_MIN" "$tool" \
        >"$OUT/sanitize_$tool.step.log" 2>&1 &
      pids+=($!)
    done
  else
    for tool in $SANITIZE_TOOLS; do record "sanitize_$tool" "skipped (SKIP_SANITIZE)" 0 -; done
  fi
  if [[ "${SKIP_TESTS:-0}" == 1 ]]; then record tests "skipped (SKIP_TESTS)" 0 -
  else run_step tests "$LIMIT_TESTS" "$BENCH_MIN"; fi
  if ((${#pids[@]})); then
    echo "=== waiting for the sanitizers"
    wait "${pids[@]}"
    for tool in $SANITIZE_TOOLS; do cat "$OUT/sanitize_$tool.step.log" 2>/dev/null; done
  fi

  if [[ "${SKIP_BENCH:-0}" == 1 ]]; then record bench "skipped (SKIP_BENCH)" 0 -
  else
    # Rows stop starting BENCH_MARGIN s before the step's timeout (jax start-up ~10-15 s, a
    # big fwd+bwd row up to ~20 s), so the benchmark normally ends and writes its outputs itself.
    local left=$((DEADLINE - SECONDS - 10))
    run_step bench "$left" 10 "$((left - BENCH_MARGIN > 20 ? left - BENCH_MARGIN : 20))"
  fi

  summarize
  local status=0
  awk -F'\t' '$2 == "FAIL" || $2 == "TIMEOUT" { bad = 1 } END { exit !bad }' "$STEPS" && status=1
  [[ -s "$OUT/.summary_problems" ]] && status=1
  rm -rf "$RUNDIR"
  echo "gpu_check: exit $status (total $((SECONDS - START))s; outputs in $OUT)"
  return $status
}

summarize() {
  OUT="$OUT" QUICK="$QUICK" TIME_BUDGET="$TIME_BUDGET" "$PY" - <<'PYEOF' | tee -i "$OUT/summary.md"
import collections, json, os, re, xml.etree.ElementTree as ET

out = os.environ["OUT"]
def read(name):
    try:
        with open(os.path.join(out, name), errors="replace") as f:
            return f.read()
    except OSError:
        return None

steps = [l.split("\t") for l in (read("steps.tsv") or "").splitlines() if l.strip()]
status = {s[0]: s[1] for s in steps}
problems = []
lines = [f"## jaxattn gpu_check summary (QUICK={os.environ['QUICK']}, budget {os.environ['TIME_BUDGET']} s)", ""]
smi = (read("nvidia-smi.txt") or "").strip().splitlines()
lines.append("GPU: " + (smi[0] if smi else "?"))
lines.append("")
lines.append("| step | status | seconds |")
lines.append("|---|---|---|")
for s in steps:
    lines.append(f"| {s[0]} | {s[1]} | {s[2]} |")
lines.append("")

# build
build = read("build.log")
if build is not None and "build" in status and not status["build"].startswith("skipped"):
    m = re.findall(r"installed: (\S+) \| built_with_cuda: (\w+)", build)
    lines.append(f"build: {status['build']}" + (f"; built_with_cuda={m[-1][1]}" if m else "; jaxattn did not import"))
    spills = sorted({re.sub(r"\s+", " ", l.strip()) for l in build.splitlines()
                     if "ptxas" in l and "spill" in l.lower()
                     and not re.search(r"\b0 bytes spill stores, 0 bytes spill loads", l)})
    nvcc_ran = bool(re.search(r"Building CUDA object", build))
    if spills:
        try:  # demangle the kernel names
            import subprocess
            res = subprocess.run(["c++filt"], input="\n".join(spills), capture_output=True, text=True, timeout=10)
            if res.returncode == 0 and res.stdout.strip():
                spills = res.stdout.strip().splitlines()
        except Exception:
            pass
        spills = [re.sub(r"^ptxas warning : Registers are spilled to local memory in function ", "", l)
                  .replace("jaxattn::cuda::sm80::", "") for l in spills]
        lines.append(f"ptxas spills: {len(spills)} kernel(s) spill registers to local memory")
        for l in spills[:12]:
            lines.append("  " + (l if len(l) < 240 else l[:237] + "..."))
    else:
        lines.append("ptxas spills: none" + ("" if nvcc_ran else " reported (no CUDA file was recompiled)"))
    lines.append("")

# tests
xml = os.path.join(out, "tests.xml")
if os.path.exists(xml) and not status.get("tests", "").startswith("skipped"):
    try:
        root = ET.parse(xml).getroot()
        cases = list(root.iter("testcase"))
        counts = collections.Counter()
        gpu_counts = collections.Counter()
        failed, skip_reasons = [], collections.Counter()
        gpu_skipped = 0
        def skip_msg(c):
            return " ".join((x.get("message") or "") for x in c if x.tag == "skipped")
        for c in cases:
            kind = "passed"
            for child in c:
                if child.tag in ("failure", "error"):
                    kind = "failed" if child.tag == "failure" else "errors"
                    failed.append(f"{c.get('classname', '')}::{c.get('name')}: {(child.get('message') or '').splitlines()[0][:160] if child.get('message') else ''}")
                elif child.tag == "skipped":
                    kind = "skipped"
                    skip_reasons[(child.get("message") or "").strip()[:120]] += 1
            counts[kind] += 1
            if "cuda" in c.get("name", "") or "test_gpu" in c.get("classname", ""):
                gpu_counts[kind] += 1
            if kind == "skipped" and re.search(r"GPU|CUDA", skip_msg(c)):
                gpu_skipped += 1
        lines.append(f"tests: {status.get('tests')}: {counts['passed']} passed, {counts['failed']} failed, "
                     f"{counts['errors']} errors, {counts['skipped']} skipped (of {len(cases)})")
        # Tests collected but never started (a timeout stops pytest where it is; the
        # junit XML lists only what ran): pytest-xdist prints "N workers [M items]",
        # plain pytest "collected M items".
        m = re.search(r"workers \[(\d+) items?\]|collected (\d+) items?", read("tests.log") or "")
        collected = int(m.group(1) or m.group(2)) if m else None
        if collected and collected > len(cases):
            lines.append(f"  NOT STARTED: {collected - len(cases)} of the {collected} collected tests (the step's time "
                         "ran out: give it more, e.g. TIME_BUDGET=480 when the build is in the same call)")
            problems.append(f"{collected - len(cases)} tests never started")
        lines.append(f"  of which test_gpu.py or named *cuda*: {gpu_counts['passed']} passed, "
                     f"{gpu_counts['failed'] + gpu_counts['errors']} failed, {gpu_counts['skipped']} skipped")
        if gpu_skipped and smi and "," in smi[0]:
            lines.append(f"  FAIL: {gpu_skipped} test(s) skipped for want of a GPU/CUDA on a GPU machine")
            problems.append("GPU tests skipped on a GPU machine")
        for f in failed[:15]:
            lines.append("  FAILED " + f)
        if len(failed) > 15:
            lines.append(f"  ... {len(failed) - 15} more in tests.log")
        for why, n in skip_reasons.most_common(5):
            lines.append(f"  skipped x{n}: {why}")
    except ET.ParseError as e:
        lines.append(f"tests: {status.get('tests')}: tests.xml unreadable ({e})")
    lines.append("")
elif "tests" in status:
    lines.append(f"tests: {status['tests']}" + ("" if status["tests"].startswith("skipped") else " (no junit xml: see tests.log)"))
    lines.append("")

# sanitizers
for s in steps:
    if not s[0].startswith("sanitize_"):
        continue
    tool = s[0][len("sanitize_"):]
    log = read(f"sanitize_{tool}.log") or ""
    verdict = s[1]
    m = re.findall(r"ERROR SUMMARY: (\d+) error", log)
    r = re.findall(r"RACECHECK SUMMARY: (\d+) hazard", log)
    app = re.findall(r"gpu_sanitize: (OK|MISMATCH)[^\n]*", log)
    detail = []
    if m: detail.append(f"{m[-1]} errors")
    if r: detail.append(f"{r[-1]} hazards")
    if app: detail.append(f"check {app[-1]}")
    if "timeout" in verdict.lower(): detail.append("the sanitized run did not finish in time")
    first = re.search(r"=========\s+(Invalid|Race|Error|Uninitialized|Barrier)[^\n]*", log)
    if first and verdict != "ok": detail.append("first: " + first.group(0).strip("= ")[:160])
    lines.append(f"sanitizer {tool}: {verdict}" + (f" ({'; '.join(detail)})" if detail else ""))
lines.append("")

# benchmark
md = read("attention.md")
if md and not status.get("bench", "").startswith("skipped"):
    lines.append(f"benchmark: {status.get('bench')}")
    try:
        doc = json.loads(read("attention.json"))
        env = doc.get("environment", {})
        if env.get("backend") == "gpu" and doc.get("config", {}).get("jaxattn_implementation") is None:
            ref_rows = [r for r in doc["rows"] if r.get("kernel") and not str(r["kernel"]).startswith("cuda:")]
            if ref_rows:
                lines.append(f"  FAIL: {len(ref_rows)} row(s) ran jaxattn kernel {ref_rows[0]['kernel']!r}, not a CUDA kernel")
                problems.append("benchmark did not run the CUDA kernels")
        skipped = sum(1 for r in doc["rows"] if any("time budget" in (v or {}).get("skipped", "") for v in r["results"].values()))
        if skipped:
            lines.append(f"  INCOMPLETE: {skipped} row(s) skipped for time; for the whole grid run "
                         "SKIP_BUILD=1 SKIP_TESTS=1 SKIP_SANITIZE=1 (or BENCH_ARGS with fewer rows)")
    except Exception:
        pass
    lines.append("")
    lines.append(md.strip())
elif "bench" in status:
    lines.append(f"benchmark: {status['bench']}" + ("" if status["bench"].startswith("skipped") else " (no table: see bench.log)"))
if problems:
    lines.append("")
    lines.append("problems: " + "; ".join(problems))
    with open(os.path.join(out, ".summary_problems"), "w") as f:
        f.write("\n".join(problems) + "\n")
print("\n".join(lines))
PYEOF
}

main 2>&1 | tee -i "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
