"""One rank of ``layershard train``, started by torchrun (``python -m layershard.train.loop.rank RUN_DIR``):
its process group, its stop requests and watchdog, the ``Trainer``, and how it ends: the exit
code, the status record, a peer that went away, leaving together.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from layershard.checkpoint import CheckpointError
from layershard.engine.waits import waiting
from layershard.train import status as st
from layershard.train.config import ConfigError
from layershard.train.loop.faults import StopRequest, Watchdog, attempt, connect_store
from layershard.train.loop.trainer import StopRun, Trainer

# Text of collective errors that mean "another rank is gone", not "this rank went wrong".
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket closed",
    "NCCL communicator was aborted",
)


def _peer_lost(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return any(m in text for m in _PEER_LOST)


def _stall_report_s() -> float:
    """Seconds without progress before a rank says where it waits: a fifth of the process-group
    timeout, at most a minute (LAYERSHARD_STALL_REPORT_S overrides)."""
    if os.environ.get("LAYERSHARD_STALL_REPORT_S"):
        return float(os.environ["LAYERSHARD_STALL_REPORT_S"])
    from layershard.distributed import default_timeout

    return min(60.0, default_timeout().total_seconds() / 5)


def _init_process_group() -> tuple[int, int]:
    """``ls.init_distributed()``, except that under torchrun every attempt (a restart, or a new
    round of an elastic job: ``faults.attempt``, the same on every node) gets store keys of its
    own. torchrun's agent keeps one store for all attempts, and torch 2.13 adds no per-attempt
    prefix for the workers, so a restarted gloo rank can read the previous attempt's addresses: in 4 runs of a 2-rank restart, 2 hung or failed with "Connection refused" in
    connectFullMesh; with the prefix, 6 of 6 connected."""
    from layershard.distributed import default_backend, default_timeout, init_distributed

    under_torchrun = "TORCHELASTIC_RESTART_COUNT" in os.environ
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if under_torchrun and agent_store and not dist.is_initialized():
        backend = default_backend()
        if backend == "nccl":  # what init_distributed does before it creates the group
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=default_timeout(),
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"layershard/attempt_{attempt()}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=default_timeout(),
        )
    return init_distributed()


def main(run_dir: str) -> int:
    """One rank's whole life. Returns its exit code: 0 also when the ranks agreed to stop early
    (a signal, non-finite steps: torchrun must not restart them; ``stop.json`` says why), 2 for
    a problem the user can fix, 1 for a failure."""
    from layershard.distributed import default_device

    rank, world = _init_process_group()
    device = default_device()
    np.seterr(all="ignore")
    path = Path(run_dir)
    launch = json.loads((path / "launch.json").read_text())
    launch_id = launch.get("launch_id")
    store = connect_store() if world > 1 else None
    stop = StopRequest(store, announce=rank == 0)
    stop.install()  # before the status file exists: `layershard train` signals the ranks it lists
    status = st.RankStatus(path, rank, launch_id, attempt())
    trainer: Trainer | None = None
    watchdog = None
    code, error, peer_lost, agreed = 1, None, False, False
    try:
        if launch.get("ft"):  # --ft-replicas: one replica group of several (torchft)
            from layershard.train.loop.fault_tolerance import FTTrainer

            trainer = FTTrainer(path, rank, world, device, stop=stop, status=status)
        else:
            trainer = Trainer(path, rank, world, device, stop=stop, status=status)
        if world > 1:
            wd_store = connect_store()  # the watchdog thread's own client
            assert wd_store is not None  # world > 1: the launcher set MASTER_ADDR/MASTER_PORT
            watchdog = Watchdog(
                wd_store,
                rank,
                world,
                _stall_report_s(),
                lambda: (trainer.step, _collectives(trainer.model)),
            )
            watchdog.start()
        code = trainer.run()
        trainer.wait_for_checkpoint()
        agreed = True
    except StopRun as e:
        code, agreed = 0, True
        if trainer is not None:
            trainer.wait_for_checkpoint()
        if rank == 0:  # `layershard train` reads it and says why, with the exit code that fits
            st.write_json(
                st.state_dir(path) / st.STOP,
                {
                    "launch_id": launch_id,
                    "attempt": attempt(),
                    "reason": e.reason,
                    "message": str(e),
                    **e.info,
                },
            )
    except (ConfigError, CheckpointError) as e:
        code, error = 2, str(e)
        if rank == 0 and not os.environ.get("LAYERSHARD_TRAIN_CLI"):  # else the CLI says it
            print(f"layershard train: error: {e}", file=sys.stderr, flush=True)
    except Exception as e:
        if _peer_lost(e):  # the rank that went away is the story; this one only noticed
            code, peer_lost, error = 1, True, f"{type(e).__name__}: {e}"
            step = trainer.step + 1 if trainer is not None else None
            print(
                f"layershard train: rank {rank}: lost another rank during step {step} "
                f"({str(e).splitlines()[0][:200]})",
                file=sys.stderr,
                flush=True,
            )
        else:
            code, error = 1, f"{type(e).__name__}: {e}"
            traceback.print_exc()
    finally:
        status.exit(code, error, peer_lost)
        stop.uninstall()
        if watchdog is not None:
            watchdog.stop()
        if dist.is_initialized() and (code == 0 or agreed):
            # Leave together: a rank that tears its group down while a peer still works (rank 0
            # writing the plot) can abort inside gloo and take the whole job down with it. After
            # a failure there is nobody to wait for: torchrun stops the others.
            with contextlib.suppress(Exception), waiting("the final barrier"):
                dist.barrier()
            dist.destroy_process_group()
    return code


def _collectives(model) -> int:
    # A progress counter for the watchdog thread (engine collectives issued so far).
    return sum(v["count"] for v in model.comm_stats().values())


if __name__ == "__main__":
    # A rank outlives neither its agent nor, through it, `layershard train` (agent.py).
    if os.environ.get("LAYERSHARD_AGENT_PID"):
        import signal

        from layershard.train.loop.faults import die_with_parent

        die_with_parent(signal.SIGKILL, int(os.environ["LAYERSHARD_AGENT_PID"]))
    # Run the module's own main (not this __main__ copy of it), so that there is one Trainer.
    from layershard.train.loop import rank as _rank

    code = _rank.main(sys.argv[1])
    # Everything is written and the process group is gone: skip the interpreter's teardown, in
    # which gloo's static destructors have aborted a finished rank ("terminate called without an
    # active exception") and so failed a run that had succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))
