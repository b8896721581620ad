"""python bench/grpo_bench.py --engine zerofit --workload L8 --cap 24GiB --result /tmp/grpo_zf.json
python bench/grpo_bench.py --engine trl --workload L8 --cap none --result /tmp/grpo_trl.json
python bench/grpo_bench.py --engine zerofit --workload smoke --device cpu          # dry run on the CPU

GRPO (docs/rl.md) on one GPU: TRL's GRPOTrainer stock (PEFT in the GPU, no cap) or on zerofit
(``zerofit.hf.GRPOTrainer``, its ``max_gpu_memory`` the cap), the same script otherwise: LoRA r 16 (W6's adapters)
over the workload's random base in bf16, one prompt of ``--prompt-len`` random tokens per step with
``--generations`` completions of exactly ``--completion-len`` tokens (``min_new_tokens``: a random model's EOS would
end them early), beta 0.04, a reward computed from the completion's tokens. Each step's seconds are split by where
they went: generation (TRL's ``_generate_single_turn``), scoring (its log-probability forwards under ``no_grad``:
the reference's) and training (the rest: the loss's forward and backward, the optimizer). Peak GPU memory over the
process and peak host RSS are recorded; ``--steps`` steps, the first a warm-up.

The prompts are token ids made here (``_tokenize_prompts`` returns them), so the workload's vocabulary needs no
tokenizer of its own: a word-level one is built over it, which decodes the completions for the reward.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import common  # noqa: E402


def word_tokenizer(vocab: int):
    """A tokenizer with one word per id (``t0`` .. ``t{vocab-1}``, ``t0`` the pad and ``t1`` the EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


def main() -> int:
    p = common.engine_args(__doc__)
    p.add_argument("--engine", choices=["zerofit", "trl"], required=True)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion-len", type=int, default=1024)
    p.add_argument("--generations", type=int, default=8)
    args = p.parse_args()
    args.steps = max(args.steps, 2)

    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig

    w = common.WORKLOADS[args.workload]
    cap = common.parse_bytes(args.cap) if args.cap not in (None, "none") else None
    out: dict = {"engine": args.engine, "workload": w.name, "cap": args.cap, "status": "running", "steps": []}
    out |= {"prompt_len": args.prompt_len, "completion_len": args.completion_len, "generations": args.generations}
    on_gpu = args.device.startswith("cuda")
    if on_gpu:
        out["device"] = torch.cuda.get_device_name()
        if args.engine == "trl" and cap:
            common.set_gpu_cap(args.cap, args.device)
    sampler = common.HostMemorySampler()
    t0 = time.time()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    base = common.build_meta(w) if args.engine == "zerofit" else common.build_model(w, args.device, dtype, True)
    if args.engine == "zerofit":  # zerofit materializes the meta base where it lives (host memory, in bf16)
        base.to(dtype)
    tok = word_tokenizer(w.vocab)
    g = torch.Generator().manual_seed(args.seed)
    ids = {f"p{i}": torch.randint(2, w.vocab, (args.prompt_len,), generator=g).tolist() for i in range(args.steps)}
    split: dict = {"generation": 0.0, "scoring": 0.0}

    class Timed:
        def _tokenize_prompts(self, prompts):
            return [ids[p] for p in prompts], None, {}  # (ids, images, multimodal fields)

        def _generate_single_turn(self, *a, **k):
            t = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                split["generation"] += time.perf_counter() - t

        def _get_per_token_logps_and_entropies(self, *a, **k):
            t = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(*a, **k)
            finally:
                if not torch.is_grad_enabled():
                    split["scoring"] += time.perf_counter() - t

    if args.engine == "zerofit":
        import zerofit.hf

        parent, extra = zerofit.hf.GRPOTrainer, {"zerofit_config": {"max_gpu_memory": args.cap} if cap else {}}
    else:
        parent, extra = trl.GRPOTrainer, {}
    trainer_cls = type("GRPOTrainer", (Timed, parent), {})

    def reward(completion_ids, **_):  # a verifiable reward of the tokens: the share that are even
        return [sum(t % 2 == 0 for t in c) / max(1, len(c)) for c in completion_ids]

    L = common.LORA
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo-bench-"),
        max_steps=args.steps,
        per_device_train_batch_size=args.generations,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.completion_len,
        generation_kwargs={"min_new_tokens": args.completion_len},
        beta=0.04,
        learning_rate=L.lr,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=not on_gpu,
        bf16=on_gpu,
        gradient_checkpointing=True,
        seed=args.seed,
    )
    trainer = trainer_cls(
        model=base,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": list(ids)}),
        processing_class=tok,
        peft_config=LoraConfig(r=L.r, lora_alpha=L.alpha, lora_dropout=0.0, target_modules=list(L.targets)),
        **extra,
    )
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def on_step_begin(self, *_, **__):
            split.update(generation=0.0, scoring=0.0)
            self.t = time.perf_counter()

        def on_step_end(self, *_, **__):
            total = time.perf_counter() - self.t
            row = {"s": total, **split, "training": total - split["generation"] - split["scoring"]}
            out["steps"].append({k: round(v, 3) for k, v in row.items()})
            print(f"[grpo {args.engine}] step {len(out['steps'])}: {out['steps'][-1]}", flush=True)

    trainer.add_callback(Steps())
    out["setup_s"] = round(time.time() - t0, 1)
    try:
        trainer.train()
        out["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - every failure becomes a result line
        out["status"], out["error"] = ("OOM" if common.is_oom(e) else "error"), common.last_line(e)
    if on_gpu:
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / common.GiB, 2)
    out["peak_rss_gib"] = round(common.peak_rss_gib(), 2)
    out["peak_host_used_gib"] = round(sampler.peak_host_used / common.GiB, 2) if sampler.peak_host_used else None
    timed = out["steps"][1:]
    if timed:
        out["s_per_step"] = sorted(s["s"] for s in timed)[len(timed) // 2]
    print(f"[grpo {args.engine}] {out['status']}: {json.dumps({k: v for k, v in out.items() if k != 'steps'})}")
    if args.result:
        with open(args.result, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["status"] == "ok" else 1


if __name__ == "__main__":
    common.exit_now(main())
