# Prepares the GPU machine for bench/run.py; bench/gpu/suite.sh sources it. By hand, from the repository root:
#
#     source bench/gpu/setup.sh; python3 bench/run.py --workload W1 ... --out $OUT
#
# (the device call must carry .whl). Installs the wheels in .whl/ (DeepSpeed
# 0.19.8, pure Python, built by bench/gpu/peer-wheels.sh with DS_BUILD_OPS=0;
# pydantic 2.14.4 and pydantic-core 2.50.5, annotated-types, typing-inspection,
# typing-extensions, hjson: what DeepSpeed and zerofit need beyond the image)
# into /tmp/site without touching the image's packages, puts them and the
# working tree's src/ on PYTHONPATH, and sets up DeepSpeed's JIT build of its
# cpu_adam op (Hopper only, cached under /tmp). Prints the versions it will use.
# Returns non-zero (without exiting the caller's shell) if anything is missing.

_zf_setup() {
  if [ ! -d .whl ] || ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_setup: no .whl/*.whl here (run from the repo root; name .whl in the device call's carry)" >&2
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | grep -v -e "^WARNING: Target directory" -e "^WARNING: Running pip as" -e "^$" >&2
  export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
  export TORCH_CUDA_ARCH_LIST=9.0
  export PYTHONUNBUFFERED=1
  export MAX_JOBS="${MAX_JOBS:-16}"
  mkdir -p "$TORCH_EXTENSIONS_DIR"
  python3 - <<'EOF'
import importlib, os, sys
import torch
print(f"gpu_setup: python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
bad = []
for name in ("transformers", "accelerate", "pydantic", "pydantic_core", "deepspeed", "zerofit", "psutil"):
    try:
        mod = importlib.import_module(name)
        print(f"gpu_setup: {name} {getattr(mod, '__version__', '?')} from {os.path.dirname(mod.__file__)}")
    except Exception as e:
        bad.append(name)
        print(f"gpu_setup: {name} FAILED to import: {type(e).__name__}: {e}")
for name in ("peft",):     # the lora suite's (its wheel in .whl); the others run without it
    try:
        mod = importlib.import_module(name)
        print(f"gpu_setup: {name} {getattr(mod, '__version__', '?')} from {os.path.dirname(mod.__file__)}")
    except Exception as e:
        print(f"gpu_setup: {name} does not import ({type(e).__name__}): the lora suite is skipped")
sys.exit(1 if bad else 0)
EOF
}
_zf_setup
