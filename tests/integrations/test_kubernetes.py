"""examples/kubernetes/pytorchjob.yaml: what `layershard train` each pod of the PyTorchJob runs.

Each pod's container command runs here with the environment the Kubeflow training operator
(v1, PyTorchJob) gives that pod: PET_NNODES (the number of replicas), PET_NODE_RANK and RANK
(Master 0, Worker i: i + 1), PET_MASTER_ADDR / MASTER_ADDR (``<job>-master-0``), PET_MASTER_PORT /
MASTER_PORT (the container port named ``pytorchjob-port``), WORLD_SIZE; Kubernetes' own
``$(VAR)`` expansion of command and args is applied first. A stand-in ``layershard`` first on PATH
records its argv, which must parse with `layershard train`'s own parser. With the operator's
Python SDK installed (``pip install 'layershard[kubernetes]'``), the manifest is also checked
against its published schema (a misspelled or misplaced key does not survive the round trip)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from layershard.train.cli import add_arguments

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "examples" / "kubernetes" / "pytorchjob.yaml"

LAYERSHARD = r"""#!/usr/bin/env python3
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
"""


def _job() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _container(job: dict, kind: str) -> dict:
    (container,) = [
        c
        for c in job["spec"]["pytorchReplicaSpecs"][kind]["template"]["spec"]["containers"]
        if c["name"] == "pytorch"
    ]
    return container


def _operator_env(job: dict, kind: str, index: int) -> dict[str, str]:
    """The variables the training operator adds to pod ``index`` of replica type ``kind``
    (pkg/controller.v1/pytorch: envvar.go, master.go; no elasticPolicy, no nprocPerNode)."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    total = sum(s["replicas"] for s in specs.values())
    (port,) = [
        p["containerPort"]
        for p in _container(job, "Master")["ports"]
        if p["name"] == "pytorchjob-port"
    ]
    rank = index + 1 if kind == "Worker" else index
    master = f"{job['metadata']['name']}-master-0"
    return {
        "PYTHONUNBUFFERED": "1",
        "MASTER_PORT": str(port),
        "PET_MASTER_PORT": str(port),
        "MASTER_ADDR": master,
        "PET_MASTER_ADDR": master,
        "WORLD_SIZE": str(total),
        "RANK": str(rank),
        "PET_NODE_RANK": str(rank),
        "PET_NNODES": str(total),
    }


def _k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command and args: $(VAR) of a defined variable, $$ -> $."""
    return re.sub(
        r"\$\$|\$\((\w+)\)",
        lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]),
        text,
    )


def _pods(job: dict, tmp_path: Path) -> list[list[str]]:
    """Run every pod's container command; the argv `layershard` got in each, in node order.
    /shared (the volume every pod mounts) is ``tmp_path / "shared"``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "layershard").write_text(LAYERSHARD)
    (bin_dir / "layershard").chmod(0o755)
    argvs = []
    for kind in ("Master", "Worker"):
        for index in range(job["spec"]["pytorchReplicaSpecs"][kind]["replicas"]):
            container = _container(job, kind)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "RUN"))}
            for var in container.get("env", []):
                env[var["name"]] = var["value"].replace("/shared", str(tmp_path / "shared"))
            env.update(_operator_env(job, kind, index))
            env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_LOG=str(tmp_path / "log"))
            cmd = [_k8s_expand(x, env) for x in container["command"] + container.get("args", [])]
            subprocess.run(cmd, env=env, check=True, timeout=30)
            argvs.append(json.loads((tmp_path / "log").read_text().splitlines()[-1]))
    return argvs


def _expected(tmp_path: Path, node: int, nnodes: int, *resume: str) -> list[str]:
    return [
        "train", "--config", "/shared/llama7b.yaml",
        "--run-dir", str(tmp_path / "shared" / "runs" / "llama7b"), *resume,
        "--nnodes", str(nnodes), "--node-rank", str(node),
        "--rdzv-endpoint", "llama7b-master-0:23456", "--rdzv-id", "llama7b",
    ]  # fmt: skip


def test_each_pod_runs_the_same_command_but_its_rank(tmp_path) -> None:
    """Node 0 is the Master, whose service is the rendezvous endpoint."""
    assert _pods(_job(), tmp_path) == [_expected(tmp_path, 0, 2), _expected(tmp_path, 1, 2)]


def test_more_pods_are_one_number(tmp_path) -> None:
    job = _job()
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 3
    assert _pods(job, tmp_path) == [_expected(tmp_path, k, 4) for k in range(4)]


def test_the_commands_parse_with_layershard_train_s_own_parser(tmp_path) -> None:
    """A flag the manifest misspells fails here (argparse exits 2), as in the pod."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for node, argv in enumerate(_pods(_job(), tmp_path)):
        args = parser.parse_args(argv[1:])
        assert (args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id) == (
            "2",
            node,
            "llama7b-master-0:23456",
            "llama7b",
        )


def test_a_restarted_pod_resumes_and_one_stopped_before_a_checkpoint_starts_again(
    tmp_path,
) -> None:
    run = tmp_path / "shared" / "runs" / "llama7b"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: llama-7b\n")  # an earlier launch, no checkpoint yet
    assert _pods(_job(), tmp_path)[0] == _expected(tmp_path, 0, 2, "--overwrite")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("step_001000\n")
    assert _pods(_job(), tmp_path) == [
        _expected(tmp_path, 0, 2, "--resume"),
        _expected(tmp_path, 1, 2, "--resume"),
    ]


def test_pods_are_alike_and_the_operator_finds_them() -> None:
    job = _job()
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1  # node 0, the rendezvous' host
    assert specs["Master"]["template"] == specs["Worker"]["template"]
    pod = specs["Master"]["template"]["spec"]
    assert [p["name"] for p in _container(job, "Master")["ports"]] == ["pytorchjob-port"]
    # SIGTERM on deletion: the grace period covers a step and a checkpoint save
    assert pod["terminationGracePeriodSeconds"] >= 120
    mounts = {m["name"]: m["mountPath"] for m in _container(job, "Master")["volumeMounts"]}
    assert mounts["shared"] == "/shared" and "persistentVolumeClaim" in pod["volumes"][0]


def test_manifest_matches_the_operator_s_schema() -> None:
    """The training operator's SDK models (generated from its OpenAPI schema) read the manifest
    and write back exactly it: required fields present, every key known, every value typed."""
    pytest.importorskip("kubeflow.training")
    from kubeflow.training.api_client import ApiClient

    job = _job()

    class Response:  # what ApiClient.deserialize reads: an HTTP response's JSON body
        data = json.dumps(job)

    client = ApiClient()
    model = client.deserialize(Response(), "KubeflowOrgV1PyTorchJob")
    assert client.sanitize_for_serialization(model) == job
    # and a misspelled key is lost on the way, so the check would catch it
    typo = copy.deepcopy(job)
    pod = typo["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    pod["containers"][0]["volumeMount"] = pod["containers"][0].pop("volumeMounts")
    Response.data = json.dumps(typo)
    assert (
        client.sanitize_for_serialization(client.deserialize(Response(), "KubeflowOrgV1PyTorchJob"))
        != typo
    )


def test_the_docs_show_the_manifest_as_it_is() -> None:
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    assert MANIFEST.read_text() in docs
