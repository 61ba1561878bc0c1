# Shared by scripts/gpu_check.sh and scripts/multi_gpu_check.sh (sourced): timed steps.
#
# The sourcing script defines SELF (itself; `$SELF __step NAME ARGS` must run
# its function step_NAME), STEPS (the tab-separated step log) and DEADLINE
# (the $SECONDS by which everything must end).

record() {  # name status seconds rc
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$STEPS"
}

# run_step NAME WANT_LIMIT RESERVE ARGS...: runs step NAME under a timeout of
# min(WANT_LIMIT, time left - RESERVE) and records its status. The timeout
# sends SIGINT (pytest still writes its junit XML, the benchmark its JSON);
# STEP_SIGNAL=TERM for background steps, which ignore SIGINT. STEP_FN: the
# step_* function when it differs from NAME.
run_step() {
  local name=$1 want=$2 reserve=$3 sig=${STEP_SIGNAL:-INT} fn=${STEP_FN:-$1}; shift 3
  local left=$((DEADLINE - SECONDS - reserve)) limit=$want t0=$SECONDS rc status
  ((left < limit)) && limit=$left
  if ((limit < 10)); then
    echo "=== [$name] skipped: no time left in TIME_BUDGET=$TIME_BUDGET"
    record "$name" "skipped (no time)" 0 -; return 0
  fi
  echo "=== [$name] $(date -u +%H:%M:%S) limit ${limit}s"
  timeout -s "$sig" -k 20 "$limit" bash "$SELF" __step "$fn" "$@"
  rc=$?
  case $rc in
    0) status=ok ;;
    3) status=skipped ;;
    124|137) status=TIMEOUT; [[ $name == sanitize_* ]] && status="INCONCLUSIVE (timeout)" ;;
    *) status=FAIL ;;
  esac
  echo "=== [$name] $status in $((SECONDS - t0))s (rc $rc)"
  record "$name" "$status" "$((SECONDS - t0))" "$rc"
}
