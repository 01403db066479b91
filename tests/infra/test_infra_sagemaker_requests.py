"""State-machine data flow: the synthesized state machines executed by moto's Step Functions interpreter up to
the SageMaker call, every rendered ``CreateTrainingJob`` request validated against botocore's own service
model, then the two phases of seed 001's scaling plan run through the image's ``train`` entrypoint with one
checkpoint folder per S3 checkpoint prefix (as SageMaker syncs ``CheckpointConfig.S3Uri`` <-> /opt/ml/checkpoints).

What moto cannot do, and what this file does about it: moto's CloudFormation creates the state machines in the
non-executing Step Functions backend, so their *resolved* definitions (every CloudFormation token filled in by
moto) are read there and re-created in the executing backend (``mock_aws(config={"stepfunctions":
{"execute_state_machine": True}})``). That backend runs the Pass states and the intrinsic functions (JsonMerge,
Format, UUID) itself, but has no ``sagemaker:createTrainingJob.sync`` integration: the test gives it one that
records the rendered request and answers "Completed", so the next phase is reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import botocore.session
import pytest
import regex  # botocore's patterns are Java regexes (\p{L}, \p{Alnum}); `regex` (a cfn-lint dependency) reads them
from botocore.validate import validate_parameters
from checkpoint_sync import prefix_at_the_end, restore
from moto import mock_aws

from tests import forkserver, moto_env

TINY_HPS = {
    "model": "shufflenet_v2_x0_5",  # 1.4 M parameters: each phase's steps and checkpoint writes are cheap
    "image_size": "32",
    "epochs": "1",
    "max_steps_per_epoch": "2",
    "batch_size": "32",
    "lr": "0.0125",
    "warmup_epochs": "0",
    "num_workers": "0",
    "log_every_steps": "1",
    "crop_scale_min": "0.5",
    "hflip_prob": "0.0",
}


def _sagemaker_input_shape():
    model = botocore.session.get_session().get_service_model("sagemaker")
    return model.operation_model("CreateTrainingJob").input_shape


def check_against_model(value, shape, path: str = "CreateTrainingJob") -> list[str]:
    """Problems of ``value`` against the botocore ``shape`` that ``validate_parameters`` leaves to the server:
    string ``max`` lengths, ``pattern`` regexes, list/map ``max`` sizes. Returns one line per problem."""
    problems = []
    if shape.type_name == "structure" and isinstance(value, dict):
        for k, v in value.items():
            if k in shape.members:
                problems += check_against_model(v, shape.members[k], f"{path}.{k}")
    elif shape.type_name == "list" and isinstance(value, list):
        if "max" in shape.metadata and len(value) > shape.metadata["max"]:
            problems.append(f"{path}: {len(value)} items > {shape.metadata['max']}")
        for i, v in enumerate(value):
            problems += check_against_model(v, shape.member, f"{path}[{i}]")
    elif shape.type_name == "map" and isinstance(value, dict):
        if "max" in shape.metadata and len(value) > shape.metadata["max"]:
            problems.append(f"{path}: {len(value)} entries > {shape.metadata['max']}")
        for k, v in value.items():
            problems += check_against_model(k, shape.key, f"{path} key {k!r}")
            problems += check_against_model(v, shape.value, f"{path}[{k!r}]")
    elif shape.type_name == "string" and isinstance(value, str):
        if "max" in shape.metadata and len(value) > shape.metadata["max"]:
            problems.append(f"{path}: {len(value)} characters > {shape.metadata['max']}")
        pattern = shape.metadata.get("pattern")
        if pattern and not regex.fullmatch(pattern, value, regex.S):
            problems.append(f"{path}: {value!r} does not match {pattern!r}")
    return problems


def _install_fake_sagemaker_sync(monkeypatch, recorded: list[dict]) -> None:
    """Give moto's interpreter a ``createTrainingJob.sync`` that records the request and completes at once."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import state_task_service_callback as cb
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
        state_task_service_unsupported as unsupported,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.resource import ResourceCondition

    cls = unsupported.StateTaskServiceUnsupported

    def init(self):
        cb.StateTaskServiceCallback.__init__(
            self, supported_integration_patterns={ResourceCondition.WaitForTaskToken, ResourceCondition.Sync}
        )

    def call(self, env, resource_runtime_part, normalised_parameters, state_credentials):
        recorded.append(json.loads(json.dumps(normalised_parameters)))
        env.stack.append(
            {
                "TrainingJobArn": "arn:aws:sagemaker:us-east-1:123456789012:training-job/"
                + normalised_parameters["TrainingJobName"]
            }
        )

    def sync(self, env, resource_runtime_part, normalised_parameters, state_credentials):
        name = normalised_parameters["TrainingJobName"]
        return lambda: {
            "TrainingJobName": name,
            "TrainingJobStatus": "Completed",
            "BillableTimeInSeconds": 60,
            "ModelArtifacts": {"S3ModelArtifacts": f"s3://bucket/models/{name}/output/model.tar.gz"},
        }

    monkeypatch.setattr(cls, "__init__", init)
    monkeypatch.setattr(cls, "_eval_service_task", call)
    monkeypatch.setattr(cls, "_build_sync_resolver", sync)


DIGITS_PHASES = [
    {
        "name": "cpu-smoke",
        "instance_type": "ml.m5.xlarge",
        "hyperparameters": {"epochs": "1", "batch_size": "2", "num_workers": "2", "device": "cpu"},
    },
    {"name": "gpu", "instance_type": "ml.g5.xlarge", "hyperparameters": {"precision": "amp"}},
]


@pytest.fixture(scope="module")
def executions(tmp_path_factory):
    """{state machine name: (execution status, [rendered CreateTrainingJob requests])} for every state machine
    of the synthesized TrainingStack, run with the input ``python -m infra submit`` sends."""
    from infra.cli.jobs import hyperparameters

    mp = pytest.MonkeyPatch()
    try:
        moto_env.fake_credentials(mp)
        # Two digits phases (CPU, then GPU) instead of seed 001's eleven: the requests, prefixes and the run
        # through the entrypoint below need a plan that trains on the tiny digits channel.
        templates = moto_env.synthesize(tmp_path_factory.mktemp("cdk-sfn"), scaling_phases=json.dumps(DIGITS_PHASES))
        with mock_aws():
            moto_env.deploy(templates)
            sfn = boto3.client("stepfunctions", region_name=moto_env.REGION)
            definitions = [
                sfn.describe_state_machine(stateMachineArn=s["stateMachineArn"])
                for s in sfn.list_state_machines()["stateMachines"]
            ]
        payload = {
            "run_name": "digits-a",
            "image_tag": "3f2c1ab",
            "instance_count": 1,
            "hyperparameters": hyperparameters(None, TINY_HPS),
        }
        out = {}
        with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
            sfn = boto3.client("stepfunctions", region_name=moto_env.REGION)
            for d in definitions:
                recorded: list[dict] = []
                _install_fake_sagemaker_sync(mp, recorded)
                arn = sfn.create_state_machine(name=d["name"], definition=d["definition"], roleArn=d["roleArn"])[
                    "stateMachineArn"
                ]
                ex = sfn.start_execution(stateMachineArn=arn, input=json.dumps(payload))["executionArn"]
                deadline = time.monotonic() + 60
                while (desc := sfn.describe_execution(executionArn=ex))["status"] == "RUNNING":
                    assert time.monotonic() < deadline, f"{d['name']} still running"
                    time.sleep(0.05)
                out[d["name"]] = (desc["status"], desc.get("cause"), recorded)
        return out
    finally:
        mp.undo()


def test_every_state_machine_reaches_sagemaker_with_valid_requests(executions):
    shape = _sagemaker_input_shape()
    assert set(executions) == {
        f"trainstack-{moto_env.ENV}-{n}"
        for n in ("train-g5-2xlarge", "train-g5-xlarge", "train-m5-xlarge", "scaling-plan")
    }
    for name, (status, cause, requests) in executions.items():
        assert status == "SUCCEEDED", (name, cause)
        assert requests, name
        for req in requests:
            validate_parameters(req, shape)  # raises ParamValidationError: types, required members, enums
            assert check_against_model(req, shape) == [], name
            assert all(isinstance(v, str) for v in req["HyperParameters"].values())
            assert req["CheckpointConfig"]["LocalPath"] == "/opt/ml/checkpoints"
            assert req["AlgorithmSpecification"]["TrainingImage"].endswith(":3f2c1ab")


def test_scaling_plan_phases_have_distinct_checkpoint_prefixes(executions):
    status, _, requests = executions[f"trainstack-{moto_env.ENV}-scaling-plan"]
    assert [r["ResourceConfig"]["InstanceType"] for r in requests] == ["ml.m5.xlarge", "ml.g5.xlarge"]
    prefixes = [r["CheckpointConfig"]["S3Uri"] for r in requests]
    bucket = requests[0]["OutputDataConfig"]["S3OutputPath"].removesuffix("models/")
    assert bucket.startswith(f"s3://{moto_env.ENV}-datastack-bucket")  # the data stack's bucket, name generated
    assert prefixes == [bucket + "checkpoints/digits-a/cpu-smoke/", bucket + "checkpoints/digits-a/gpu/"]
    # neither prefix contains the other: SageMaker restores everything under the prefix into /opt/ml/checkpoints
    assert not prefixes[1].startswith(prefixes[0]) and not prefixes[0].startswith(prefixes[1])
    cpu, gpu = (r["HyperParameters"] for r in requests)
    assert (cpu["batch_size"], cpu["device"]) == ("2", "cpu") and gpu["batch_size"] == "32"
    assert gpu["precision"] == "amp" and "device" not in gpu


# ---------------------------------------------------------------- the trainer side
TRAIN = Path(__file__).resolve().parents[2] / "images" / "training" / "train"


def _run_phase(request: dict, opt_ml: Path, s3: Path, data: Path) -> subprocess.CompletedProcess:
    """One SageMaker job of ``request`` on this machine: a fake /opt/ml whose ``checkpoints`` folder SageMaker's
    stand-in fills from the folder standing for the request's S3 checkpoint prefix before the job, and uploads
    back to it after (tests/sagemaker/checkpoint_sync.py)."""
    cfg = opt_ml / "input" / "config"
    cfg.mkdir(parents=True)
    (cfg / "resourceconfig.json").write_text(
        json.dumps({"current_host": "algo-1", "hosts": ["algo-1"], "network_interface_name": "eth0"})
    )
    (cfg / "hyperparameters.json").write_text(json.dumps(request["HyperParameters"]))
    channels = [c["ChannelName"] for c in request["InputDataConfig"]]
    (cfg / "inputdataconfig.json").write_text(json.dumps({c: {"TrainingInputMode": "File"} for c in channels}))
    (opt_ml / "input" / "data").mkdir(parents=True)
    (opt_ml / "input" / "data" / channels[0]).symlink_to(data, target_is_directory=True)
    prefix = s3 / request["CheckpointConfig"]["S3Uri"].removeprefix("s3://")
    restore(prefix, opt_ml / "checkpoints")
    env = {
        **os.environ,
        "PYTHONPATH": str(TRAIN.parents[2]),
        "TRAINSTACK_SM_ROOT": str(opt_ml),
        "TRAINSTACK_NPROC_PER_NODE": request["Environment"]["TRAINSTACK_NPROC_PER_NODE"],
    }
    proc = forkserver.run([sys.executable, str(TRAIN)], cwd=TRAIN.parents[2], env=env, timeout=600)
    prefix_at_the_end(opt_ml / "checkpoints", prefix)
    return proc


def test_gpu_phase_starts_fresh_with_its_own_checkpoint_prefix(executions, tiny_digits, tmp_path):
    """Both phases through the entrypoint (on CPU): the GPU phase's prefix is empty, so it trains from step 0
    and exits 0. The same two phases sharing one prefix (the old ``checkpoints/<run>/``) make the GPU phase
    restore the CPU phase's checkpoint and refuse it (batch 2 -> 32): exit 2, the job would fail."""
    _, _, (cpu, gpu) = executions[f"trainstack-{moto_env.ENV}-scaling-plan"]
    s3 = tmp_path / "s3"
    first = _run_phase(cpu, tmp_path / "cpu" / "opt_ml", s3, tiny_digits)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    cpu_prefix = s3 / cpu["CheckpointConfig"]["S3Uri"].removeprefix("s3://")
    assert any(p.name.startswith("ckpt-") for p in cpu_prefix.iterdir())
    second = _run_phase(gpu, tmp_path / "gpu" / "opt_ml", s3, tiny_digits)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    gpu_prefix = s3 / gpu["CheckpointConfig"]["S3Uri"].removeprefix("s3://")
    manifests = sorted(gpu_prefix.glob("ckpt-*/manifest.json"))
    assert manifests, sorted(p.name for p in gpu_prefix.iterdir())
    metrics = [
        json.loads(x)
        for x in (tmp_path / "gpu" / "opt_ml" / "output" / "data" / "logs" / "metrics.jsonl").read_text().splitlines()
        if x.strip()
    ]
    epochs = [m for m in metrics if m.get("kind") == "epoch"]
    assert epochs and epochs[0]["epoch"] in (0, 1) and epochs[0]["step"] <= 2  # trained itself, from the start

    shared = {**gpu, "CheckpointConfig": {**gpu["CheckpointConfig"], "S3Uri": cpu["CheckpointConfig"]["S3Uri"]}}
    clash = _run_phase(shared, tmp_path / "clash" / "opt_ml", s3, tiny_digits)
    assert clash.returncode == 2, clash.stdout[-2000:] + clash.stderr[-2000:]
    assert "batch_size" in (tmp_path / "clash" / "opt_ml" / "output" / "failure").read_text()
