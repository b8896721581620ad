# bench/startup.py on the GPU machine (carry .gpu_site: bitsandbytes, pydantic; .old: the code before, for
# before/after): W6c cut to 8 blocks from a meta model, to its first step, before and after; then cut to 4 blocks
# from a bf16 folder (quantized as read) and from its 4-bit save.
export PYTHONPATH=$PWD/.gpu_site PYTHONUNBUFFERED=1
cp bench/startup.py .old/bench/startup.py
nvidia-smi --query-gpu=name --format=csv,noheader
run() { local name=$1; shift; timeout 280 python3 "$@" --result $OUT/$name.json > $OUT/$name.log 2>&1; echo "$name rc=$?"; grep -E '"(initialize|materialize|first_step|process_to_first_step)_seconds"|params_per_s|"gb_per_s"' $OUT/$name.json | tr -d '\n'; echo; }
case "${1:-meta}" in
meta)
  run after_meta8 bench/startup.py --workload W6c --layers 8 --source meta --step --profile $OUT/after_meta8.prof
  run after_folder4l bench/startup.py --workload W6c --layers 4 --source folder --qlora --dir /tmp/st --direct --step;;
folders)
  run before_folder4l .old/bench/startup.py --workload W6c --layers 4 --source folder --qlora --dir /tmp/st --step
  run after_nf4folder4l bench/startup.py --workload W6c --layers 4 --source folder4 --dir /tmp/st --direct --step;;
esac
