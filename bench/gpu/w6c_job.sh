# The W6c end-to-end runs, detached (a device call lays the tree anew): `bash bench/gpu/w6c_job.sh start` copies
# the tree to /tmp/run and starts them under setsid, writing /tmp/run_out; `bash bench/gpu/w6c_job.sh poll SECONDS`
# waits up to SECONDS for them, then copies what is there to $OUT. Carry .gpu_site (bitsandbytes, pydantic).
set -u
case "$1" in
start)
  rm -rf /tmp/run /tmp/run_out && cp -r . /tmp/run && mkdir -p /tmp/run_out
  cd /tmp/run
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  setsid bash -c "
    export PYTHONPATH=/tmp/run/.gpu_site:/tmp/run/src PYTHONUNBUFFERED=1
    python3 bench/run.py --workload W6c --engines zerofit,plain --steps 4 --cap 24GiB --commit $commit \
      --engine-timeout zerofit=560 --engine-timeout plain=420 --out /tmp/run_out/w6c > /tmp/run_out/w6c.log 2>&1
    echo w6c rc=\$? >> /tmp/run_out/done
    python3 bench/run.py --workload W6a --engines plain,zerofit --steps 2 --cap 24GiB --commit $commit \
      --out /tmp/run_out/w6a > /tmp/run_out/w6a.log 2>&1
    echo w6a rc=\$? >> /tmp/run_out/done
    python3 bench/run.py --workload W1 --engines plain,zerofit --steps 2 --cap 24GiB --commit $commit \
      --out /tmp/run_out/w1 > /tmp/run_out/w1.log 2>&1
    echo w1 rc=\$? >> /tmp/run_out/done
  " > /dev/null 2>&1 < /dev/null &
  echo started;;
poll)
  end=$((SECONDS + ${2:-500}))
  while [ $SECONDS -lt $end ] && [ "$(wc -l < /tmp/run_out/done 2>/dev/null || echo 0)" -lt 3 ]; do sleep 10; done
  cat /tmp/run_out/done 2>/dev/null; tail -3 /tmp/run_out/*.log
  for d in w6c w6a w1; do [ -d /tmp/run_out/$d ] && (cd /tmp/run_out/$d && for f in *.json *.md; do [ -f "$f" ] && cp "$f" "$OUT/${d}_$f"; done); done
  for f in /tmp/run_out/*.log; do cp "$f" "$OUT/"; done
  free -g | head -2; nvidia-smi --query-gpu=memory.used --format=csv,noheader;;
esac
