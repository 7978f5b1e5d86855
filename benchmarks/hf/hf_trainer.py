"""Step time and peak memory of the run_clm-style example (examples/hf_trainer_clm.py) trained by
``ls.hf.Trainer``, ``transformers.Trainer`` with accelerate's FSDP2 and with DDP, and by a bare
``ls.shard`` loop on the same model and batches (the Trainer path's overhead).

    python benchmarks/hf/hf_trainer.py --repeats 3 --out benchmarks/hf     # driver
    (it runs: torchrun --nproc-per-node 2 benchmarks/hf/hf_trainer.py --worker IMPL ...)

Method (the README's bench method): every implementation runs in fresh torchrun processes, the
order alternating between repeats (A B C D, D C B A, ...); a step is timed from a barrier at
``on_step_begin`` to a barrier at ``on_step_end`` (forward, backward, clip, optimizer and
scheduler step, zero_grad), the slowest rank's time; the median over all timed steps of all
repeats. Peak memory: torch's ``MemTracker`` over one further step with every tensor alive before
it registered, the largest rank's. ``uptime``'s 1-minute load is recorded around every run. Each
step's CPU time (the main thread's, and the whole process's with gloo's threads) is recorded too.

The Trainer path's overhead over the bare loop is a few percent, under the run-to-run noise of
a shared 2-core machine; ``paired`` measures it within one run: ``ls.hf.Trainer`` trains, and a
callback steps a bare ``ls.shard`` loop on a copy of the same model next to each Trainer step
(after even steps, before odd ones), so that both see the same machine conditions.

FSDP2 on CPU: accelerate 1.15 never turns a MULTI_CPU run into FSDP (``AcceleratorState``), so
``Trainer(fsdp="full_shard", fsdp_config={"fsdp_version": 2})`` on CPU silently trains with DDP.
The ``fsdp2`` implementation here therefore sets the FSDP plugin and distributed type on the
Trainer's accelerator after it is built, so that accelerate's own FSDP2 code runs
(``fsdp2_prepare_model``: a unit per decoder layer, the embedding, a [norm, lm_head] tail unit
kept gathered from forward to backward, the root). Benchmark scaffolding, not part of layershard.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ["layershard", "fsdp2", "ddp", "bare", "paired"]
MiB = 2**20


# ---- worker (under torchrun) ---------------------------------------------------------------------


def _live_tensors() -> list:
    import torch
    from torch.distributed.tensor import DTensor

    out = []
    for o in gc.get_objects():
        try:
            if isinstance(o, DTensor):
                out.append(o.to_local())
            elif type(o) in (torch.Tensor, torch.nn.Parameter) and not o.is_meta:
                out.append(o)
        except Exception:  # noqa: BLE001 - exotic objects met during a gc walk
            continue
    return out


class _Meter:
    """Barrier-to-barrier step times; MemTracker's peak over step ``mem_step``."""

    def __init__(self, mem_step: int):
        self.times: list[float] = []
        # CPU seconds per step: the main thread's, and the whole process's (gloo's threads too);
        # less sensitive than wall time to other jobs on the machine (DEVELOPERS.md)
        self.thread_cpu: list[float] = []
        self.process_cpu: list[float] = []
        self._c0 = (0.0, 0.0)
        self.mem_step = mem_step
        self.peak: int | None = None
        self.breakdown: dict[str, int] = {}
        self._t0 = 0.0
        self._mt = None

    def begin(self, step: int, model, optimizer) -> None:
        import torch.distributed as dist
        from torch.distributed._tools.mem_tracker import MemTracker

        if step == self.mem_step:

            class _Tracker(MemTracker):  # no per-parameter gradient hooks (as layershard bench)
                def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
                    return super()._track_module_params_and_buffers(module, False)

            gc.collect()
            self._mt = _Tracker()
            self._mt.track_external(model, optimizer, *_live_tensors())
            self._mt.__enter__()
        dist.barrier()
        self._c0 = (time.thread_time(), time.process_time())
        self._t0 = time.perf_counter()

    def end(self, step: int) -> None:
        import torch.distributed as dist

        dist.barrier()
        wall = time.perf_counter() - self._t0
        thread, process = time.thread_time() - self._c0[0], time.process_time() - self._c0[1]
        if self._mt is not None:
            self._mt.__exit__(None, None, None)
            peak = next(iter(self._mt.get_tracker_snapshot("peak").values()))
            self.peak = int(peak["Total"])
            self.breakdown = {str(getattr(k, "value", k)): int(v) for k, v in peak.items()}
            self._mt = None
        else:
            self.times.append(wall)
            self.thread_cpu.append(thread)
            self.process_cpu.append(process)


def _trainer_run(
    impl: str, script, args, tokenizer, data, model, meter: _Meter, paired=None
) -> None:
    """``paired`` (a ``(_BareLoop, _Meter)``): one bare step next to each Trainer step, so that
    both see the same machine conditions (the overhead measurement)."""
    import transformers
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    import layershard as ls

    class Timing(transformers.TrainerCallback):
        # With ``paired``, the bare step comes after even Trainer steps and before odd ones, so
        # that neither always follows the other.
        def on_step_begin(self, a, state, control, model=None, optimizer=None, **kw):
            if paired is not None and state.global_step % 2 == 1:
                paired[0].step(state.global_step, paired[1])
            meter.begin(state.global_step, trainer.model_wrapped, trainer.optimizer)

        def on_step_end(self, a, state, control, **kw):
            meter.end(state.global_step - 1)
            if paired is not None and (state.global_step - 1) % 2 == 0:
                paired[0].step(state.global_step - 1, paired[1])

    class FSDP2OnCPU(transformers.Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            st = self.accelerator.state
            st.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            st.distributed_type = DistributedType.FSDP
            self.is_fsdp_enabled = True

    cls = {"layershard": ls.hf.Trainer, "ddp": transformers.Trainer, "fsdp2": FSDP2OnCPU}[impl]
    extra = {"layershard": ls.hf.ShardingPlugin()} if impl == "layershard" else {}
    trainer = cls(
        model=model,
        args=args,
        train_dataset=data["train"],
        processing_class=tokenizer,
        data_collator=transformers.default_data_collator,
        callbacks=[Timing()],
        **extra,
    )
    if impl == "fsdp2":
        assert trainer.accelerator.is_fsdp2
    trainer.train()


class _BareLoop:
    """The loop a user writes with ls.shard alone: same model, batches, optimizer (Trainer's
    decay groups, fused AdamW) and schedule as the Trainer run."""

    def __init__(self, args, data, model):
        import torch
        import transformers
        from torch.utils.data import DataLoader, DistributedSampler

        import layershard as ls

        self.args = args
        self.sharded = ls.shard(model)
        # Trainer's own grouping by name (the method reads no instance state)
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
        named = list(self.sharded.named_parameters())
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(
            groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon, fused=True,
        )  # fmt: skip
        self.sched = transformers.get_scheduler(
            args.lr_scheduler_type, self.opt, args.warmup_steps, num_training_steps=args.max_steps
        )
        sampler = DistributedSampler(data["train"], seed=args.seed)
        loader = DataLoader(
            data["train"], batch_size=args.per_device_train_batch_size, sampler=sampler,
            collate_fn=transformers.default_data_collator,
        )  # fmt: skip
        self.batches = iter(loader)
        self.sharded.train()

    def step(self, step: int, meter: _Meter) -> None:
        batch = next(self.batches)
        meter.begin(step, self.sharded, self.opt)
        loss = self.sharded(**batch).loss
        loss.backward()
        self.sharded.clip_grad_norm_(self.args.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.sharded.zero_grad(set_to_none=True)
        meter.end(step)


def worker(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    import hf_trainer_clm as example
    from transformers import HfArgumentParser, TrainingArguments

    torch.set_num_threads(1)
    steps = ns.warmup + ns.steps + 1  # warm-up, timed, one under MemTracker
    argv = [
        "--output_dir", str(Path(ns.run_dir) / "out"), "--use_cpu", "--model_size", ns.model_size,
        "--block_size", str(ns.block_size), "--per_device_train_batch_size", str(ns.batch),
        "--max_steps", str(steps), "--logging_steps", "1000", "--disable_tqdm", "true",
        "--tokenizer_name", ns.tokenizer, "--dataloader_num_workers", "0",
    ]  # fmt: skip
    if ns.worker == "fsdp2":
        argv += ["--fsdp", "full_shard", "--fsdp_config", '{"fsdp_version": 2}', "--no_layershard"]
    elif ns.worker in ("ddp",):
        argv += ["--no_layershard"]
    parser = HfArgumentParser((example.ScriptArguments, TrainingArguments))
    parser.set_defaults(**example.DEFAULTS)
    script, args = parser.parse_args_into_dataclasses(args=argv)
    tokenizer, data, model = example.build(script, args)
    meter = _Meter(mem_step=steps - 1)
    paired = None
    if ns.worker == "bare":
        loop = _BareLoop(args, data, model)
        for step in range(steps):
            loop.step(step, meter)
    elif ns.worker == "paired":  # ls.hf.Trainer steps and bare steps, alternating
        twin = copy.deepcopy(model)  # the same initial weights
        paired = (_BareLoop(args, data, twin), _Meter(mem_step=-1))
        meter.mem_step = paired[1].mem_step = -1
        _trainer_run("layershard", script, args, tokenizer, data, model, meter, paired)
    else:
        _trainer_run(ns.worker, script, args, tokenizer, data, model, meter)
    w = ns.warmup
    times = meter.times[w:]
    everyone: list = [None] * dist.get_world_size()
    mine = {"times": times, "peak": meter.peak, "breakdown": meter.breakdown}
    mine.update(thread_cpu=meter.thread_cpu[w:], process_cpu=meter.process_cpu[w:])
    if paired is not None:
        mine.update(bare_times=paired[1].times[w:], bare_thread_cpu=paired[1].thread_cpu[w:])
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        slowest = [max(r["times"][i] for r in everyone) for i in range(len(times))]
        result: dict = {
            "impl": ns.worker,
            "world_size": dist.get_world_size(),
            "step_times": slowest,
            "peak_bytes": max((r["peak"] for r in everyone if r["peak"] is not None), default=None),
            "peak_bytes_per_rank": [r["peak"] for r in everyone],
            "peak_breakdown_rank0": everyone[0]["breakdown"],
            "thread_cpu": [
                statistics.mean(r["thread_cpu"][i] for r in everyone) for i in range(len(times))
            ],
            "process_cpu": [
                statistics.mean(r["process_cpu"][i] for r in everyone) for i in range(len(times))
            ],
            "params": sum(p.numel() for p in model.parameters()) if ns.worker == "ddp" else None,
        }
        if paired is not None:
            n = len(times)
            result["bare_step_times"] = [
                max(r["bare_times"][i] for r in everyone) for i in range(n)
            ]
            result["bare_thread_cpu"] = [
                statistics.mean(r["bare_thread_cpu"][i] for r in everyone) for i in range(n)
            ]
        Path(ns.result).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's static destructors have aborted finished ranks (DEVELOPERS.md)


# ---- driver ----------------------------------------------------------------------------------------


def _load() -> float:
    return os.getloadavg()[0]


def _prepare_tokenizer(ns: argparse.Namespace, out: Path) -> str:
    """Train the example's BPE once, outside the timed runs, so that every run reads the same."""
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_trainer_clm as example

    path = out / "tokenizer"
    if not (path / "tokenizer.json").is_file():
        example.train_tokenizer(example.default_files(), 4096, path)
    return str(path)


def driver(ns: argparse.Namespace) -> None:
    out = Path(ns.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    tokenizer = _prepare_tokenizer(ns, out)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    for r in range(ns.repeats):
        order = ns.impls if r % 2 == 0 else list(reversed(ns.impls))
        for impl in order:
            result = runs / f"{impl}-r{r}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += [f"--nproc-per-node={ns.nproc}", __file__, "--worker", impl]
            cmd += ["--result", str(result), "--run-dir", str(runs / f"{impl}-r{r}")]
            cmd += ["--tokenizer", tokenizer, "--model-size", ns.model_size]
            cmd += ["--block-size", str(ns.block_size), "--batch", str(ns.batch)]
            cmd += ["--steps", str(ns.steps), "--warmup", str(ns.warmup)]
            before = _load()
            t0 = time.time()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            after = _load()
            if proc.returncode != 0 or not result.is_file():
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{impl} repeat {r} failed ({proc.returncode})")
            res = json.loads(result.read_text())
            res.update(repeat=r, loadavg_1min=[before, after], wall_s=time.time() - t0)
            res["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
            result.write_text(json.dumps(res, indent=1))
            med = statistics.median(res["step_times"])
            peak = f"{res['peak_bytes'] / MiB:.1f} MiB" if res["peak_bytes"] else "n/a"
            print(f"repeat {r} {impl:<10} step {med:.3f} s  peak {peak}"
                  f"  load {before:.2f}->{after:.2f}", flush=True)  # fmt: skip
    report(out, vars(ns))


def report(out: Path, settings: dict) -> dict:
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    impls = {}
    for impl in IMPLS[:-1]:  # paired: below
        mine = [r for r in runs if r["impl"] == impl]
        if not mine:
            continue
        times = [t for r in mine for t in r["step_times"]]
        impls[impl] = {
            "repeats": len(mine),
            "step_s_median": statistics.median(times),
            "step_s_min_max": [min(times), max(times)],
            "per_repeat_median": [statistics.median(r["step_times"]) for r in mine],
            "thread_cpu_s_median": statistics.median(t for r in mine for t in r["thread_cpu"]),
            "process_cpu_s_median": statistics.median(t for r in mine for t in r["process_cpu"]),
            "peak_MiB": statistics.median(r["peak_bytes"] for r in mine) / MiB
            if all(r["peak_bytes"] for r in mine)
            else None,
        }
    ls_ = impls.get("layershard", {})

    def ratio(impl: str, key: str):
        if impl in impls and ls_:
            return ls_[key] / impls[impl][key]
        return None

    pairs = [r for r in runs if r["impl"] == "paired"]
    paired = None
    if pairs:
        trainer = [t for r in pairs for t in r["step_times"]]
        bare = [t for r in pairs for t in r["bare_step_times"]]
        paired = {
            "repeats": len(pairs),
            "trainer_step_s_median": statistics.median(trainer),
            "bare_step_s_median": statistics.median(bare),
            "overhead": statistics.median(trainer) / statistics.median(bare),
            "per_step_ratio_median": statistics.median(t / b for t, b in zip(trainer, bare)),
            "thread_cpu_overhead": statistics.median(t for r in pairs for t in r["thread_cpu"])
            / statistics.median(t for r in pairs for t in r["bare_thread_cpu"]),
        }
    loads = [x for r in runs for x in r["loadavg_1min"]]
    res = {
        "settings": settings,
        "impls": impls,
        "layershard_time_vs_fsdp2": ratio("fsdp2", "step_s_median"),
        "layershard_peak_vs_fsdp2": ratio("fsdp2", "peak_MiB"),
        "layershard_time_vs_ddp": ratio("ddp", "step_s_median"),
        "layershard_peak_vs_ddp": ratio("ddp", "peak_MiB"),
        "trainer_overhead_vs_bare": ratio("bare", "step_s_median"),
        "paired": paired,
        "trainer_overhead_vs_bare_thread_cpu": ratio("bare", "thread_cpu_s_median"),
        "layershard_process_cpu_vs_fsdp2": ratio("fsdp2", "process_cpu_s_median"),
        "loadavg_1min": [min(loads), max(loads)] if loads else None,
        "dates": [min(r["date"] for r in runs), max(r["date"] for r in runs)],
    }
    (out / "results.json").write_text(json.dumps(res, indent=1))
    lines = [
        f"{'impl':<12}{'step s':>9}{'min-max':>16}{'x ls':>8}{'main CPU s':>12}{'x ls':>8}"
        f"{'proc CPU s':>12}{'x ls':>8}{'peak MiB':>10}{'x ls':>8}"
    ]
    for impl, s in impls.items():
        if s["peak_MiB"] is None:
            continue
        lo, hi = s["step_s_min_max"]
        lines.append(
            f"{impl:<12}{s['step_s_median']:>9.3f}{f'{lo:.3f}-{hi:.3f}':>16}"
            f"{s['step_s_median'] / ls_['step_s_median']:>8.3f}"
            f"{s['thread_cpu_s_median']:>12.3f}{s['thread_cpu_s_median'] / ls_['thread_cpu_s_median']:>8.3f}"
            f"{s['process_cpu_s_median']:>12.3f}{s['process_cpu_s_median'] / ls_['process_cpu_s_median']:>8.3f}"
            f"{s['peak_MiB']:>10.1f}{s['peak_MiB'] / ls_['peak_MiB']:>8.3f}"
        )
    if paired:
        lines.append(
            f"paired (ls.hf.Trainer and bare ls.shard steps alternating in the same processes, "
            f"{paired['repeats']} runs): Trainer {paired['trainer_step_s_median']:.3f} s, bare "
            f"{paired['bare_step_s_median']:.3f} s, overhead {paired['overhead']:.3f} (median of "
            f"per-step ratios {paired['per_step_ratio_median']:.3f}; main-thread CPU "
            f"{paired['thread_cpu_overhead']:.3f})"
        )
    lines.append(f"load average (1 min) during the runs: {res['loadavg_1min']}; {res['dates']}")
    (out / "table.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "hf"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model-size", default="small")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.worker:
        worker(ns)
    elif ns.report_only:
        report(Path(ns.out), vars(ns))
    else:
        driver(ns)


if __name__ == "__main__":
    main()
