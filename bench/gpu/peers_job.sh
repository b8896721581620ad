# Unsloth beside zerofit, the clipped W1 row and the longest context (docs/benchmarks.md), detached (a device call
# lays the tree anew):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site WHEELS/*.whl
#   COMMIT=$(git rev-parse --short HEAD) bash bench/gpu/peers_job.sh start
# copies the tree to /tmp/run and starts the runs under setsid, writing /tmp/run_out; `bash bench/gpu/peers_job.sh
# poll SECONDS` waits up to SECONDS for them, then packs what is there into $OUT/all.tgz. The wheels (bench/README.md,
# "Unsloth"): unsloth, unsloth_zoo, bitsandbytes, liger-kernel, pydantic and what Unsloth needs beyond the GPU
# machine's image, installed into /tmp/site. PEERS_RUNS picks runs, in this order (default: w6a w1clip l8):
#   w6a      W6a (13B LoRA, 2 x 2048 tokens, 4 micro-batches): Unsloth in the GPU with no cap, zerofit fast at 24 GiB,
#            PEFT and PEFT + Liger-Kernel in the GPU with no cap; Unsloth's bf16 folder written first (26 GB)
#   w1clip   W1 clipped at 1.0: plain (no cap) and zerofit (24 GiB), 4 timed steps each
#   l8       the 8B shape in LoRA at L8_SEQ tokens (default 262,144) in one sequence, zerofit with no cap (L8_CAP:
#            78GiB on a larger card than 80 GB), one timed step (L8_STEPS=1 L8_MIN_TIMED=0 L8_WARMUP=0: the first step
#            alone, timed, its compile included)
#   u8       Unsloth on the 8B shape in LoRA at each of U8_SEQS (default 65536 131072), one timed step, up to the
#            first that fails
#   w6c8     W6c8 (70B QLoRA cut to 8 blocks): Unsloth in 4 bits, zerofit fast at 24 GiB, PEFT + bitsandbytes
set -u
case "$1" in
start)
  rm -rf /tmp/run /tmp/run_out && cp -r . /tmp/run && mkdir -p /tmp/run_out
  cd /tmp/run
  commit=${COMMIT:-unknown}
  setsid bash -c "
    export PYTHONPATH=/tmp/site:/tmp/run/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
    o=/tmp/run_out
    stamp() { echo \"\$1 rc=\$2 \$(date -u +%H:%M:%S)\" >> \$o/done; }
    bench() { local name=\$1; shift; python3 bench/run.py --commit $commit --out \$o/\$name \"\$@\" > \$o/\$name.log 2>&1; stamp \$name \$?; }
    folder() { python3 bench/engine_unsloth.py --workload \$1 --make-folder \$2 > \$o/folder_\$1.log 2>&1; stamp folder_\$1 \$?; }
    for run in ${PEERS_RUNS:-w6a w1clip l8}; do
      case \$run in
      w6a)
        folder W6a /tmp/u_w6a
        bench w6a --workload W6a --engines unsloth,zerofit-fast,plain,plain-liger --steps 4 --cap 24GiB \
          --engine-args 'unsloth=--folder /tmp/u_w6a' --engine-timeout unsloth=420 --engine-timeout plain=240 \
          --engine-timeout plain-liger=240 --timeout 360;;  # the folder stays for a rerun until u8 or w6c8
      w1clip)
        bench w1clip --workload W1 --engines plain,zerofit --engine-args 'plain=--clip 1.0' \
          --engine-args 'zerofit=--clip 1.0' --steps 5 --cap 24GiB --timeout 300;;
      l8)
        bench l8_\${L8_SEQ:-262144} --workload L8 --seq \${L8_SEQ:-262144} --engines zerofit --steps \${L8_STEPS:-2} \
          --min-timed \${L8_MIN_TIMED:-1} --engine-args \"zerofit=--warmup \${L8_WARMUP:-1}\" --cap \${L8_CAP:-none} \
          --engine-timeout zerofit=\${L8_TIMEOUT:-900};;
      u8)
        rm -rf /tmp/u_w6a; folder L8 /tmp/u_l8
        for seq in \${U8_SEQS:-65536 131072}; do
          bench u8_\$seq --workload L8 --seq \$seq --engines unsloth --steps 2 --min-timed 1 --cap none \
            --engine-args 'unsloth=--folder /tmp/u_l8' --timeout 400
          grep -q '\"status\": \"ok\"' \$o/u8_\$seq/results_L8.json 2>/dev/null || break
        done
        rm -rf /tmp/u_l8;;
      w6c8)
        rm -rf /tmp/u_w6a; folder W6c8 /tmp/u_w6c8
        bench w6c8 --workload W6c8 --engines unsloth,zerofit-fast,plain --steps 4 --cap 24GiB \
          --engine-args 'unsloth=--folder /tmp/u_w6c8' --timeout 300
        rm -rf /tmp/u_w6c8;;
      esac
    done
    echo all >> \$o/done
  " > /dev/null 2>&1 < /dev/null &
  echo started;;
poll)
  . "$(dirname "$0")/lib.sh" && zf_job_poll "${2:-500}";;
esac
