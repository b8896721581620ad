#!/usr/bin/env bash
# Attention's backend (docs/long-context.md; [Note: attention's backend]), detached (a device call lays the tree
# anew): pydantic on PYTHONPATH (installed into /tmp/site first, as bench/README.md says for the peers), then
#   COMMIT=$(git rev-parse --short HEAD) bash bench/gpu/attention_job.sh start
# and `bash bench/gpu/attention_job.sh poll SECONDS`; `run` runs them inside another job (lib.sh, zf_job_start).
# ATTN_RUNS picks runs, in this order (default: tests a32k a128k):
#   tests   tests/gpu/test_gpu_attention.py: each kernel trains as flash does; timed times and chooses
#   a32k    the 8B shape in LoRA, one sequence of 32,768 tokens at 24 GiB: torch's own choice (auto), cuDNN's
#           named, timed
#   a128k   the same at 131,072 tokens: auto, timed
set -u
. "$(dirname "$0")/lib.sh"
runs='
    for run in ${ATTN_RUNS:-tests a32k a128k}; do
      case $run in
      tests) python3 -m pytest tests/gpu/test_gpu_attention.py -q -p no:cacheprovider > $o/attn_tests.log 2>&1
        stamp attn_tests $?;;
      a32k) bench a32k --workload L8 --seq 32768 --engines zerofit,zerofit-cudnn,zerofit-timed --steps 3 \
          --cap 24GiB --timeout 300;;
      a128k) bench a128k --workload L8 --seq 131072 --engines zerofit,zerofit-timed --steps 2 --cap 24GiB \
          --timeout 540;;
      esac
    done'
zf_job_main "$runs" "$@"
