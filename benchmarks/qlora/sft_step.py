"""One QLoRA SFT run at the ranks torchrun starts: trl's SFTTrainer on a 4-bit base with LoRA on
every linear, either through ``ls.hf.sharded(SFTTrainer)`` (``ls``) or with accelerate's FSDP
recipe for QLoRA (``fsdp``: ``bnb_4bit_quant_storage`` = the compute dtype so that FSDP can
flatten the packed weights, ``use_orig_params``, the decoder layers wrapped). Same script, same
data, same seed otherwise. Rank 0 appends one JSON line to OUT: the step times after WARMUP steps
(barrier to barrier, slowest rank), every rank's main-thread CPU per step, its peak RSS and its
peak tensor memory over the last step (MemTracker).

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/qlora/sft_step.py ls BASE OUT
"""

from __future__ import annotations

import gc
import json
import os
import random
import resource
import sys
import time

import torch
import torch.distributed as dist
import transformers as T
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import SFTConfig, SFTTrainer

STEPS, WARMUP, SEQ, BATCH = 9, 2, 256, 2  # the last step is MemTracker's, not timed
WORDS = [f"w{i}" for i in range(500)]


def tokenizer():
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", *WORDS, "<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def data(n: int) -> Dataset:
    r = random.Random(0)
    rows = [
        {
            "prompt": " ".join(r.choices(WORDS, k=64)),
            "completion": " ".join(r.choices(WORDS, k=190)),
        }
        for _ in range(n)
    ]
    return Dataset.from_list(rows)


def save_base(folder: str) -> None:
    cfg = T.LlamaConfig(
        vocab_size=len(WORDS) + 3, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    T.LlamaForCausalLM(cfg).save_pretrained(folder)


def live_tensors() -> list[torch.Tensor]:
    """Every tensor alive (FSDP's flat parameters, Params4bit and DTensors' local parts too)."""
    from torch.distributed.tensor import DTensor

    out = []
    for o in gc.get_objects():
        try:
            if isinstance(o, DTensor):
                out.append(o.to_local())
            elif isinstance(o, torch.Tensor) and not o.is_meta:
                out.append(o)
        except Exception:  # noqa: BLE001 - exotic objects met during a gc walk
            continue
    return out


class Meter(T.TrainerCallback):
    """Barrier-to-barrier step times and the main thread's CPU seconds per step (less sensitive
    to other jobs on a shared machine); torch's MemTracker over the last step, every tensor
    alive before it registered (as benchmarks/hf/hf_trainer.py)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.peak = 0
        self.trainer = None
        self._mt = None

    def on_train_begin(self, args, state, control, **kw):
        self.rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

    def on_step_begin(self, args, state, control, **kw):
        if os.environ.get("QLORA_OPS") and state.global_step == WARMUP + 1 and dist.get_rank() == 0:
            self._ops = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._ops.__enter__()  # the ops of two timed steps, rank 0 (QLORA_OPS: where to)
        if state.global_step == WARMUP:  # the process's peak RSS so far: loading and warm-up
            self.rss_warm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        if state.global_step == STEPS - 1:
            from torch.distributed._tools.mem_tracker import MemTracker

            class Tracker(MemTracker):  # no per-parameter gradient hooks
                def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
                    return super()._track_module_params_and_buffers(module, False)

            gc.collect()
            self._mt = Tracker()
            self._mt.track_external(*live_tensors())
            self._mt.__enter__()
        dist.barrier()
        self.t0, self.c0 = time.perf_counter(), time.thread_time()

    def on_step_end(self, args, state, control, **kw):
        ops = getattr(self, "_ops", None)
        if ops is not None and state.global_step == WARMUP + 3:
            ops.__exit__(None, None, None)
            self._ops = None
            table = ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            with open(os.environ["QLORA_OPS"], "w") as f:
                f.write(table)
        dist.barrier()
        wall, cpu = time.perf_counter() - self.t0, time.thread_time() - self.c0
        if self._mt is not None:
            self._mt.__exit__(None, None, None)
            self.peak = int(next(iter(self._mt.get_tracker_snapshot("peak").values()))["Total"])
            self._mt = None
        else:
            self.times.append(wall)
            self.cpu.append(cpu)


def main() -> None:
    impl, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    fsdp = impl == "fsdp"
    kw = {}
    if fsdp:
        kw = dict(
            fsdp="full_shard auto_wrap",
            fsdp_config={"use_orig_params": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        )  # fmt: skip
    args = SFTConfig(
        output_dir=f"{out}.{impl}.d", use_cpu=True, ddp_backend="gloo", report_to=[],
        per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", bf16=False, gradient_checkpointing=False, max_length=SEQ,
        disable_tqdm=True, completion_only_loss=True, seed=0, log_level="error", **kw,
    )  # fmt: skip
    bnb = T.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,  # this CPU has no fast bf16 matmul
        # the FSDP recipe: packed bytes stored in the compute dtype so FSDP can flatten them
        bnb_4bit_quant_storage=torch.float32 if fsdp else torch.uint8,
    )  # fmt: skip
    model = T.AutoModelForCausalLM.from_pretrained(
        base, quantization_config=bnb, device_map="cpu", dtype=torch.float32
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    if impl == "ls":
        import layershard as ls

        cls = ls.hf.sharded(SFTTrainer)
    else:
        cls = SFTTrainer
    timer = Meter()
    trainer = cls(
        model=model, args=args, train_dataset=data(256), processing_class=tokenizer(),
        peft_config=lora, callbacks=[timer],
    )  # fmt: skip
    prof = os.environ.get("QLORA_PROFILE")  # cProfile of rank 0's training, written there
    if prof and dist.get_rank() == 0:
        import cProfile

        with cProfile.Profile() as pr:
            trainer.train()
        pr.dump_stats(f"{prof}.{impl}.prof")
    else:
        trainer.train()
    mine = torch.tensor(
        [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, timer.peak / 2**20]
        + timer.times[WARMUP:] + timer.cpu[WARMUP:] + [timer.rss_before, timer.rss_warm],
        dtype=torch.float64,
    )  # fmt: skip
    if os.environ.get("QLORA_MALLOC"):  # glibc's arenas: in use and kept free, to stderr
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_stats()
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if dist.get_rank() == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        k = len(timer.times) - WARMUP
        line = {
            "impl": impl,
            "step_s": torch.stack([e[2 : 2 + k] for e in every]).max(0).values.tolist(),
            "thread_cpu_s": [e[2 + k : -2].tolist() for e in every],
            # peak RSS when training began (model loaded, prepared) and after the warm-up steps
            "peak_rss_at_begin_mib": [e[-2].item() for e in every],
            "peak_rss_after_warmup_mib": [e[-1].item() for e in every],
            "peak_rss_mib": [e[0].item() for e in every],
            "peak_tensors_mib": [e[1].item() for e in every],
            "losses": losses,
            "load": os.getloadavg(),
        }
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's static destructors (see tests/_dist.py)


if __name__ == "__main__":
    if sys.argv[1] == "base":
        save_base(sys.argv[2])
    else:
        main()
