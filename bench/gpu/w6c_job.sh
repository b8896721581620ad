# The W6c end-to-end runs and the start-up of W1 and W6a against plain, detached (a device call lays the tree
# anew): `COMMIT=$(git rev-parse --short HEAD) bash bench/gpu/w6c_job.sh start` copies the tree to /tmp/run and
# starts them under setsid, writing /tmp/run_out; `bash bench/gpu/w6c_job.sh poll SECONDS` waits up to SECONDS for
# them, then packs what is there into $OUT/all.tgz. Carry .gpu_site (bitsandbytes, pydantic: pip install --target).
# In order, each after `zerofit estimate`'s prediction for it:
#   w6c      W6c from a meta model, 4 steps: zerofit at a 24 GiB cap, and PEFT + bitsandbytes in the GPU (micro-batches
#            of 1 x 2048 on an 80 GB card, where 2 x 2048 runs out of memory; 2 on an H200)
#   w6c_h48  zerofit again with a 48 GiB host budget (max_host_memory), 3 steps
#   w1, w6a  plain, then zerofit, 2 steps each: the time to the first step
#   w6c_folder4  W6c from its 4-bit folder (written first by another process), read past the page cache, 3 steps
set -u
case "$1" in
start)
  rm -rf /tmp/run /tmp/run_out && cp -r . /tmp/run && mkdir -p /tmp/run_out
  cd /tmp/run
  commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  mb=1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && mb=2
  setsid bash -c "
    export PYTHONPATH=/tmp/run/.gpu_site:/tmp/run/src PYTHONUNBUFFERED=1
    o=/tmp/run_out
    stamp() { echo \"\$1 rc=\$2 \$(date -u +%H:%M:%S)\" >> \$o/done; }
    est() { local name=\$1; shift; python3 -c 'import sys; from zerofit.cli import app; sys.argv[0] = \"zerofit\"; app()' \
      estimate --max-gpu-memory 24GiB --seq-len 2048 --json \"\$@\" > \$o/est_\$name.json 2> \$o/est_\$name.log; stamp est_\$name \$?; }
    bench() { local name=\$1; shift; python3 bench/run.py --commit $commit --out \$o/\$name \"\$@\" > \$o/\$name.log 2>&1; stamp \$name \$?; }
    est W6c --shape W6c --qlora --micro-batch-size 2 --grad-accum 4
    bench w6c --workload W6c --engines zerofit,plain --steps 4 --cap 24GiB \
      --engine-args plain='--micro-batch $mb' --engine-timeout zerofit=400 --engine-timeout plain=300
    est W6c_h48 --shape W6c --qlora --micro-batch-size 2 --grad-accum 4 --max-host-memory 48GiB
    bench w6c_h48 --workload W6c --engines zerofit --steps 3 --cap 24GiB \
      --engine-args zerofit='--set max_host_memory=48GiB' --engine-timeout zerofit=400
    est W1 --shape W1 --micro-batch-size 2 --grad-accum 4
    bench w1 --workload W1 --engines plain,zerofit --steps 2 --cap 24GiB
    est W6a --shape W3 --lora --micro-batch-size 2 --grad-accum 4
    bench w6a --workload W6a --engines plain,zerofit --steps 2 --cap 24GiB
    python3 bench/startup.py --workload W6c --layers 0 --source folder4 --dir /tmp/st --write-only > \$o/write4.log 2>&1
    stamp write4 \$?
    est W6c_folder --model /tmp/st/W6c-80-nf4 --lora --micro-batch-size 2 --grad-accum 4
    python3 bench/startup.py --workload W6c --layers 0 --source folder4 --dir /tmp/st --direct --cold --steps 3 \
      --cap 24GiB --result \$o/w6c_folder4.json > \$o/w6c_folder4.log 2>&1
    stamp w6c_folder4 \$?
    echo all >> \$o/done
  " > /dev/null 2>&1 < /dev/null &
  echo started;;
poll)
  . "$(dirname "$0")/lib.sh" && zf_job_poll "${2:-500}";;
esac
