"""``python -m layershard.train.agent RUN_DIR TORCHRUN_ARGS...``: torchrun itself.

It runs torchrun's own ``torch.distributed.run.run()`` (the elastic agent: rendezvous, worker
processes, ``--max-restarts``, signal forwarding), with one addition: when ranks fail, what
torchrun knows about them (exit code, signal, pid) is written to ``RUN_DIR/.layershard/
failures.json``, so that ``layershard train`` can say which rank died and how, instead of
leaving the user a peer's "connection reset".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from layershard.train import status as st


def _launch_id(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "launch.json").read_text()).get("launch_id")
    except (OSError, ValueError):
        return None


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    run_dir, args = Path(argv[0]), argv[1:]
    try:
        run(parse_args(args))
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
            {"launch_id": _launch_id(run_dir), "failures": failures},
        )
        return 1
    except SignalException as e:  # torchrun itself was signalled; it has stopped the ranks
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
