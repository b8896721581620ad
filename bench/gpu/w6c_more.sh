# The W6c peer with its checkpointing on, `zerofit estimate`'s predictions of the W6c and W6a runs, and how fast
# host memory is page-locked (bench/probes/pin_speed.py); detached, as w6c_job.sh: `start`, then `poll SECONDS`.
set -u
case "$1" in
start)
  rm -rf /tmp/run /tmp/run_out && cp -r . /tmp/run && mkdir -p /tmp/run_out
  cd /tmp/run
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  setsid bash -c "
    export PYTHONPATH=/tmp/run/.gpu_site:/tmp/run/src PYTHONUNBUFFERED=1
    o=/tmp/run_out
    python3 bench/probes/pin_speed.py --gib 8 > \$o/pin_speed.log 2>&1; echo pin rc=\$? >> \$o/done
    est() { local name=\$1; shift; python3 -c 'import sys; from zerofit.cli import app; sys.argv[0] = \"zerofit\"; app()' \
      estimate --max-gpu-memory 24GiB --seq-len 2048 --json \"\$@\" > \$o/est_\$name.json 2> \$o/est_\$name.log; echo est_\$name rc=\$? >> \$o/done; }
    est W6c --shape W6c --qlora --micro-batch-size 2 --grad-accum 4
    mkdir -p /tmp/cfg4 && python3 -c \"
import sys; sys.path.insert(0, 'bench'); import common
c = common.llama_config(common.WORKLOADS['W6c']); c.quantization_config = common.nf4_config(); c.save_pretrained('/tmp/cfg4')\"
    est W6c_folder --model /tmp/cfg4 --lora --micro-batch-size 2 --grad-accum 4
    est W6a --shape W3 --lora --micro-batch-size 2 --grad-accum 4
    python3 bench/run.py --workload W6c --engines plain --steps 3 --commit $commit \
      --engine-args plain='--micro-batch 1' --engine-timeout plain=400 --out \$o/w6c > \$o/w6c.log 2>&1
    echo w6c rc=\$? >> \$o/done
    echo all >> \$o/done
  " > /dev/null 2>&1 < /dev/null &
  echo started;;
poll)
  end=$((SECONDS + ${2:-500}))
  while [ $SECONDS -lt $end ] && ! grep -q '^all' /tmp/run_out/done 2>/dev/null; do sleep 5; done
  cat /tmp/run_out/done; cat /tmp/run_out/pin_speed.log; tail -n 3 /tmp/run_out/*.log
  cd /tmp/run_out && tar czf $OUT/all.tgz --exclude='*.prof' .;;
esac
