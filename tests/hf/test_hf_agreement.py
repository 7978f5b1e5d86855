"""Every collective entry point of ``ls.hf`` raises one rank's error on every rank at once
(issue 51): a step that fails on one rank alone (rank 0's write into a path that is a file, a
folder one rank cannot read) used to leave the others waiting in the next barrier or gather
until the process-group timeout. Each check makes one rank fail, expects the same error type and
message on both, then shows the ranks are still in step (the same call succeeds). The ranks'
process-group timeout is short here (``TIMEOUT_S``): a rank left waiting fails with a timeout
error, not the expected one. Also: an 8-bit bitsandbytes base is refused by ``ls.shard`` (it was
sharded, then its first forward raised ``AttributeError: ... 'CB'``)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("peft")

from _dist import RankChecks, shared_tmp  # noqa: E402

import layershard as ls  # noqa: E402

TIMEOUT_S = 20  # every collective of these ranks; the agreement answers in well under a second


@pytest.fixture(autouse=True, scope="module")
def _short_timeout():
    mp = pytest.MonkeyPatch()
    mp.setenv("LAYERSHARD_TEST_TIMEOUT_S", str(TIMEOUT_S))  # read by the ranks this module spawns
    yield
    mp.undo()


def peft_model(seed: int = 0):
    """A tiny transformers Llama with LoRA adapters (no download, no quantization)."""
    import peft
    import transformers as T

    torch.manual_seed(seed)
    cfg = T.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(T.LlamaForCausalLM(cfg), lora)


def raised_everywhere(call, error: type, match: str) -> str:
    """``call()`` raises ``error`` matching ``match`` on this rank, with the message every other
    rank sees (the failing rank's, which the others name: "(on rank R)"). Returns it."""
    t0 = time.monotonic()
    with pytest.raises(error, match=match) as caught:
        call()
    elapsed = time.monotonic() - t0
    print(
        f"rank {dist.get_rank()}: {type(caught.value).__name__} after {elapsed:.2f} s",
        file=sys.stderr,
    )
    message = re.sub(r" \(on rank \d+\)$", "", str(caught.value))
    assert "\n" not in message, message
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (type(caught.value).__name__, message))
    assert all(s == seen[0] for s in seen), seen
    return message


def file_at(name: str) -> Path:
    """A path that is an existing file (on a file system every rank sees)."""
    path = shared_tmp() / name
    if dist.get_rank() == 0:
        path.write_text("not a folder")
    dist.barrier()
    return path


checks = RankChecks(world_size=2)


@checks.check
def save_adapter_into_a_file_fails_on_every_rank(rank: int, world: int) -> None:
    model = ls.shard(peft_model())
    taken = file_at("taken")
    msg = raised_everywhere(
        lambda: ls.hf.save_adapter(model, taken), ValueError, "exists and is not a folder"
    )
    assert msg == f"ls.hf.save_adapter: {taken} exists and is not a folder; choose another folder"
    ls.hf.save_adapter(model, shared_tmp("adapter"))  # the ranks are still in step
    assert (shared_tmp("adapter") / "adapter_model.safetensors").is_file()


@checks.check
def export_merged_into_a_file_fails_on_every_rank(rank: int, world: int) -> None:
    model = ls.shard(peft_model())
    taken = file_at("taken")
    msg = raised_everywhere(
        lambda: ls.hf.export_merged(model, taken), ValueError, "exists and is not a folder"
    )
    assert msg == f"ls.hf.export_merged: {taken} exists and is not a folder; choose another folder"
    ls.hf.export_merged(model, shared_tmp("merged"))
    assert (shared_tmp("merged") / "config.json").is_file()


@checks.check
def export_merged_failing_on_rank_0_fails_on_every_rank(rank: int, world: int) -> None:
    """Rank 0 writes each unit as it is gathered: a failure there (a full disk) while the
    others gather the next unit."""
    from layershard.hf import qlora

    model = ls.shard(peft_model())
    real = qlora._merge_unit
    calls = []

    def merge(*args, **kwargs):
        calls.append(1)
        if rank == 0 and len(calls) == 2:
            raise OSError("injected: no space left on device")
        return real(*args, **kwargs)

    qlora._merge_unit = merge
    try:
        raised_everywhere(
            lambda: ls.hf.export_merged(model, shared_tmp("merged")), OSError, "injected: no space"
        )
    finally:
        qlora._merge_unit = real
    ls.hf.export_merged(model, shared_tmp("merged"))
    assert (shared_tmp("merged") / "model.safetensors.index.json").is_file()


def _accelerator():
    return ls.hf.Accelerator(cpu=True)


@checks.check
def accelerator_steps_failing_on_one_rank_fail_on_every_rank(rank: int, world: int) -> None:
    """``save_model`` (PEFT's ``save_pretrained`` raises on rank 0 for a file), ``save_state``
    (rank 0 alone saves registered objects) and ``load_state`` (a folder rank 1 cannot see)."""
    acc = _accelerator()
    model = acc.prepare(peft_model())
    opt = acc.prepare(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    taken = file_at("taken")
    raised_everywhere(
        lambda: acc.save_model(model, taken), ValueError, "should be a directory, not a file"
    )
    acc.save_model(model, shared_tmp("model"))

    class Refuses:  # accelerate saves registered objects on the main process only
        def state_dict(self):
            raise RuntimeError("injected: cannot save this object")

        def load_state_dict(self, state):
            pass

    acc.register_for_checkpointing(Refuses())
    raised_everywhere(
        lambda: acc.save_state(str(shared_tmp("state"))), RuntimeError, "injected: cannot save"
    )
    acc._custom_objects.clear()
    acc.save_state(str(shared_tmp("state")))
    hidden = str(shared_tmp("state")) if rank == 0 else str(shared_tmp() / "not-here")
    raised_everywhere(lambda: acc.load_state(hidden), Exception, "not-here")
    acc.load_state(str(shared_tmp("state")))
    assert opt is not None


@checks.check
def trainer_save_model_into_a_file_fails_on_every_rank(rank: int, world: int) -> None:
    import transformers as T

    args = T.TrainingArguments(output_dir=str(shared_tmp("out")), use_cpu=True, report_to=[])
    trainer = ls.hf.Trainer(model=peft_model(), args=args)
    trainer.model_wrapped = trainer.accelerator.prepare(trainer.model)  # as train() does
    taken = file_at("taken")
    raised_everywhere(lambda: trainer.save_model(str(taken)), FileExistsError, "File exists")
    trainer.save_model(str(shared_tmp("saved")))
    assert (shared_tmp("saved") / "adapter_model.safetensors").is_file()


def _trainer_with_scheduler():
    import transformers as T

    args = T.TrainingArguments(output_dir=str(shared_tmp("out")), use_cpu=True, report_to=[])
    trainer = ls.hf.Trainer(model=peft_model(), args=args)
    trainer.model_wrapped = trainer.accelerator.prepare(trainer.model)
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    trainer.optimizer = trainer.accelerator.prepare(trainer.optimizer)
    return trainer


@checks.check
def trainer_scheduler_save_failing_on_rank_0_fails_on_every_rank(rank: int, world: int) -> None:
    """Rank 0 alone writes the LR scheduler beside the sharded checkpoint."""
    trainer = _trainer_with_scheduler()
    real = trainer.lr_scheduler.state_dict

    def state_dict():
        if rank == 0:
            raise RuntimeError("injected: cannot write the scheduler")
        return real()

    trainer.lr_scheduler.state_dict = state_dict  # an instance attribute, deleted after
    folder = str(shared_tmp("checkpoint-1"))
    raised_everywhere(
        lambda: trainer._save_optimizer_and_scheduler(folder), RuntimeError, "injected"
    )
    del trainer.lr_scheduler.state_dict  # (LambdaLR saves its instance attributes)
    trainer._save_optimizer_and_scheduler(folder)
    trainer._load_optimizer_and_scheduler(folder)


@checks.check
def trainer_scheduler_load_failing_on_rank_1_fails_on_every_rank(rank: int, world: int) -> None:
    """Every rank reads the LR scheduler's file; rank 1 cannot parse its copy."""
    trainer = _trainer_with_scheduler()
    folder = str(shared_tmp("checkpoint-1"))
    trainer._save_optimizer_and_scheduler(folder)
    real = trainer.lr_scheduler.load_state_dict

    def load_state_dict(state):
        if rank == 1:
            raise RuntimeError("injected: corrupt scheduler file")
        return real(state)

    trainer.lr_scheduler.load_state_dict = load_state_dict
    raised_everywhere(
        lambda: trainer._load_optimizer_and_scheduler(folder), RuntimeError, "injected: corrupt"
    )
    del trainer.lr_scheduler.load_state_dict
    trainer._load_optimizer_and_scheduler(folder)


def _eight_bit_model() -> nn.Module:
    import bitsandbytes as bnb

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 16)
            self.layers = nn.ModuleList(
                bnb.nn.Linear8bitLt(16, 16, bias=False, has_fp16_weights=False) for _ in range(2)
            )
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            h = self.embed(x)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    torch.manual_seed(0)
    return Tiny().to("cpu")  # bitsandbytes quantizes to int8 on .to(device): load_in_8bit's state


@checks.check
def eight_bit_base_is_refused(rank: int, world: int) -> None:
    pytest.importorskip("bitsandbytes")
    model = _eight_bit_model()
    assert model.layers[0].weight.dtype == torch.int8
    x = torch.randint(0, 16, (2, 3))
    model(x)  # it computes unsharded
    msg = raised_everywhere(lambda: ls.shard(model), ValueError, "8-bit")
    assert msg == (
        "shard(): layers.0.weight is a bitsandbytes 8-bit weight (load_in_8bit, Linear8bitLt), "
        "which layershard cannot shard; load the base in 4 bits for QLoRA "
        "(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')) or in bf16/fp32"
    )


checks.collect(globals())
