#!/usr/bin/env bash
export PATH=/usr/local/cuda/bin:$PATH
CHECK=bwd MAIN_TIMEOUT=330 SANITIZE_TIMEOUT=120 scripts/sm90_standalone.sh 2>&1 | grep -E "sm90_bwd_hdim|^check|^determ|^\||memcheck|smoke|FAIL|TIMED"
grep -i fail build/sm90_standalone_bwd/cases.txt | head
