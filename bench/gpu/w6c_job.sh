# The W6c end-to-end runs, detached (a device call lays the tree anew): `bash bench/gpu/w6c_job.sh start` copies
# the tree to /tmp/run and starts them under setsid, writing /tmp/run_out; `bash bench/gpu/w6c_job.sh poll SECONDS`
# waits up to SECONDS for them, then copies what is there to $OUT. Carry .gpu_site (bitsandbytes, pydantic).
# In order, each after `zerofit estimate`'s prediction for it: W6c from a meta model (zerofit, and PEFT +
# bitsandbytes in the GPU: micro-batches of 1 on an 80 GB card, where 2 x 2048 runs out of memory); W6c from its
# 4-bit folder, written first by another process and read past the page cache; W1 and W6a against plain.
set -u
case "$1" in
start)
  rm -rf /tmp/run /tmp/run_out && cp -r . /tmp/run && mkdir -p /tmp/run_out
  cd /tmp/run
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  mb=1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && mb=2
  setsid bash -c "
    export PYTHONPATH=/tmp/run/.gpu_site:/tmp/run/src PYTHONUNBUFFERED=1
    o=/tmp/run_out
    est() { local name=\$1; shift; python3 -c 'import sys; from zerofit.cli import app; sys.argv[0] = \"zerofit\"; app()' \
      estimate --max-gpu-memory 24GiB --seq-len 2048 --json \"\$@\" > \$o/est_\$name.json 2> \$o/est_\$name.log; echo est_\$name rc=\$? >> \$o/done; }
    est W6c --shape W6c --qlora --micro-batch-size 2 --grad-accum 4
    python3 bench/run.py --workload W6c --engines zerofit,plain --steps 4 --cap 24GiB --commit $commit \
      --engine-args plain='--micro-batch $mb' --engine-timeout zerofit=560 --engine-timeout plain=420 \
      --out \$o/w6c > \$o/w6c.log 2>&1
    echo w6c rc=\$? >> \$o/done
    python3 bench/startup.py --workload W6c --layers 0 --source folder4 --dir /tmp/st --write-only > \$o/write4.log 2>&1
    echo write4 rc=\$? >> \$o/done
    est W6c_folder --model /tmp/st/W6c-80-nf4 --lora --micro-batch-size 2 --grad-accum 4
    python3 bench/startup.py --workload W6c --layers 0 --source folder4 --dir /tmp/st --direct --cold --steps 4 \
      --cap 24GiB --result \$o/w6c_folder4.json > \$o/w6c_folder4.log 2>&1
    echo w6c_folder4 rc=\$? >> \$o/done
    rm -rf /tmp/st
    est W1 --shape W1 --micro-batch-size 2 --grad-accum 4
    python3 bench/run.py --workload W1 --engines plain,zerofit --steps 2 --cap 24GiB --commit $commit \
      --out \$o/w1 > \$o/w1.log 2>&1
    echo w1 rc=\$? >> \$o/done
    est W6a --shape W3 --lora --micro-batch-size 2 --grad-accum 4
    python3 bench/run.py --workload W6a --engines plain,zerofit --steps 2 --cap 24GiB --commit $commit \
      --out \$o/w6a > \$o/w6a.log 2>&1
    echo w6a rc=\$? >> \$o/done
    echo all >> \$o/done
  " > /dev/null 2>&1 < /dev/null &
  echo started;;
poll)
  end=$((SECONDS + ${2:-500}))
  while [ $SECONDS -lt $end ] && ! grep -q '^all' /tmp/run_out/done 2>/dev/null; do sleep 5; done
  cat /tmp/run_out/done 2>/dev/null; tail -n 4 /tmp/run_out/*.log
  for d in w6c w6a w1; do [ -d /tmp/run_out/$d ] && (cd /tmp/run_out/$d && for f in *.json *.md; do [ -f "$f" ] && cp "$f" "$OUT/${d}_$f"; done); done
  cp /tmp/run_out/*.log /tmp/run_out/*.json "$OUT/" 2>/dev/null
  free -g | head -2; df -h /tmp | tail -1; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader;;
esac
