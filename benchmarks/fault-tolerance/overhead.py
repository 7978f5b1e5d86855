"""Fault tolerance across replica groups (ls.ft, torchft) against plain ``hybrid``, on CPU.

Two measurements (README.md next to this file has the results and how to read them):

- ``--mode overhead``: step time of G groups x K ranks through ``ls.ft.FaultTolerant`` against
  plain ``hybrid`` over the same G*K ranks (``shard_size=K``), the same model, batches and seed,
  alternating the two over ``--repeats``. Each rank times every step (``perf_counter`` around
  zero_grad .. optimizer step, after ``--warmup`` steps); a run's figure is rank 0's median.
  The FT runs also split the step: quorum (``zero_grad``), the cross-group all-reduce, and
  ``should_commit`` + optimizer step.
- ``--mode failure``: G groups x K ranks through ls.ft; group 1's last rank SIGKILLs itself after
  its forward of step ``--kill-step``; the script (the launcher) kills the rest of the group and
  starts it again. From group 0 rank 0's step log: the wall time between the last committed step
  before the failure and the first committed step after it, minus a median step (the time
  lost), the steps thrown away, and the restarted group's time from its start to its recovery.

``--link PRESET|RATE[,DELAY]`` (overhead mode, root): over the testbed of
``layershard bench --nodes`` (src/layershard/testbed/): one network namespace per group, the
groups' nodes joined by the shaped link, each group's ranks on their node's loopback, the
Lighthouse on node 0; ``hybrid`` puts ranks g*K..g*K+K-1 on node g (its shard groups inside a
node, its replicate all-reduce across the link).

Run from the repository root with the venv active::

    python benchmarks/fault-tolerance/overhead.py --mode overhead --repeats 3 --out benchmarks/fault-tolerance/overhead.json
    python benchmarks/fault-tolerance/overhead.py --mode failure --repeats 2 --out benchmarks/fault-tolerance/failure.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one rank ----------------------------------------------------------------------------------


def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    import layershard as ls
    from layershard.models import LlamaForCausalLM, build_config

    os.environ.update(
        RANK=str(cfg["rank"]), WORLD_SIZE=str(cfg["world"]), LOCAL_RANK=str(cfg["rank"]),
        LOCAL_WORLD_SIZE=str(cfg["world"]), MASTER_ADDR=cfg.get("master_addr", "127.0.0.1"),
        MASTER_PORT=str(cfg["master_port"]),
    )  # fmt: skip
    torch.set_num_threads(1)
    ls.init_distributed(backend="gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(build_config(cfg["model"], vocab_size=cfg["vocab"]))
    ft_mode = cfg["mode"] != "hybrid"
    k = cfg["ranks"]
    if ft_mode:
        model = ls.shard(model)
    else:
        model = ls.shard(model, strategy="hybrid", shard_size=k)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ft = None
    if cfg["mode"] == "ft":
        ft = ls.ft.FaultTolerant(
            model, opt, replica_id=f"group{cfg['group']}", lighthouse=cfg["lighthouse"],
            init_sync=False, hostname=cfg.get("master_addr", "127.0.0.1"), timeout=30,
            quorum_timeout=30,
            use_async_quorum=not cfg.get("sync_quorum", False),
        )  # fmt: skip
    g_rank = cfg["group"] * k + cfg["rank"] if ft_mode else cfg["rank"]
    g_world = cfg["groups"] * k

    def batch(position: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * position + g_rank)
        return torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)

    log = []
    kill = cfg.get("kill")
    t_start = time.time()
    step = 0
    while (ft.step_count if ft else step) < cfg["steps"] or (
        ft and cfg.get("kill_step") is not None and ft.state.participants < cfg["groups"]
    ):  # failure mode: not done before the restarted group is back
        t0 = time.perf_counter()
        if ft:
            ft.zero_grad()
            position = ft.data_position
        else:
            opt.zero_grad()
            position = step
        t1 = time.perf_counter()
        loss = model(batch(position), labels=batch(position)).loss
        if kill and ft and ft.step_count == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        t2 = time.perf_counter()
        committed = True
        if ft:
            ft.all_reduce_gradients()
            t3 = time.perf_counter()
            committed = ft.step()
        else:
            t3 = time.perf_counter()
            opt.step()
        t4 = time.perf_counter()
        step += 1
        log.append({
            "wall": time.time(), "step_s": t4 - t0, "quorum_s": t1 - t0, "compute_s": t2 - t1,
            "allreduce_s": t3 - t2, "commit_step_s": t4 - t3, "committed": committed,
            "participants": ft.state.participants if ft else g_world // k,
            "step": ft.step_count if ft else step, **(ft.timings if ft else {}),
        })  # fmt: skip
    report = ft.report() if ft else {}
    Path(cfg["out"]).write_text(json.dumps({"log": log, "report": report, "start": t_start}))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


# ---- the launcher ------------------------------------------------------------------------------


LIGHTHOUSE = """
import sys, time
from layershard.ft import lighthouse_server
server = lighthouse_server(bind="0.0.0.0:" + sys.argv[1], min_replicas=int(sys.argv[2]),
                           heartbeat_timeout_ms=int(sys.argv[3]), join_timeout_ms=5000)
time.sleep(10**6)
"""


def launch(cfg: dict, tmp: Path, timeout_s: float, testbed=None) -> dict:
    """Start the run ``cfg`` describes; returns every rank's output by ``(group, rank)``. With
    ``testbed``: group g's ranks (hybrid: ranks g*K..g*K+K-1) on node g, the Lighthouse on
    node 0."""
    lighthouse = None
    lighthouse_proc = None
    procs: dict[tuple[int, int], subprocess.Popen] = {}
    groups, k = cfg["groups"], cfg["ranks"]
    starts: dict[int, float] = {}
    kill = cfg.get("kill_step")
    restarted = False

    def start(g: int, with_kill: bool) -> None:
        port = free_port()
        starts[g] = time.time()
        world = k if cfg["mode"] != "hybrid" else groups * k
        for r in range(world if cfg["mode"] == "hybrid" else k):
            node = r // k if cfg["mode"] == "hybrid" else g
            c = {**cfg, "group": g, "rank": r, "world": world, "master_port": port,
                 "lighthouse": lighthouse,
                 "out": str(tmp / f"out.{g}.{r}.json"),
                 "kill": kill if with_kill and r == k - 1 else None}  # fmt: skip
            cmd = [sys.executable, __file__, "--worker", json.dumps(c)]
            with open(tmp / f"log.{g}.{r}", "a") as log:
                if testbed is None:
                    procs[(g, r)] = subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                else:  # the group's store on its own node (hybrid's on node 0)
                    c["master_addr"] = testbed.ip(0 if cfg["mode"] == "hybrid" else g)
                    cmd[-1] = json.dumps(c)
                    procs[(g, r)] = testbed.popen(
                        node, cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )

    try:
        if cfg["mode"] == "hybrid":
            start(0, False)
        elif cfg["mode"] == "split":  # the groups' own worlds, nothing across them
            for g in range(groups):
                start(g, False)
        else:
            from layershard.ft import lighthouse_server

            # without a failure: every group in the first quorum
            min_replicas = 1 if kill is not None else groups
            heartbeat_ms = cfg.get("heartbeat_timeout_ms", 5000)
            if testbed is None:
                server = lighthouse_server(
                    min_replicas=min_replicas, heartbeat_timeout_ms=heartbeat_ms,
                    join_timeout_ms=cfg.get("join_timeout_ms", 5000),
                )  # fmt: skip
                lighthouse = server.address()
            else:
                port = free_port()
                lighthouse = f"http://{testbed.ip(0)}:{port}"
                lighthouse_proc = testbed.popen(
                    0, [sys.executable, "-c", LIGHTHOUSE, str(port), str(min_replicas),
                        str(heartbeat_ms)],
                    stdout=open(tmp / "lighthouse.log", "w"), stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
                time.sleep(3)  # it listens once its imports are done
            for g in range(groups):
                start(g, g == 1 and kill is not None)
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done in {timeout_s} s (logs in {tmp})")
            codes = {key: p.poll() for key, p in procs.items()}
            dead = [key for key, rc in codes.items() if rc not in (None, 0)]
            if dead:
                g = dead[0][0]
                if restarted or kill is None or g != 1:
                    raise RuntimeError(f"{dead} failed (logs in {tmp})")
                failed_at = time.time()
                for r in range(k):
                    if procs[(g, r)].poll() is None:
                        os.killpg(procs[(g, r)].pid, signal.SIGKILL)
                        procs[(g, r)].wait(timeout=10)
                start(g, False)
                restarted = True
                continue
            if all(rc == 0 for rc in codes.values()):
                break
            time.sleep(0.05)
        outs = {f"{g}.{r}": json.loads((tmp / f"out.{g}.{r}.json").read_text()) for g, r in procs}
        return {"outs": outs, "failed_at": failed_at, "restart_at": starts.get(1)}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        if lighthouse_proc is not None:
            os.killpg(lighthouse_proc.pid, signal.SIGKILL)
            lighthouse_proc.wait(timeout=10)
        elif cfg["mode"] == "ft" and lighthouse is not None:
            server.shutdown()


def overhead(args) -> dict:
    if not args.link:
        return _overhead(args, None)
    from layershard.testbed.links import matmul_flops, parse
    from layershard.testbed.netns import Testbed

    flops = args.cpu_flops * 1e9 if args.cpu_flops else matmul_flops()
    link = parse(args.link, flops)
    with Testbed(args.groups, link) as testbed:
        result = _overhead(args, testbed)
    result["link"] = {**link.as_dict(), "cpu_flops": flops}
    return result


def _overhead(args, testbed) -> dict:
    runs = []
    for rep in range(args.repeats):
        modes = ["hybrid", "ft"] + (["split"] if args.split else [])
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            cfg = dict(mode=mode, groups=args.groups, ranks=args.ranks, model=args.model,
                       vocab=args.vocab, seq=args.seq, batch=args.batch,
                       steps=args.steps + args.warmup, sync_quorum=args.sync_quorum)  # fmt: skip
            with tempfile.TemporaryDirectory() as tmp:
                res = launch(cfg, Path(tmp), args.timeout, testbed)
            log = res["outs"]["0.0"]["log"][args.warmup :]
            row = {"mode": mode, "repeat": rep,
                   "median_step_s": statistics.median(x["step_s"] for x in log)}  # fmt: skip
            for part in ("quorum_s", "compute_s", "allreduce_s", "commit_step_s", "quorum_wait_s",
                         "issue_s", "all_reduce_s", "should_commit_s"):  # fmt: skip
                if part in log[0]:
                    row[part] = statistics.median(x[part] for x in log)
            runs.append(row)
            print(json.dumps(row), flush=True)
    med = {m: statistics.median(r["median_step_s"] for r in runs if r["mode"] == m)
           for m in {r["mode"] for r in runs}}  # fmt: skip
    pairs = [
        f["median_step_s"] / h["median_step_s"]
        for h, f in zip(
            [r for r in runs if r["mode"] == "hybrid"], [r for r in runs if r["mode"] == "ft"]
        )
    ]
    return {"runs": runs, "median_step_s": med, "ft_over_hybrid": med["ft"] / med["hybrid"],
            "per_repeat_ratio": pairs}  # fmt: skip


def failure(args) -> dict:
    runs = []
    for rep in range(args.repeats):
        for hb in args.heartbeat_ms:
            cfg = dict(mode="ft", groups=args.groups, ranks=args.ranks, model=args.model,
                       vocab=args.vocab, seq=args.seq, batch=args.batch, steps=args.steps,
                       kill_step=args.kill_step, heartbeat_timeout_ms=hb)  # fmt: skip
            with tempfile.TemporaryDirectory() as tmp:
                res = launch(cfg, Path(tmp), args.timeout)
            log = res["outs"]["0.0"]["log"]
            ok = [x for x in log if x["committed"]]
            normal = statistics.median(x["step_s"] for x in log[1 : args.kill_step])
            before = max(x["wall"] for x in ok if x["step"] <= args.kill_step)
            after = min(x["wall"] for x in ok if x["step"] > args.kill_step)
            back = res["outs"][f"1.{args.ranks - 1}"]["report"]["events"]
            rec = [e for e in back if e["kind"] == "recovered"]
            rejoin_log = res["outs"]["1.0"]["log"]
            row = {
                "heartbeat_timeout_ms": hb, "repeat": rep, "median_step_s": normal,
                "steps_thrown_away": sum(not x["committed"] for x in log),
                "time_lost_s": after - before - normal,
                "failed_step_to_next_commit_s": after - before,
                "restart_to_first_step_s": rejoin_log[0]["wall"] - res["restart_at"],
                "recovery_load_s": rec[0]["seconds"] if rec else None,
                "steps_alone": sum(x["participants"] == 1 for x in ok),
            }  # fmt: skip
            runs.append(row)
            print(json.dumps(row), flush=True)
    return {"runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["overhead", "failure"], default="overhead")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2, help="ranks per group (hybrid's shard_size)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=5)
    p.add_argument("--heartbeat-ms", type=int, nargs="+", default=[5000, 1000])
    p.add_argument(
        "--sync-quorum",
        action="store_true",
        help="use_async_quorum=False: the quorum before the forward, not beside it",
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="also time the groups alone: each its own world, nothing across groups",
    )
    p.add_argument(
        "--link",
        help="overhead mode over the testbed (root): one node per group, joined by this link "
        "(a preset such as h100-ib400, or RATE[,DELAY]; layershard bench --help)",
    )
    p.add_argument("--cpu-flops", type=float, help="GFLOP/s to scale a preset by (measured)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    result = overhead(args) if args.mode == "overhead" else failure(args)
    result["args"] = {k: v for k, v in vars(args).items() if k != "worker"}
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["load_at_end"] = os.getloadavg()
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
