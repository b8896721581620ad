set -x
export PYTHONPATH=$PWD/.gpu_site
cp bench/startup.py .old/bench/startup.py
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import bitsandbytes, torch; print(bitsandbytes.__version__, torch.__version__); import bitsandbytes.functional as F; x=torch.randn(64,64,device='cuda',dtype=torch.bfloat16); q,s=F.quantize_4bit(x,quant_type='nf4'); print('bnb ok', q.shape)" 2>&1 | tail -2
df -h /tmp | tail -1; nproc; free -g | head -2
# after: W6c 8 layers from a meta model, to its first step
timeout 300 python3 bench/startup.py --workload W6c --layers 8 --source meta --step --result $OUT/after_meta8.json > $OUT/after_meta8.log 2>&1; echo rc=$?
tail -5 $OUT/after_meta8.log
# before
timeout 300 python3 .old/bench/startup.py --workload W6c --layers 8 --source meta --step --result $OUT/before_meta8.json > $OUT/before_meta8.log 2>&1; echo rc=$?
tail -5 $OUT/before_meta8.log
