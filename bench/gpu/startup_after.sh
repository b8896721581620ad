# Start-up after the page-locking change ([Note: page-locking fresh memory]), detached as w6c_job.sh (`start`,
# then `poll SECONDS`): the page-locking probe and the GPU test of it, W1 against plain to the first step, and W6c from
# its 4-bit folder read past the page cache, 2 steps (the folder written first by another process).
set -u
case "$1" in
start)
  rm -rf /tmp/run /tmp/run_out && cp -r . /tmp/run && mkdir -p /tmp/run_out
  cd /tmp/run
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  setsid bash -c "
    export PYTHONPATH=/tmp/run/.gpu_site:/tmp/run/src PYTHONUNBUFFERED=1
    o=/tmp/run_out
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k fresh_pinned > \$o/gpu_test.log 2>&1; echo gpu_test rc=\$? >> \$o/done
    python3 bench/startup.py --workload W6c --layers 0 --source folder4 --dir /tmp/st --write-only > \$o/write4.log 2>&1
    echo write4 rc=\$? >> \$o/done
    python3 bench/startup.py --workload W6c --layers 0 --source folder4 --dir /tmp/st --cold --steps 2 \
      --cap 24GiB --result \$o/w6c_folder4.json > \$o/w6c_folder4.log 2>&1
    echo w6c_folder4 rc=\$? >> \$o/done
    python3 bench/run.py --workload W1 --engines plain,zerofit --steps 2 --cap 24GiB --commit $commit \
      --out \$o/w1 > \$o/w1.log 2>&1
    echo w1 rc=\$? >> \$o/done
    echo all >> \$o/done
  " > /dev/null 2>&1 < /dev/null &
  echo started;;
poll)
  end=$((SECONDS + ${2:-500}))
  while [ $SECONDS -lt $end ] && ! grep -q '^all' /tmp/run_out/done 2>/dev/null; do sleep 5; done
  cat /tmp/run_out/done; tail -n 3 /tmp/run_out/*.log
  cd /tmp/run_out && tar czf $OUT/all.tgz --exclude='*.prof' .;;
esac
