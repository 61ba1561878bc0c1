#!/usr/bin/env bash
# device call helper (untracked): H=256 backward timing experiments
export PATH=/usr/local/cuda/bin:$PATH
for exp in base NO_DQ_REDUCE Q_ONCE BOTH; do
  case $exp in base) F="";; NO_DQ_REDUCE) F="-DJAXATTN_EXP_NO_DQ_REDUCE";; Q_ONCE) F="-DJAXATTN_EXP_Q_ONCE";; BOTH) F="-DJAXATTN_EXP_NO_DQ_REDUCE -DJAXATTN_EXP_Q_ONCE";; esac
  (CHECK=bwd BUILD=build/exp_$exp EXTRA_FLAGS="$F" RUN=0 scripts/sm90_standalone.sh >build_$exp.log 2>&1) &
done
wait
for exp in base NO_DQ_REDUCE Q_ONCE BOTH; do
  echo "=== $exp"; timeout 120 build/exp_$exp/sm90_bwd_check --no-check | grep -E "^\| (128|256)" 
done
