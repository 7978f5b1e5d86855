"""The checks of ``TrainConfig``'s mapping values (config.py's ``_check`` calls them): the
``compile:`` options torch.compile takes, and the ``plan:`` record ``layershard plan
--write-config`` writes."""

from __future__ import annotations

from typing import Any

from layershard.validation import unknown_key

_COMPILE_KEYS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")


def check_compile(options: dict[str, Any]) -> None:
    """``compile: {...}``: torch.compile's own keywords (``_COMPILE_KEYS``, its signature less
    the model), and a backend torch knows, checked here rather than in every rank."""
    for key in options:
        if key not in _COMPILE_KEYS:
            raise ValueError(unknown_key(str(key), _COMPILE_KEYS, "compile").replace(
                "config key", "torch.compile option"))  # fmt: skip
    backend = options.get("backend")
    if backend is None or callable(backend):
        return
    if not isinstance(backend, str):
        raise ValueError(f"compile: backend must be the name of a backend, got {backend!r}")
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    try:
        lookup_backend(backend)
    except Exception:  # InvalidBackend, or a registered entry point that fails to import
        names = ", ".join(sorted({*list_backends(), "eager", "aot_eager"}))  # + the debug ones
        raise ValueError(
            f"compile: backend {backend!r} is not a torch.compile backend; use one of {names}"
        ) from None


# What `layershard plan --write-config` records under `plan:`, and the rule each number follows.
_PLAN_NUMBERS = {
    "step_s": (0.0, False),  # (lower bound, bound allowed)
    "peak_bytes": (0.0, False),
    "model_states_bytes": (0.0, False),
    "tokens_per_s_per_gpu": (0.0, False),
    "mfu": (0.0, True),
    "gpus": (1.0, True),
    "gpus_per_node": (1.0, True),
}


def check_plan(plan: dict[str, Any]) -> None:
    """The ``plan:`` record (what ``layershard plan --write-config`` predicted), read back: the
    run compares its measured step time and memory with it at the end."""
    for key, (low, inclusive) in _PLAN_NUMBERS.items():
        v = plan.get(key)
        if v is None:  # not predicted
            continue
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        ok = ok and (v >= low if inclusive else v > low)
        if not ok:
            rule = f"{'at least' if inclusive else 'greater than'} {low:g}"
            raise ValueError(
                f"plan: {key} must be a number {rule}, got {v!r} (the plan: block is what "
                "`layershard plan --write-config` predicted; write it again, or remove the block)"
            )
    if "gpu" in plan and not isinstance(plan["gpu"], str):
        raise ValueError(f"plan: gpu must be a GPU's name, got {plan['gpu']!r}")


def check_ft_launch(replicas: int | None, group: int | None, lighthouse: str | None) -> None:
    """``--ft-replicas N --ft-group G [--ft-lighthouse HOST:PORT]``: the flags that need no
    config (train/launch/ft.py checks the rest)."""
    if replicas is None:
        for flag, value in (("--ft-group", group), ("--ft-lighthouse", lighthouse)):
            if value is not None:
                raise ValueError(
                    f"{flag} goes with --ft-replicas N (fault-tolerant replica groups)"
                )
        return
    if group is None:
        raise ValueError(
            f"--ft-replicas {replicas} needs --ft-group G: this launcher's replica group, "
            f"0..{replicas - 1} (one launch per group)"
        )
    if group >= replicas:
        raise ValueError(
            f"--ft-group {group} must be below --ft-replicas {replicas}: number the groups "
            f"0..{replicas - 1}"
        )
    if lighthouse is not None:
        host, sep, port = lighthouse.removeprefix("http://").rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(
                f"--ft-lighthouse {lighthouse!r}: expected HOST:PORT (torchft_lighthouse's "
                "address, e.g. node0:29510)"
            )
