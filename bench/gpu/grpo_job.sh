#!/usr/bin/env bash
# GRPO on one GPU (docs/rl.md; bench/grpo_bench.py), detached (a device call lays the tree anew). TRL and what it
# needs beyond the GPU machine's image (trl, datasets and its needs: pip download --no-deps, as bench/README.md says
# for the peers) installed first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site WHEELS/*.whl
#   COMMIT=$(git rev-parse --short HEAD) bash bench/gpu/grpo_job.sh start
# then `bash bench/gpu/grpo_job.sh poll SECONDS` (packs /tmp/run_out into $OUT/all.tgz). GRPO_RUNS picks runs, in this
# order (default: zf trl long):
#   zf     the 8B shape (L8), LoRA r 16, 8 completions of 1,024 tokens from a 256-token prompt: zerofit at 24 GiB
#   trl    the same, TRL + PEFT in the GPU with no cap
#   long   zerofit at 24 GiB with completions of GRPO_LONG tokens each (default 2048 4096 8192), up to the first
#          that fails
# `bash bench/gpu/grpo_job.sh run` runs them inside a job that zf_job_start (lib.sh) started, to chain them with
# another script's runs. Each run stops after GRPO_TIMEOUT seconds (default 900).
set -u
. "$(dirname "$0")/lib.sh"
runs='
    one() { local name=$1; shift; timeout ${GRPO_TIMEOUT:-900} python3 bench/grpo_bench.py --workload L8 --result $o/$name.json "$@" \
      > $o/$name.log 2>&1; local rc=$?; stamp $name $rc; return $rc; }
    for run in ${GRPO_RUNS:-zf trl long}; do
      case $run in
      zf) one zf --engine zerofit --cap 24GiB --steps ${GRPO_STEPS:-3};;
      trl) one trl --engine trl --cap none --steps ${GRPO_STEPS:-3};;
      long) for n in ${GRPO_LONG:-2048 4096 8192}; do
          one long_$n --engine zerofit --cap 24GiB --steps 2 --completion-len $n || break
        done;;
      esac
    done'
zf_job_main "$runs" "$@"
