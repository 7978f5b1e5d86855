"""`layershard plan` given bad or unusual input (issue 51, hardening round 4): 8-bit gathers in
the search, QLoRA's JSON and train config, only the TP sizes `layershard train` accepts, and every
malformed option refused in one line (exit 2) that names the option and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from layershard.cli import main
from layershard.plan import ModelShape
from layershard.plan.qlora import QLoRASettings, qlora_memory, usable

GIB = 2**30

# A transformers Llama of 8 heads over 2 KV heads (train splits it 2 ways at most: each TP rank
# must hold whole KV heads) whose fp32 logits (65536 x 8192 tokens, 2 GiB) make TP the way to fit.
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "intermediate_size": 2816, "vocab_size": 65536, "max_position_embeddings": 8192}  # fmt: skip


def refused(capsys, *argv: str) -> str:
    """`layershard plan ARGV` exits 2 with one line, `layershard plan: error: ...`; its text."""
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("layershard plan: error: "), err
    return err.removeprefix("layershard plan: error: ")


def model_folder(tmp_path: Path, weights: bool = False, **fields) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA | fields))
    if weights:  # train's checks look for safetensors next to the config (it never reads them)
        (folder / "model.safetensors").write_bytes(b"")
    return folder


def train_checks(path: Path, world: int, local: int) -> None:
    """`layershard train --config PATH`'s checks, as its launcher makes them before it reads any
    data (train/launch/preflight.py ``prepare``): the schema, the world, the model. Raises
    ``ConfigError`` with train's one line."""
    from layershard.train.config import check_world, load_yaml, resolve
    from layershard.train.modeling import check_model, check_seq_len, model_spec

    cfg = resolve(load_yaml(path))
    check_world(cfg, world, local)
    kind, spec, max_len = model_spec(cfg, None)
    check_seq_len(cfg, max_len)
    check_model(cfg, kind, spec)


# --- 1. --gather-dtype: the search compares the rows the plan models --------------------------


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_gather_dtype_searches_the_rows_it_models(capsys, tmp_path, dtype):
    """docs/wire-dtypes.md's Llama-70B on 128 H100s: the search also tried TP rows, which the
    plan does not model with 8-bit gathers, and raised after printing the plan."""
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama-70b", "--gpus", "128", "--gpus-per-node", "8", "--gpu",
            "h100", "--gather-dtype", dtype, "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert f"bf16 params, fp32 reduce, {dtype} gathers" in capsys.readouterr().out
    sug = json.loads(out.read_text())["suggestion"]
    chosen = sug["settings"]["settings"]
    assert (chosen["gather_dtype"], chosen["tp"], chosen["ep"]) == (dtype, 1, 1)
    # the 1-D rows of 16 nodes: 3 strategies, hpZ over a node, hybrid over 1..8 nodes; x offload
    labels = {r["strategy"] for r in sug["ranking"]}
    assert len(sug["ranking"]) == 16 and not any("tp " in label for label in labels), labels


def test_gather_dtype_with_tp_is_refused_in_one_line(capsys):
    err = refused(capsys, "--model", "llama-7b", "--gpus", "16", "--tp", "2", "--gather-dtype",
                  "fp8")  # fmt: skip
    assert err == "--tp/--ep are not modelled with --gather-dtype; drop --gather-dtype or --tp/--ep"


# --- 2-3. --qlora: its JSON, its train config, and the options it does not use -----------------

QLORA_70B = ["--qlora", "--model", "llama-70b", "--gpus", "2", "--gpus-per-node", "2",
             "--gpu-memory", "24", "--seq-len", "2048", "--checkpoint-layers", "all"]  # fmt: skip


def test_qlora_writes_its_json(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", *QLORA_70B, "--json", str(out)]) == 0
    assert "layershard plan --qlora: llama-70b" in capsys.readouterr().out
    d = json.loads(out.read_text())["qlora"]
    s = QLoRASettings(world=2, seq_len=2048)
    m = qlora_memory(ModelShape.from_preset("llama-70b"), s)
    assert d["memory_bytes"] == m
    assert d["usable_bytes"] == usable(24 * GIB) and d["fits"] is False
    assert round(m["packed_base"] / GIB, 1) == 15.9  # docs/qlora.md: "15.9 GiB per GPU"
    assert d["settings"] == {"world": 2, "lora_rank": 16, "double_quant": True,
                             "compute_dtype": "bf16", "seq_len": 2048, "micro_batch": 1,
                             "offload": False, "frozen_dtype": None,
                             "offload_activations": False, "loss_chunks": 0}  # fmt: skip
    assert (d["model"]["name"], d["model"]["params"], d["gpu"]) == (
        "llama-70b",
        68976648192,
        "h100",
    )


def test_qlora_writes_a_config_train_accepts(capsys, tmp_path):
    model = model_folder(tmp_path, weights=True)
    out = tmp_path / "run.yaml"
    argv = ["plan", "--qlora", "--hf-config", str(model), "--gpus", "2", "--gpus-per-node", "2",
            "--seq-len", "512", "--micro-batch", "2", "--lora-rank", "8", "--write-config",
            str(out)]  # fmt: skip
    assert main(argv) == 0
    assert f"wrote {out}: layershard train --config {out}" in capsys.readouterr().out
    cfg = yaml.safe_load(out.read_text())
    # train loads what it does not quantize in the compute dtype (train/loop/qlora.py)
    s = QLoRASettings(world=2, lora_rank=8, seq_len=512, micro_batch=2)
    m = qlora_memory(ModelShape.from_hf_config(model), s)
    assert cfg == {
        "init_from": str(model), "qlora": True, "lora_rank": 8, "seq_len": 512, "micro_batch": 2,
        "grad_accum": 1, "precision": "bf16", "activation_checkpointing": 2, "offload": False,
        "plan": {"gpus": 2, "gpus_per_node": 2, "gpu": "h100", "peak_bytes": m["peak"],
                 "model_states_bytes": m["model_states"]},
    }  # fmt: skip
    train_checks(out, world=2, local=2)


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], "--write-config with --qlora needs --hf-config MODEL_FOLDER: layershard train "
             "--qlora loads a Hugging Face model folder (--init-from), not a preset"),
        (["--hf-config", "{model}", "--no-double-quant"],
         "--write-config: layershard train quantizes with double quantization; drop "
         "--no-double-quant"),
        (["--hf-config", "{model}", "--frozen-dtype", "fp32"],
         "--write-config: layershard train --qlora loads the unquantized weights in the compute "
         "dtype (--param-dtype); drop --frozen-dtype"),
    ],
)  # fmt: skip
def test_qlora_write_config_refusals(capsys, tmp_path, flags, expected):
    model = model_folder(tmp_path)
    out = tmp_path / "run.yaml"
    flags = [f.format(model=model) for f in flags]
    argv = ["--qlora", "--gpus", "2", "--seq-len", "512", *flags, "--write-config", str(out)]
    assert refused(capsys, *argv) == expected
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--tp", "2"], "--tp"),
        (["--ep", "2", "--strategy", "hybrid"], "--strategy, --ep"),
        (["--checkpoint-layers", "3"], "--checkpoint-layers"),
    ],
)
def test_qlora_refuses_the_options_it_does_not_use(capsys, flags, names):
    """--tp was dropped without a word: the QLoRA plan is one data-parallel layout (and train
    refuses --tp with --qlora)."""
    base = [f for f in QLORA_70B if f not in ("--checkpoint-layers", "all")]
    err = refused(capsys, *base, *flags)
    assert err == (
        f"--qlora plans data-parallel QLoRA with every block checkpointed and does not use "
        f"{names}; drop {'it' if ',' not in names else 'them'}"
    )


# --- 4. only the TP sizes train accepts ---------------------------------------------------------


def test_write_config_takes_only_a_tp_train_accepts(capsys, tmp_path):
    """At 8192 tokens on 5 GiB only TP 4 and 8 fit, and the search wrote `tp: 4`, which train
    refuses (2 KV heads do not split 4 ways); now no row train runs fits: nothing is written.
    On 8 GiB TP 2 fits, and train's own checks take the file."""
    model = model_folder(tmp_path)
    out = tmp_path / "run.yaml"
    base = ["--hf-config", str(model), "--gpus", "8", "--seq-len", "8192", "--write-config",
            str(out)]  # fmt: skip
    assert refused(capsys, *base, "--gpu-memory", "5") == (
        "--write-config: these settings do not fit and no setting that fits was found; no "
        "config written"
    )
    assert not out.exists()
    assert main(["plan", *base, "--gpu-memory", "8"]) == 0
    printed = capsys.readouterr().out
    assert "full, tp 2 (dp_shard 4)" in printed and "tp 4" not in printed and "tp 8" not in printed
    cfg = yaml.safe_load(out.read_text())
    assert (cfg["hf_config"], cfg["tp"], cfg["micro_batch"], cfg["grad_accum"]) == (
        str(model), 2, 1, 2,
    )  # fmt: skip
    train_checks(out, world=8, local=8)


def test_a_given_tp_train_refuses_is_not_written(capsys, tmp_path):
    """--tp 4 of tiny (4 heads, 2 KV heads) is planned, but train refuses it: no `tp: 4` file."""
    out = tmp_path / "run.yaml"
    argv = ["--model", "tiny", "--gpus", "4", "--gpus-per-node", "4", "--tp", "4"]
    assert main(["plan", *argv]) == 0
    assert "layershard train refuses this row: --tp 4 must divide the model's n_kv_heads=2" in (
        capsys.readouterr().out
    )
    err = refused(capsys, *argv, "--write-config", str(out))
    assert err.startswith("--write-config: layershard train refuses --tp 4 --strategy full "), err
    assert err.endswith("--tp 4 must divide the model's n_kv_heads=2 (each TP rank computes "
                        "n_kv_heads / tp heads); change --tp"), err  # fmt: skip
    assert not out.exists()


# --- 5-6. malformed input: one line naming the option and the fix -------------------------------


@pytest.mark.parametrize(
    "content, expected",
    [
        ("[1, 2]", "holds a JSON list, not an object; point --hf-config at a transformers "
                   "config.json (or its folder)"),
        ('"x"', "holds a JSON string, not an object; point --hf-config at a transformers "
                "config.json (or its folder)"),
        ("{\"hidden_size\": ", "is not valid JSON (line 1, column 17: Expecting value); point "
                               "--hf-config at a transformers config.json (or its folder)"),
        (json.dumps(LLAMA | {"hidden_size": "big"}),
         "hidden_size must be a positive integer, got 'big'"),
        (json.dumps(LLAMA | {"num_hidden_layers": 0}),
         "num_hidden_layers must be a positive integer, got 0"),
        (json.dumps(LLAMA | {"vocab_size": -5}), "vocab_size must be a positive integer, got -5"),
        (json.dumps(LLAMA | {"num_key_value_heads": 3}),
         "num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
        (json.dumps(LLAMA | {"tie_word_embeddings": "yes"}),
         "tie_word_embeddings must be true or false, got 'yes'"),
        (json.dumps({"text_config": [1]}), "text_config must be an object, got [1]"),
    ],
)  # fmt: skip
def test_malformed_hf_config_is_refused(capsys, tmp_path, content, expected):
    path = tmp_path / "config.json"
    path.write_text(content)
    assert refused(capsys, "--hf-config", str(path)) == f"--hf-config {path}: {expected}"


def test_missing_hf_config_is_refused(capsys, tmp_path):
    missing = tmp_path / "nope.json"
    assert refused(capsys, "--hf-config", str(missing)) == (
        f"--hf-config {missing} does not exist; pass a transformers config.json or its folder"
    )
    assert refused(capsys, "--hf-config", str(tmp_path)) == (
        f"--hf-config {tmp_path} has no config.json; pass a transformers config.json or its folder"
    )


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--checkpoint-layers", "abc"], "--checkpoint-layers must be a number of blocks 0..4 "
                                         "or all, got 'abc'"),
        (["--checkpoint-layers", "-1"], "--checkpoint-layers must be a number of blocks 0..4 or "
                                        "all, got '-1'"),
        (["--checkpoint-layers", "9"], "--checkpoint-layers must be a number of blocks 0..4 or "
                                       "all, got '9'"),
        (["--reshard-after-forward", "0"], "--reshard-after-forward must be true, false or a "
                                           "number of ranks K >= 1 (hpZ), got 0"),
        (["--qlora", "--lora-rank", "0"], "--lora-rank must be at least 1, got 0"),
        (["--loss-chunks", "-2"], "--loss-chunks must be at least 0, got -2"),
        (["--micro-batch", "0"], "--micro-batch must be at least 1, got 0"),
        (["--gpus", "12"], "--gpus 12 is not a multiple of --gpus-per-node 8; plan whole nodes "
                           "(or fewer GPUs than a node)"),
        (["--model", "nosuch"], "--model: unknown model preset 'nosuch'; valid names: tiny, "
                                "small, llama-1b, llama-7b, llama-13b, llama-70b, moe"),
        (["--tp", "3", "--gpus", "6", "--gpus-per-node", "6"],
         "--tp 3 does not divide the 4 attention heads"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_in_one_line(capsys, flags, expected):
    assert refused(capsys, "--model", "tiny", *flags) == expected


@pytest.mark.parametrize("option", ["--json", "--write-config"])
def test_output_paths_are_checked_before_planning(capsys, tmp_path, option):
    """A file in a folder that does not exist failed with a traceback after the plan."""
    path = tmp_path / "missing" / "out"
    assert refused(capsys, "--model", "tiny", "--gpus", "2", option, str(path)) == (
        f"{option} {path}: the folder {path.parent} does not exist; create it or choose another "
        "path"
    )
    assert capsys.readouterr().out == ""
    assert refused(capsys, "--model", "tiny", "--gpus", "2", option, str(tmp_path)) == (
        f"{option} {tmp_path} is a folder; name a file in it"
    )


def test_write_config_refuses_a_sequence_train_refuses(capsys, tmp_path):
    """tiny's max_seq_len is 512: the plan notes a longer --seq-len, but train refuses it, so
    the file it wrote could not run."""
    out = tmp_path / "run.yaml"
    argv = ["--model", "tiny", "--gpus", "2", "--seq-len", "1024", "--write-config", str(out)]
    err = refused(capsys, *argv)
    assert err == (
        "--write-config: layershard train refuses --seq-len 1024 beyond tiny's max_seq_len 512; "
        "lower --seq-len"
    )
    assert not out.exists()
