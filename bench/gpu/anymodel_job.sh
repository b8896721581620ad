#!/usr/bin/env bash
# Models that are not one chain of blocks (docs/benchmarks.md, "Any model"), detached (a device call lays the tree
# anew). The peers' wheels (DeepSpeed and pydantic: ../shared/bench/peer-wheels.sh) installed first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site WHEELS/*.whl
#   COMMIT=$(git rev-parse --short HEAD) bash bench/gpu/anymodel_job.sh start
# copies the tree to /tmp/run and starts the runs under setsid, writing /tmp/run_out; `bash bench/gpu/anymodel_job.sh
# poll SECONDS` waits up to SECONDS for them, then packs what is there into $OUT/all.tgz. ANY_RUNS picks runs, in
# this order (default: t5xl w2 u7 t5xxl); every zerofit run records zerofit estimate's prediction beside it (the
# hooked mode's transfers: [Note: the hooked mode's transfers], estimate/predict.py):
#   t5xl    the Flan-T5-XL shape (2.85 B), full fine-tuning: zerofit's hooked mode at 24 GiB, DeepSpeed ZeRO-3 with
#           parameters and optimizer offloaded to the CPU at 24 GiB, plain PyTorch in the GPU with no cap
#   w2      W2 (Llama-2-7B shape) at 24 GiB: zerofit's block chain and the same model in the hooked mode
#   u7      U7 (W2's layers as a U-Net, 6.74 B): the hooked mode at 24 GiB, plain PyTorch in the GPU with no cap
#   t5xxl   the Flan-T5-XXL shape (11.3 B): the hooked mode at 24 GiB, a 100 GiB host budget and the rest of the
#           optimizer state on the disk (/tmp/nv)
# `bash bench/gpu/anymodel_job.sh run` runs them inside a job that zf_job_start (lib.sh) started, to chain them
# with another script's runs.
set -u
. "$(dirname "$0")/lib.sh"
export TORCH_EXTENSIONS_DIR=/tmp/torch_ext TORCH_CUDA_ARCH_LIST=9.0  # DeepSpeed's cpu_adam op, built once
runs='
    for run in ${ANY_RUNS:-t5xl w2 u7 t5xxl}; do
      case $run in
      t5xl) bench t5xl --workload T5-XL --engines zerofit-hooked,deepspeed,plain --steps 4 --cap 24GiB \
          --engine-args "zerofit-hooked=--estimate" --engine-timeout deepspeed=420 --timeout 300;;
      w2) bench w2 --workload W2 --engines zerofit,zerofit-hooked --steps 4 --cap 24GiB \
          --engine-args "zerofit=--estimate" --engine-args "zerofit-hooked=--estimate" --timeout 300;;
      u7) bench u7 --workload U7 --engines zerofit-hooked,plain --steps 4 --cap 24GiB \
          --engine-args "zerofit-hooked=--estimate" --timeout 300;;
      t5xxl) mkdir -p /tmp/nv; bench t5xxl --workload T5-XXL --engines zerofit-hooked --steps 4 --cap 24GiB \
          --engine-args "zerofit-hooked=--estimate --nvme /tmp/nv --set max_host_memory=100GiB" --timeout 480
        rm -rf /tmp/nv;;
      esac
    done'
zf_job_main "$runs" "$@"
