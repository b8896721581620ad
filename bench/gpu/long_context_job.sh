# The long-context runs (docs/long-context.md), detached (a device call lays the tree anew):
# `COMMIT=$(git rev-parse --short HEAD) bash bench/gpu/long_context_job.sh start` copies the tree to /tmp/run and
# starts them under setsid, writing /tmp/run_out; `bash bench/gpu/long_context_job.sh poll SECONDS` waits up to
# SECONDS for them, then packs what is there into $OUT/all.tgz. Carry .gpu_site (pydantic: pip install --target);
# with OLD_TGZ (a `git archive` of an earlier commit, carried), W1 runs on that tree too, beside this one's.
# In order, each zerofit run after `zerofit estimate`'s prediction for it (engine_zerofit.py --estimate), its peer
# (PEFT with Hugging Face's gradient checkpointing and SDPA, in the GPU with no cap) after it:
#   tiles        tests/gpu/test_gpu_tiles.py: a tiled layer in bf16, and its memory against the planner's count
#   L8_32k, L8_64k, L8_128k   the Llama-3.1-8B shape in LoRA at 24 GiB
#   L13_64k      the Llama-2-13B shape in LoRA at 24 GiB
#   w1, w1_old   W1 (3B full fine-tuning, 24 GiB) against plain, on this tree and OLD_TGZ's
#   L8full_32k   the 8B shape in full fine-tuning at 24 GiB, 100 GiB of host memory and the disk tier
#   L8_256k      the 8B shape in LoRA at 262,144 tokens, no cap
set -u
case "$1" in
start)
  rm -rf /tmp/run /tmp/run_out /tmp/old && cp -r . /tmp/run && mkdir -p /tmp/run_out
  if [ -n "${OLD_TGZ:-}" ]; then mkdir -p /tmp/old && tar xzf "$OLD_TGZ" -C /tmp/old; fi
  cd /tmp/run
  commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  setsid bash -c "
    export PYTHONPATH=/tmp/run/.gpu_site:/tmp/run/src PYTHONUNBUFFERED=1
    o=/tmp/run_out
    stamp() { echo \"\$1 rc=\$2 \$(date -u +%H:%M:%S)\" >> \$o/done; }
    bench() { local name=\$1; shift; python3 bench/run.py --commit $commit --out \$o/\$name \"\$@\" > \$o/\$name.log 2>&1; stamp \$name \$?; }
    python3 -m pytest tests/gpu/test_gpu_tiles.py -q -s -p no:cacheprovider > \$o/tiles.log 2>&1; stamp tiles \$?
    for seq in 32768 65536 131072; do
      steps=3; [ \$seq = 131072 ] && steps=2
      bench L8_\$((seq / 1024))k --workload L8 --seq \$seq --engines zerofit,plain --steps \$steps --cap 24GiB \
        --engine-args zerofit=--estimate --engine-timeout zerofit=540 --engine-timeout plain=240
    done
    bench L13_64k --workload L13 --seq 65536 --engines zerofit,plain --steps 2 --cap 24GiB \
      --engine-args zerofit=--estimate --engine-timeout zerofit=540 --engine-timeout plain=240
    bench w1 --workload W1 --engines plain,zerofit --steps 3 --cap 24GiB
    if [ -d /tmp/old/src ]; then
      (cd /tmp/old && PYTHONPATH=/tmp/run/.gpu_site:/tmp/old/src python3 bench/run.py --commit old --out \$o/w1_old \
        --workload W1 --engines zerofit --steps 3 --cap 24GiB > \$o/w1_old.log 2>&1); stamp w1_old \$?
    fi
    mkdir -p /tmp/nvme
    bench L8full_32k --workload L8-full --seq 32768 --engines zerofit --steps 2 --cap 24GiB \
      --engine-args zerofit='--estimate --set max_host_memory=100GiB --nvme /tmp/nvme' --engine-timeout zerofit=580
    bench L8_256k --workload L8 --seq 262144 --engines zerofit --steps 2 --cap none --engine-timeout zerofit=900
    echo all >> \$o/done
  " > /dev/null 2>&1 < /dev/null &
  echo started;;
poll)
  . "$(dirname "$0")/lib.sh" && zf_job_poll "${2:-500}";;
esac
