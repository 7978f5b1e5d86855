"""The checkpoint API's collective entry points raise one rank's error on every rank at once
(issue 51; tests/hf/test_hf_agreement.py for ``ls.hf``): a step that fails on one rank alone
used to leave the others in the next collective until the process-group timeout (short here:
a rank left waiting fails with a timeout error, not the expected one). Each check makes one rank
fail, expects the same error type and message on both, then shows the ranks are still in step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import RankChecks, shared_tmp
from test_hf_agreement import TIMEOUT_S, file_at, raised_everywhere

import layershard as ls
from layershard import full_state
from layershard.checkpoint import CheckpointError
from layershard.models import LlamaConfig, LlamaForCausalLM

TINY = dict(vocab_size=16, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=8)


@pytest.fixture(autouse=True, scope="module")
def _short_timeout():
    mp = pytest.MonkeyPatch()
    mp.setenv("LAYERSHARD_TEST_TIMEOUT_S", str(TIMEOUT_S))  # read by the ranks this module spawns
    yield
    mp.undo()


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return ls.shard(LlamaForCausalLM(LlamaConfig(**TINY)))


checks = RankChecks(world_size=2)


@checks.check
def save_checkpoint_with_extra_one_rank_cannot_write(rank: int, world: int) -> None:
    """``extra`` is often per rank (a data loader's position): one rank's that is not JSON."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    extra = {"position": torch.tensor(3) if rank == 1 else 3}
    raised_everywhere(
        lambda: ls.save_checkpoint(shared_tmp("ck") / "step_1", model, opt, extra=extra),
        TypeError,
        r"save_checkpoint\(extra=...\) must be JSON-serializable",
    )
    ls.save_checkpoint(shared_tmp("ck") / "step_1", model, opt, extra={"position": 3})
    assert ls.load_checkpoint(shared_tmp("ck"), _model(1))["extra"] == {"position": 3}


@checks.check
def full_state_dict_failing_on_the_rank_that_keeps_it(rank: int, world: int) -> None:
    """Rank 0 keeps every tensor of the whole model: it runs out of memory alone."""
    model = _model()
    real = full_state.keep_copy

    def keep(t, cpu):
        if rank == 0:
            raise RuntimeError("injected: out of memory copying the full state")
        return real(t, cpu)

    full_state.keep_copy = keep
    try:
        raised_everywhere(model.full_state_dict, RuntimeError, "injected: out of memory")
    finally:
        full_state.keep_copy = real
    sd = model.full_state_dict()
    assert (len(sd) > 0) == (rank == 0)


@checks.check
def load_full_state_dict_of_something_else_than_tensors(rank: int, world: int) -> None:
    """Rank 0 passes the dict (the others None) with a numpy array in it: its shape matched and
    rank 0 alone failed copying it, while rank 1 waited in the broadcast."""
    model = _model()
    sd = model.full_state_dict()
    if rank == 0:
        sd["norm.weight"] = np.ones(tuple(sd["norm.weight"].shape), dtype=np.float32)
    msg = raised_everywhere(
        lambda: model.load_full_state_dict(sd if rank == 0 else None), ValueError, "norm.weight"
    )
    assert msg == (
        "load_full_state_dict(): norm.weight is a numpy.ndarray, not a torch.Tensor; pass "
        "tensors (torch.from_numpy(...))"
    )
    if rank == 0:
        sd["norm.weight"] = torch.from_numpy(sd["norm.weight"])
    model.load_full_state_dict(sd if rank == 0 else None)


@checks.check
def paths_one_rank_writes_or_reads(rank: int, world: int) -> None:
    """Kept as they were: export_hf into a file (rank 0 writes), load_hf from a folder rank 1
    cannot see, load_checkpoint from a folder rank 0 reads alone."""
    model = _model()
    taken = file_at("taken")
    raised_everywhere(lambda: ls.export_hf(model, taken), CheckpointError, "is not a folder")
    ls.export_hf(model, shared_tmp("hf"), dtype=torch.float32)
    hidden = shared_tmp("hf") if rank == 0 else shared_tmp() / "not-here"
    raised_everywhere(lambda: ls.load_hf(model, hidden), CheckpointError, "no \\*.safetensors")
    ls.load_hf(model, shared_tmp("hf"))
    raised_everywhere(
        lambda: ls.load_checkpoint(shared_tmp() / "nothing", model), CheckpointError, "nothing"
    )
    dist.barrier()


checks.collect(globals())
