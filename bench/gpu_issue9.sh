# Issue 9's runs on the nvidia-h200-x2 machine (source bench/gpu_setup.sh first). $1: which part.
set -u
R=$OUT/r; mkdir -p $R
C=${COMMIT:-unknown}
case "$1" in
  smoke)   # 2 ranks, tiny model, then the per-rank results
    python3 bench/run.py --workload smoke --engines zerofit --gpus 2 --steps 3 --timeout 120 --out $R/smoke --commit $C ;;
  w2)      # W2: zerofit on 1 GPU, then on 2 GPUs (24 GiB cap each), same machine, same call
    python3 bench/run.py --workload W2 --engines zerofit --steps 5 --cap 24GiB --timeout 170 --out $R/w2-1 --commit $C
    python3 bench/run.py --workload W2 --engines zerofit --gpus 2 --steps 5 --cap 24GiB --timeout 200 --out $R/w2-2 --commit $C ;;
  w5)      # W5: the 13B shape on 2 GPUs: zerofit (24 GiB cap each), then FSDP2 without offload or cap (the in-GPU
           # ceiling; --cap applies to every engine of a run.py call, so FSDP2 gets its own call)
    python3 bench/run.py --workload W5 --engines zerofit --gpus 2 --steps 5 --cap 24GiB --timeout 240 \
      --out $R/w5 --commit $C
    python3 bench/run.py --workload W5 --engines fsdp2 --gpus 2 --fsdp2-steps 4 --cap none \
      --engine-args 'fsdp2=--no-offload' --timeout 210 --out $R/w5fsdp --commit $C ;;
  nccl)    # the rank tests on the 2 GPUs (NCCL), then the one-GPU tests
    python3 -m pytest -q -rfE -p no:cacheprovider tests/test_ranks.py -k nccl; echo "== test_ranks -k nccl: exit $?"
    python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu.py; echo "== test_gpu: exit $?" ;;
  w5ds)    # W5: DeepSpeed ZeRO-3 with CPU offload on 2 GPUs. DS_ARGS: extra engine arguments (--no-offload-param:
           # only the optimizer offloaded), DS_TAG: suffix of the folder; the host's memory every 2 s goes to
           # $R/mem<tag>.log (MiB, free's Mem: line) and the kernel's log's end to $R/dmesg<tag>.txt
    (while true; do echo "$(date -u +%T) $(free -m | sed -n 2p)"; sleep 2; done) > $R/mem${DS_TAG:-}.log 2>&1 &
    MEMLOG=$!
    python3 bench/run.py --workload W5 --engines deepspeed --gpus 2 --steps ${DS_STEPS:-3} --cap 24GiB \
      --timeout ${DS_TIMEOUT:-560} ${DS_ARGS:+--engine-args "deepspeed=$DS_ARGS"} --out $R/w5ds${DS_TAG:-} --commit $C
    echo "== run.py: exit $?"
    kill $MEMLOG
    dmesg 2>&1 | tail -50 > $R/dmesg${DS_TAG:-}.txt ;;
esac
