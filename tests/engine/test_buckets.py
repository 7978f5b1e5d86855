"""Several blocks per unit (``blocks_per_unit=K``, ``layers=[[b0, b1], ...]``): one all-gather
and one reduce-scatter for K blocks instead of K, and the same training.

"The same" is bit for bit, not within a tolerance: a unit of K blocks is the K blocks' flat
groups laid end to end, gathered and reduced as one. (Not with int8 gathers, whose scales are per
256 elements of a rank's slice: the slices' bounds move, and so does the rounding; not tested
here.) Every element is summed over the ranks in
the same order (gloo's exchange, then the rows summed in rank order), AdamW steps each element
alone, and the blocks compute on the same weights; only the elements' places in the padded flat
and the shard boundaries move. So any difference at all is a bug (a block computing on another
block's weights, a gradient reduced twice or lost), and the per-block runs it is compared with
are held to the single-process reference elsewhere (test_parity.py, test_features.py,
test_strategies.py). A gradient-norm clip would sum the slices' squares in other groupings:
not bitwise, so not used here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import RankChecks, shared_tmp
from _parity import LR, TINY, batches, lm_loss, local, tiny_hf_llama, tiny_llama

import layershard as ls
from layershard.models import LlamaConfig, LlamaForCausalLM

checks = RankChecks(world_size=2)
more = RankChecks(world_size=2, slow=True)  # the integrations: outside the fast tier
STEPS = 4


def _train(model, rank: int, world: int, steps: int = STEPS, micro: int = 1):
    """(losses, full state dict) after ``steps`` AdamW steps; ``micro`` > 1: gradients
    accumulated over that many micro-batches, the first ones under no_sync."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x in batches(steps):
        parts = local(x, rank, world).chunk(micro)
        for i, part in enumerate(parts):
            sync = model.no_sync() if i < len(parts) - 1 else _Null()
            with sync:
                loss = lm_loss(model, part) / micro
                loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, model.full_state_dict()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _same(a, b, what: str) -> None:
    losses_a, sd_a = a
    losses_b, sd_b = b
    assert losses_a == losses_b, (what, losses_a, losses_b)
    assert list(sd_a) == list(sd_b), what
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), (what, k, (sd_a[k] - sd_b[k]).abs().max().item())


def _frozen_mlp(m):
    m.layers[1].mlp.requires_grad_(False)  # a unit with trainable and frozen flat groups
    return m


_FP8_BF16R = ls.MixedPrecision(torch.float32, torch.bfloat16, torch.float8_e4m3fn)

# (name, model maker, shard() keywords, micro-batches) each trained with and without grouping
CASES = [
    ("full", lambda: tiny_llama(n_layers=4), {}, 1),
    ("grad_op", lambda: tiny_llama(n_layers=4), {"strategy": "grad_op"}, 1),
    ("checkpointed", lambda: tiny_llama(n_layers=4), {"activation_checkpointing": 3}, 1),
    ("no_sync", lambda: tiny_llama(n_layers=4), {}, 2),
    ("offload", lambda: tiny_llama(n_layers=4), {"offload": ls.CPUOffload()}, 1),
    ("tied_frozen", lambda: _frozen_mlp(tiny_llama(n_layers=4, tie_embeddings=True)), {}, 1),
    # fp8 gathers (a scale per parameter) and bf16 reductions (each element's fp32 sum rounded
    # once): per element too, so bitwise as well
    ("fp8_bf16r", lambda: tiny_llama(n_layers=4), {"mixed_precision": _FP8_BF16R}, 1),
]


@checks.check
def _bitwise_as_one_unit_per_block(rank: int, world: int) -> None:
    """blocks_per_unit 2, 3 (an odd last unit) and 4 train bit for bit as a unit per block:
    full, grad_op, activation checkpointing across a unit's blocks, no_sync accumulation, CPU
    offload, tied embeddings with a partly frozen unit, fp8 gathers with bf16 reductions."""
    for name, make, kw, micro in CASES:
        per_block = _train(ls.shard(make(), **kw), rank, world, micro=micro)
        for k in (2, 3, 4) if name == "full" else (2,):
            grouped = ls.shard(make(), blocks_per_unit=k, **kw)
            n_units = -(-4 // k)
            assert sum(u.is_block for u in grouped.units) == n_units, (name, k)
            _same(per_block, _train(grouped, rank, world, micro=micro), f"{name}, K={k}")


@checks.check
def _one_collective_per_unit(rank: int, world: int) -> None:
    """A unit of K blocks is one all-gather in forward, one in backward and one reduce-scatter:
    with 4 blocks as 2 units, 2 of each fewer per step than with 4."""
    counts = {}
    for k in (1, 2):
        model = ls.shard(tiny_llama(n_layers=4), blocks_per_unit=k)
        x = local(batches(1)[0], rank, world)
        lm_loss(model, x).backward()  # the first step learns the order: not counted
        model.comm_stats(reset=True)
        lm_loss(model, x).backward()
        counts[k] = model.comm_stats()
    one, two = counts[1], counts[2]
    for phase in ("forward", "backward"):
        assert one["all_gather"][phase] - two["all_gather"][phase] == 2, (phase, one, two)
    assert one["reduce_scatter"]["count"] - two["reduce_scatter"]["count"] == 2, (one, two)
    assert (
        one["all_gather"]["bytes"]
        <= two["all_gather"]["bytes"]
        <= (one["all_gather"]["bytes"] * 1.01)
    )  # the same weights; only the padding of fewer, larger flats differs


@more.check
def _explicit_groups_and_hf_checkpointing(rank: int, world: int) -> None:
    """``layers=[[...], ...]`` groups as given (names or modules); a transformers Llama with its
    own gradient checkpointing, whose recompute calls each block again inside the backward,
    trains bit for bit grouped or not; reentrant checkpointing (a backward of its own per block,
    which one unit's gradients cannot span) is refused, saying what works."""
    make = lambda: tiny_llama(n_layers=4)  # noqa: E731
    per_block = _train(ls.shard(make()), rank, world)
    m = make()
    grouped = ls.shard(m, layers=[["layers.0", "layers.1", "layers.2"], [m.layers[3]]])
    assert [u.name for u in grouped.units if u.is_block] == [
        "layers.0+layers.1+layers.2",
        "layers.3",
    ]
    _same(per_block, _train(grouped, rank, world), "explicit groups")

    def hf(reentrant: bool = False):
        model = tiny_hf_llama(num_hidden_layers=4, max_position_embeddings=16)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
        model.train()
        return model

    _same(
        _train(ls.shard(hf()), rank, world),
        _train(ls.shard(hf(), blocks_per_unit=2), rank, world),
        "transformers, HF checkpointing",
    )
    model = ls.shard(hf(reentrant=True), blocks_per_unit=2)
    x = local(batches(1)[0], rank, world)
    with pytest.raises(RuntimeError, match=r"reentrant activation checkpoint.*use_reentrant"):
        lm_loss(model, x)
    ls.shard(hf(reentrant=True), blocks_per_unit=1)(x, labels=x).loss.backward()  # one per unit


@more.check
def _meta_init_and_checkpoints_across_groupings(rank: int, world: int) -> None:
    """Deferred (meta-device) init of a grouped model equals eager init bit for bit, and a
    checkpoint saved with one grouping loads into another (it is per parameter)."""
    eager = ls.shard(tiny_llama(seed=3, n_layers=4))
    torch.manual_seed(3)
    with torch.device("meta"):
        meta_model = LlamaForCausalLM(LlamaConfig(**{**TINY, "n_layers": 4}))
    lazy = ls.shard(meta_model, device="cpu", blocks_per_unit=2)
    a, b = eager.full_state_dict(), lazy.full_state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)

    path = shared_tmp("buckets") / "ckpt"
    grouped = ls.shard(tiny_llama(n_layers=4), blocks_per_unit=2)
    _train(grouped, rank, world, steps=2)
    ls.save_checkpoint(path, grouped)
    per_block = ls.shard(tiny_llama(seed=7, n_layers=4))
    ls.load_checkpoint(path, per_block)
    a, b = grouped.full_state_dict(), per_block.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    dist.barrier()


@more.check
def _with_tensor_expert_and_context_parallelism(rank: int, world: int) -> None:
    """Grouped under ``ls.parallelize``: tp=2 (DTensor shards in the flat groups), ep=2 (each
    unit's experts a flat group over the expert group) and cp=2 (each sequence split over both
    ranks) train bit for bit as with a unit per block."""
    from test_moe import tiny_moe

    from layershard.parallel.context import context_batch

    def cp_loss(model, x):
        return model(**context_batch(model, x, x)).loss

    for kw, make, parts, loss in (
        ({"tp": 2}, lambda: tiny_llama(n_layers=4), 1, lm_loss),
        ({"ep": 2}, tiny_moe, 2, lm_loss),
        ({"cp": 2}, lambda: tiny_llama(n_layers=4), 1, cp_loss),
    ):
        runs = []
        for k in (1, 2):
            model = ls.parallelize(make(), blocks_per_unit=k, **kw)
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            losses = []
            for x in batches(3):
                step_loss = loss(model, local(x, rank % parts, parts))
                step_loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(step_loss.item())
            runs.append((losses, model.full_state_dict()))
        _same(runs[0], runs[1], str(kw))


class _Skip(torch.nn.Module):
    """Runs its blocks in the order given, not their registration order (under no_grad with
    ``frozen``)."""

    def __init__(self, order: list[int], frozen: bool = False):
        super().__init__()
        self.order, self.frozen = order, frozen
        self.embed = torch.nn.Embedding(8, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        h = self.embed(x)
        with torch.no_grad() if self.frozen else _Null():
            for i in self.order:
                h = self.layers[i](h)
        return h.sum()


@checks.check
def _refused_groupings(rank: int, world: int) -> None:
    """What cannot be one unit is refused, saying what to do: blocks that do not run one after
    another (another unit between them, out of order, one skipped), a block called on its own,
    a unit's blocks under no_grad in a forward with grad (a reentrant checkpoint's way), a
    module in two groups, groups and blocks_per_unit together, K < 1. ModuleList slices are
    groups."""
    torch.manual_seed(0)
    x = torch.arange(4)
    model = ls.shard(_Skip([0, 1, 2]), layers=[["layers.0", "layers.2"], "layers.1"])
    with pytest.raises(
        RuntimeError, match=r"unit layers\.1 ran before block 1 of unit layers\.0\+"
    ):
        model(x)
    model = ls.shard(_Skip([1, 0, 2]), layers=[["layers.0", "layers.1"], "layers.2"])
    with pytest.raises(RuntimeError, match=r"must run one after another.*its block 1 ran outside"):
        model(x)
    model = ls.shard(_Skip([0, 1]), layers=["layers.0", ["layers.1", "layers.2"]])
    with pytest.raises(RuntimeError, match=r"its block 1 did not run in this forward"):
        model(x)
    inner = _Skip([0, 1, 2])
    model = ls.shard(inner, layers=[inner.layers[:2], inner.layers[2:]])
    assert [u.name for u in model.units if u.is_block] == ["layers.0+layers.1", "layers.2"]
    model(x).backward()  # the slices as groups train
    with pytest.raises(RuntimeError, match=r"run only inside the model's forward"):
        inner.layers[0](torch.ones(2, 4))
    model = ls.shard(_Skip([0, 1, 2], frozen=True), blocks_per_unit=2)
    with pytest.raises(RuntimeError, match=r"reentrant activation checkpoint.*no_grad region"):
        model(x)
    with pytest.raises(ValueError, match=r"'layers\.0' is given twice"):
        ls.shard(_Skip([0]), layers=[["layers.0", "layers.1"], "layers.0"])
    with pytest.raises(ValueError, match=r"blocks_per_unit= or groups of blocks in layers=, not"):
        ls.shard(_Skip([0]), layers=[["layers.0", "layers.1"], "layers.2"], blocks_per_unit=2)
    with pytest.raises(ValueError, match=r"blocks_per_unit must be at least 1, got 0"):
        ls.shard(_Skip([0]), blocks_per_unit=0)
    dist.barrier()


checks.collect(globals())
more.collect(globals())
