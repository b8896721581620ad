# The fast kernels' GPU runs (docs/kernels.md), detached (a device call lays the tree anew):
# `COMMIT=$(git rev-parse --short HEAD) OLD_TGZ=.snap_old.tgz OLD_COMMIT=f4f9195 bash bench/gpu/kernels_job.sh start`
# copies the tree to /tmp/run and starts them under setsid, writing /tmp/run_out; `bash bench/gpu/kernels_job.sh
# poll SECONDS` waits up to SECONDS for them, then packs what is there into $OUT/all.tgz. Carry .gpu_site
# (bitsandbytes, pydantic, liger_kernel: pip install --target) and OLD_TGZ (a `git archive` of the older commit).
# First the convergence suite (six processes on the GPU) beside tests/gpu/test_gpu_kernels.py, then the kernels
# suite's benchmarks (bench/gpu/suite.sh kernels, KERNEL_RUNS) one engine at a time; CONVERGENCE_LAST=1: the
# benchmarks first, then the convergence suite (no tests).
set -u
case "$1" in
start)
  rm -rf /tmp/run /tmp/run_out /tmp/old && cp -r . /tmp/run && mkdir -p /tmp/run_out
  if [ -n "${OLD_TGZ:-}" ]; then mkdir -p /tmp/old && tar xzf "$OLD_TGZ" -C /tmp/old; fi
  cd /tmp/run
  export COMMIT=${COMMIT:-unknown} OLD_COMMIT=${OLD_COMMIT:-old}
  setsid bash -c "
    export PYTHONPATH=/tmp/run/.gpu_site:/tmp/run/src PYTHONUNBUFFERED=1 ZF_SETUP=0
    o=/tmp/run_out
    if [ \"\${CONVERGENCE_LAST:-0}\" = 0 ]; then
      OUT=\$o/c bash bench/gpu/suite.sh convergence > \$o/convergence.log 2>&1 &
      python3 -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_gpu_kernels.py > \$o/kernel_tests.log 2>&1
      echo \"kernel_tests rc=\$? \$(date -u +%H:%M:%S)\" >> \$o/done
      wait
      echo \"convergence \$(date -u +%H:%M:%S)\" >> \$o/done
    fi
    ZF_REPO=\$( [ -d /tmp/old/src ] && echo /tmp/old ) KERNEL_TESTS=0 OUT=\$o/k bash bench/gpu/suite.sh kernels > \$o/kernels.log 2>&1
    echo \"kernels \$(date -u +%H:%M:%S)\" >> \$o/done
    if [ \"\${CONVERGENCE_LAST:-0}\" = 1 ]; then
      OUT=\$o/c bash bench/gpu/suite.sh convergence > \$o/convergence.log 2>&1
    fi
    echo \"all \$(date -u +%H:%M:%S)\" >> \$o/done
  " > /dev/null 2>&1 < /dev/null &
  echo started;;
poll)
  . "$(dirname "$0")/lib.sh" && zf_job_poll "${2:-500}";;
esac
