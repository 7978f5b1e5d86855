"""``python -m layershard.train.launch.agent RUN_DIR TORCHRUN_ARGS...``: torchrun itself.

It runs torchrun's own ``torch.distributed.run.run()`` (the elastic agent: rendezvous, worker
processes, ``--max-restarts``, signal forwarding), with four additions:

- when ranks fail, what torchrun knows about them (exit code, signal, pid) is written to
  ``RUN_DIR/.layershard/failures.json``, so that ``layershard train`` can say which rank died and
  how, instead of leaving the user a peer's "connection reset";
- it dies with ``layershard train`` (and its ranks with it), even when that is SIGKILLed;
- with a dynamic rendezvous (c10d, etcd), the ranks learn which round of the rendezvous they
  start in, a number every node agrees on (``LAYERSHARD_RDZV_ROUND``, see ``Rounds``);
- on many nodes, the nodes compare their settings at every rendezvous and refuse to start
  when they differ, and a rendezvous that fails is one line (``rendezvous.py``, ``Agreed``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from layershard.train import status as st
from layershard.train.launch import rendezvous as rdzv
from layershard.train.loop.faults import ROUND_ENV, die_with_parent


class Wrapped(RendezvousHandler):
    """A rendezvous handler that passes every call to the one it wraps; the handlers below
    change ``next_rendezvous`` only."""

    def __init__(self, inner: RendezvousHandler) -> None:
        self._inner = inner

    def next_rendezvous(self) -> RendezvousInfo:
        return self._inner.next_rendezvous()

    def get_backend(self) -> str:
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


class Rounds(Wrapped):
    """The user's rendezvous handler (c10d, etcd, ...), unchanged, plus the number of the round
    the ranks start in (1, 2, ... in this launch), the same on every node. Agents start their
    ranks with their own environment, so ``next_rendezvous`` exports it there.

    Why: torchrun's ``TORCHELASTIC_RESTART_COUNT`` is per agent. It counts that agent's failed
    attempts, not membership changes (a node leaving or joining restarts the workers without
    counting), so after a node dies and comes back the survivor says 1 and the newcomer 0. Ranks
    that key torchrun's store by it never meet: gloo's connect waits for the peers' addresses
    under their own key, for the full store timeout (``DistStoreError: wait timeout``, 300 s),
    on every attempt. The round, counted in the rendezvous store that all nodes share, agrees."""

    KEY = "layershard/round"

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        store, boot = info.store, info.bootstrap_store_info
        addr, port = RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY
        if info.rank == 0:
            assert boot is not None, "torch's rendezvous gives rank 0 the ranks' store"
            # One node counts the rounds; the round's own (prefixed) store carries the number.
            shared = getattr(store, "underlying_store", store)
            store.set(self.KEY, str(shared.add("layershard/rounds", 1)))
            # Where the ranks' store is, published again every round. torch 2.13's c10d
            # handler publishes it only in the round where its node first became rank 0: a
            # node that joins later waits for it in vain (DistStoreError after 60 s, in both
            # agents), and a node that was not rank 0 keeps the address of a store that may
            # have died with the node that hosted it.
            store.set(addr, boot.master_addr)
            store.set(port, str(boot.master_port))
        else:
            boot = RendezvousStoreInfo(store.get(addr).decode(), int(store.get(port).decode()))
        os.environ[ROUND_ENV] = store.get(self.KEY).decode()
        return RendezvousInfo(store, info.rank, info.world_size, boot)


class Agreed(Wrapped):
    """The rendezvous handler torchrun made (wrapped in ``Rounds`` for a dynamic backend), plus
    ``rendezvous.agree`` (the nodes compare their settings) at each round, and one line instead
    of torch's output when the rendezvous fails (``rendezvous.said``)."""

    def __init__(
        self, inner: RendezvousHandler, params: RendezvousParameters, run_dir: Path
    ) -> None:
        super().__init__(inner)
        self._static, self._run_dir = params.backend == "static", run_dir
        self._endpoint, self._limits = params.endpoint, rdzv.timeouts(params)
        self._rounds = 0

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            with rdzv.said(self._endpoint, self._limits):
                info = self._inner.next_rendezvous()
                # A static job's store is the same in every round, and no node joins it later.
                if not (self._static and self._rounds):
                    rdzv.agree(info.store, info.rank, info.world_size, self._run_dir)
        except rdzv.Refused as e:
            e.first_round = not self._rounds  # later: this node's ranks trained before
            raise
        self._rounds += 1
        return info


def wrap_rendezvous(args: Any, run_dir: Path) -> None:
    """Every rendezvous handler torchrun makes for this agent goes through ``Agreed`` and,
    for a dynamic backend (c10d, etcd), ``Rounds``. One node (``--standalone``) has nobody
    to agree with."""
    import torch.distributed.elastic.rendezvous.registry as registry

    if args.standalone:
        return
    make = registry.get_rendezvous_handler

    def get(params: RendezvousParameters) -> RendezvousHandler:
        with rdzv.said(params.endpoint, rdzv.timeouts(params)):  # c10d connects here
            handler = make(params)
        if params.backend != "static":  # one agent, or no membership changes
            handler = Rounds(handler)
        return Agreed(handler, params, run_dir)

    registry.get_rendezvous_handler = get


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    run_dir, args = Path(argv[0]), parse_args(argv[1:])
    # Die with `layershard train`, even when it is SIGKILLed: SIGTERM makes torchrun stop the
    # ranks as on a scheduler's SIGTERM (they agree on a step, checkpoint and exit). The ranks
    # die with this agent (rank.py), which torchrun's Popen makes their parent.
    launcher = os.environ.get("LAYERSHARD_LAUNCHER_PID")
    if launcher:
        die_with_parent(signal.SIGTERM, int(launcher))
    os.environ["LAYERSHARD_AGENT_PID"] = str(os.getpid())
    wrap_rendezvous(args, run_dir)
    try:
        run(args)
    except ChildFailedError as e:
        failures = {
            str(rank): {
                "local_rank": f.local_rank,
                "pid": f.pid,
                "exitcode": f.exitcode,
                "signal": f.signal_name() if f.exitcode < 0 else None,
                "message": f.message if isinstance(f.message, str) else json.dumps(f.message),
            }
            for rank, f in e.failures.items()
        }
        st.write_json(
            st.state_dir(run_dir) / st.FAILURES,
            {"launch_id": rdzv.launch_seen(run_dir), "failures": failures},
        )
        return 1
    except SignalException as e:  # torchrun itself was signalled; it has stopped the ranks
        return 128 + int(e.sigval)
    except rdzv.Refused as e:  # no rank started: `layershard train` says why, in one line
        rdzv.report(e)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
