"""``python -m infra sweep`` / ``sweep-status`` (infra/cli/sweep.py, sweep_plan.py, tuning.py), offline.

Every request the sweep sends (CreateHyperParameterTuningJob, the per-trial StartExecution inputs, Search,
DescribeHyperParameterTuningJob, ...) goes through botocore ``Stubber``: botocore validates the parameters against
its service model before the stub answers (types, required members, enums), and the tuning request is also checked
for the string patterns and lengths the server checks (``check_against_model``). No request leaves the process.
The IAM and state-machine tests synthesize the app once (module fixture).
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

import boto3
import botocore.session
import pytest
from botocore.stub import Stubber
from botocore.validate import validate_parameters

import catalog
from infra.cli import sweep, sweep_plan, tuning
from infra.cli.main import main
from infra.cli.outputs import Outputs
from infra.cli.session import Aws, CliError
from infra.training_job import METRIC_DEFINITIONS, training_job_state
from tests import moto_env
from tests.infra.test_infra_sagemaker_requests import check_against_model

REPO = Path(__file__).resolve().parents[2]
ROOFS = str(REPO / "configs" / "seed001_roofs_gpu.yaml")  # segmentation: objective val_miou
ACCOUNT, REGION, ENV = "123456789012", "us-east-1", "dev"
ROLE = f"arn:aws:iam::{ACCOUNT}:role/trainstack-dev-sagemaker-{REGION}"
BUCKET = "dev-datastack-bucket83908e77-abc"
REPO_URI = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/trainstack-dev"
MACHINE_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:trainstack-dev-train-g5-xlarge"


def _shape(op: str):
    return botocore.session.get_session().get_service_model("sagemaker").operation_model(op).input_shape


def _valid(request: dict, op: str = "CreateHyperParameterTuningJob") -> None:
    shape = _shape(op)
    validate_parameters(request, shape)
    assert check_against_model(request, shape, op) == []


def _client(name: str):
    return boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name=REGION).client(name)


def _aws() -> Aws:
    return Aws(session=None, region=REGION, account=ACCOUNT, env=ENV)


def _outputs() -> Outputs:
    return Outputs(
        env=ENV,
        bucket=BUCKET,
        volume_id="vol-1",
        availability_zone=f"{REGION}a",
        repository_uri=REPO_URI,
        alarm_topic_arn="arn:aws:sns:us-east-1:123456789012:t",
        train_log_group="/trainstack/dev/train",
        state_machines={"train-g5-xlarge": MACHINE_ARN},
    )


def _job_state(volume_gib: int = 100, max_run_s: int = 86400, max_wait_s: int = 172800) -> dict:
    """The deployed state machine's training task (CloudFormation tokens resolved)."""
    return training_job_state(
        phase="g5-xlarge",
        instance=catalog.get("ml.g5.xlarge"),
        prefix="trainstack-dev",
        image_repository_uri=REPO_URI,
        role_arn=ROLE,
        bucket_name=BUCKET,
        volume_gib=volume_gib,
        max_run_s=max_run_s,
        max_wait_s=max_wait_s,
        env=ENV,
    )


def _job_parameters() -> dict:
    """The deployed state machine's CreateTrainingJob Parameters."""
    return _job_state()["Parameters"]


def _plan(*flags, strategy="tuning", **kw):
    grids = [f for k, f in flags if k == "grid"]
    ranges = [f for k, f in flags if k == "range"]
    return sweep_plan.plan(
        ENV, kw.pop("name", "roofs-lr"), "train-g5-xlarge", ROOFS, {}, grids, ranges, strategy=strategy, **kw
    )


# ------------------------------------------------------------------------------------------------- tuning
def _request(p):
    return tuning.tuning_request(p, _job_parameters(), f"{REPO_URI}:3f2c1ab", BUCKET)


def test_grid_only_is_a_grid_tuning_job_of_categorical_ranges():
    p = _plan(("grid", "lr=[0.1, 0.03]"), ("grid", "batch_size=[8, 16]"))
    req = _request(p)
    _valid(req)
    cfg = req["HyperParameterTuningJobConfig"]
    assert cfg["Strategy"] == "Grid" and "RandomSeed" not in cfg
    assert cfg["ParameterRanges"] == {
        "CategoricalParameterRanges": [
            {"Name": "lr", "Values": ["0.1", "0.03"]},
            {"Name": "batch_size", "Values": ["8", "16"]},
        ]
    }
    assert cfg["ResourceLimits"] == {"MaxNumberOfTrainingJobs": 4, "MaxParallelTrainingJobs": 2}
    assert cfg["HyperParameterTuningJobObjective"] == {"Type": "Maximize", "MetricName": "val_miou"}
    d = req["TrainingJobDefinition"]
    static = d["StaticHyperParameters"]
    assert not set(static) & {"lr", "batch_size"}  # static and tuned hyperparameters are disjoint
    assert static["task"] == "segmentation" and static["optimizer"] == "adamw"
    # the state machine's training job, mirrored
    job = _job_parameters()
    assert d["RoleArn"] == ROLE and d["ResourceConfig"] == {
        "InstanceType": "ml.g5.xlarge",
        "VolumeSizeInGB": 100,
        "InstanceCount": 1,
    }
    assert d["EnableManagedSpotTraining"] is True and d["StoppingCondition"] == job["StoppingCondition"]
    assert d["Environment"] == {"TRAINSTACK_NPROC_PER_NODE": "1"}
    assert d["AlgorithmSpecification"]["TrainingImage"] == f"{REPO_URI}:3f2c1ab"
    assert d["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] == f"s3://{BUCKET}/datasets/"
    assert "CheckpointConfig" not in d  # trials would share one prefix (see tuning.tuning_request)
    # the objective's regex is the training jobs' own, and the definitions fit the tuning job's limit of 20
    defs = d["AlgorithmSpecification"]["MetricDefinitions"]
    assert defs[0]["Name"] == "val_miou" and defs[0] in METRIC_DEFINITIONS and len(defs) <= 20
    tags = {t["Key"]: t["Value"] for t in req["Tags"]}
    assert tags == {
        "trainstack:env": "dev",
        "trainstack:sweep": "roofs-lr",
        "trainstack:parameters": "lr batch_size",
        "trainstack:objective": "val_miou max",
    }
    assert req["HyperParameterTuningJobName"] == "trainstack-dev-roofs-lr"


def test_ranges_are_bayesian_with_log_and_integer_ranges():
    p = _plan(("range", "lr=1e-4:0.1:log"), ("range", "batch_size=4:32"), random_trials=12, seed=7, max_parallel=3)
    req = _request(p)
    _valid(req)
    cfg = req["HyperParameterTuningJobConfig"]
    assert cfg["Strategy"] == "Bayesian" and cfg["RandomSeed"] == 7
    assert cfg["ParameterRanges"] == {
        "ContinuousParameterRanges": [
            {"Name": "lr", "MinValue": "0.0001", "MaxValue": "0.1", "ScalingType": "Logarithmic"}
        ],
        "IntegerParameterRanges": [{"Name": "batch_size", "MinValue": "4", "MaxValue": "32", "ScalingType": "Linear"}],
    }
    assert cfg["ResourceLimits"] == {"MaxNumberOfTrainingJobs": 12, "MaxParallelTrainingJobs": 3}
    assert not set(req["TrainingJobDefinition"]["StaticHyperParameters"]) & {"lr", "batch_size"}


def test_random_over_grids_is_random_and_the_strategy_can_be_forced():
    p = _plan(("grid", "optimizer=[adamw, sgd]"), ("grid", "lr=[0.1, 0.01]"), random_trials=3)
    req = _request(p)
    _valid(req)
    assert req["HyperParameterTuningJobConfig"]["Strategy"] == "Random"
    assert req["HyperParameterTuningJobConfig"]["ResourceLimits"]["MaxNumberOfTrainingJobs"] == 3
    forced = _plan(("range", "lr=1e-4:0.1:log"), random_trials=5, tuning_strategy="Random")
    assert _request(forced)["HyperParameterTuningJobConfig"]["Strategy"] == "Random"
    with pytest.raises(CliError, match="categorical parameters only"):
        _plan(("range", "lr=1e-4:0.1:log"), random_trials=5, tuning_strategy="Grid")


def test_detection_metric_definitions_are_cut_to_twenty_with_the_objective_kept():
    p = sweep_plan.plan(
        ENV,
        "dino",
        "train-g5-xlarge",
        str(REPO / "configs" / "dino_4scale_coco.yaml"),
        {},
        ["lr=[0.0001, 0.0002]"],
        [],
        strategy="tuning",
        metric="map_50",
    )
    defs = _request(p)["TrainingJobDefinition"]["AlgorithmSpecification"]["MetricDefinitions"]
    assert len(defs) == 20 and defs[0]["Name"] == "val_map_50"  # detection reports 21 keys
    assert p.mode == "max"


def test_submit_tuning_reads_the_state_machine_and_creates_one_tuning_job():
    p = _plan(("grid", "lr=[0.1, 0.03]"))
    sfn, sm, ecr = _client("stepfunctions"), _client("sagemaker"), _client("ecr")
    definition = {
        "StartAt": "Train-g5-xlarge",
        "States": {
            "Train-g5-xlarge": {
                **_job_state(volume_gib=50, max_run_s=3600, max_wait_s=7200),
                "End": True,
            }
        },
    }
    with Stubber(sfn) as s_sfn, Stubber(sm) as s_sm, Stubber(ecr) as s_ecr:
        s_ecr.add_response(
            "describe_images",
            {"imageDetails": [{"imageDigest": "sha256:" + "a" * 64}]},
            {"repositoryName": "trainstack-dev", "imageIds": [{"imageTag": "3f2c1ab"}]},
        )
        now = dt.datetime(2026, 11, 26, tzinfo=dt.UTC)
        s_sfn.add_response(
            "describe_state_machine",
            {
                "stateMachineArn": MACHINE_ARN,
                "name": "trainstack-dev-train-g5-xlarge",
                "definition": json.dumps(definition),
                "roleArn": ROLE,
                "type": "STANDARD",
                "creationDate": now,
            },
            {"stateMachineArn": MACHINE_ARN},
        )
        expected = tuning.tuning_request(
            p, definition["States"]["Train-g5-xlarge"]["Parameters"], f"{REPO_URI}:3f2c1ab", BUCKET
        )
        _valid(expected)
        assert expected["TrainingJobDefinition"]["ResourceConfig"]["VolumeSizeInGB"] == 50  # the deployed value
        arn = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:hyper-parameter-tuning-job/trainstack-dev-roofs-lr"
        s_sm.add_response("create_hyper_parameter_tuning_job", {"HyperParameterTuningJobArn": arn}, expected)
        assert tuning.submit_tuning(_aws(), _outputs(), p, "3f2c1ab", sm=sm, sfn=sfn, ecr=ecr) == arn
        s_sm.assert_no_pending_responses()


def test_tuning_name_over_32_characters_is_refused_before_aws():
    with pytest.raises(CliError, match="at most 32"):
        _plan(("grid", "lr=[0.1, 0.03]"), name="a-rather-long-sweep-name")
    _plan(("grid", "lr=[0.1, 0.03]"), name="a-rather-long-sweep-name", strategy="jobs")  # jobs: 40-char run names


# ------------------------------------------------------------------------------------------------- jobs
def _stub_existing(stubber: Stubber, existing: list[dict], first_input: str) -> None:
    """ListExecutions answering ``existing``, then DescribeExecution of the first with ``first_input``."""
    stubber.add_response("list_executions", {"executions": existing})
    first = existing[0]
    stubber.add_response(
        "describe_execution",
        {
            "executionArn": first["executionArn"],
            "stateMachineArn": MACHINE_ARN,
            "status": first["status"],
            "startDate": first["startDate"],
            "input": first_input,
        },
    )


def _execution(name, status, start):
    return {
        "executionArn": f"{MACHINE_ARN.replace('stateMachine', 'execution')}:{name}",
        "stateMachineArn": MACHINE_ARN,
        "name": name,
        "status": status,
        "startDate": start,
    }


def test_jobs_strategy_starts_k_trials_then_tops_up_on_rerun():
    p = _plan(("grid", "lr=[0.1, 0.03, 0.01]"), ("grid", "batch_size=[8]"), strategy="jobs")
    assert len(p.trials) == 3 and p.max_parallel == 2
    sfn, ecr = _client("stepfunctions"), _client("ecr")
    start_shape = sfn.meta.service_model.operation_model("StartExecution").input_shape
    now = dt.datetime(2026, 11, 26, 10, 0, tzinfo=dt.UTC)
    started = []
    with Stubber(sfn) as s_sfn, Stubber(ecr) as s_ecr:
        s_sfn.add_response("list_executions", {"executions": []}, {"stateMachineArn": MACHINE_ARN})
        s_ecr.add_response("describe_images", {"imageDetails": [{"imageDigest": "sha256:" + "b" * 64}]})
        for i in range(2):
            s_sfn.add_response("start_execution", {"executionArn": f"arn:x:{i}", "startDate": now})
        orig = sfn.start_execution

        def record(**kw):
            validate_parameters(kw, start_shape)
            started.append(kw)
            return orig(**kw)

        sfn.start_execution = record
        got = sweep.submit_jobs(_aws(), _outputs(), p, "3f2c1ab", sfn=sfn, ecr=ecr)
    assert got == {"started": ["arn:x:0", "arn:x:1"], "running": 2, "done": 0, "left": 1}
    inputs = [json.loads(s["input"]) for s in started]
    assert [i["run_name"] for i in inputs] == ["roofs-lr-t000", "roofs-lr-t001"]
    assert [i["hyperparameters"]["lr"] for i in inputs] == ["0.1", "0.03"]
    assert inputs[0]["sweep"] == {
        "sweep": "roofs-lr",
        "trial": "t000",
        "parameters": "lr batch_size",
        "objective": "val_miou max",
    }
    assert inputs[0]["image_digest"] == "sha256:" + "b" * 64 and all(
        s["stateMachineArn"] == MACHINE_ARN for s in started
    )
    assert all(s["name"].startswith(i["run_name"] + "-") and len(s["name"]) <= 80 for s, i in zip(started, inputs))

    # rerun: t000 finished, t001 still running -> t002 starts; a third run has nothing left to start
    existing = [_execution(started[0]["name"], "SUCCEEDED", now), _execution(started[1]["name"], "RUNNING", now)]
    sfn, ecr = _client("stepfunctions"), _client("ecr")
    with Stubber(sfn) as s_sfn, Stubber(ecr) as s_ecr:
        _stub_existing(s_sfn, existing, started[0]["input"])
        s_ecr.add_response("describe_images", {"imageDetails": [{"imageDigest": "sha256:" + "b" * 64}]})
        s_sfn.add_response("start_execution", {"executionArn": "arn:x:2", "startDate": now})
        got = sweep.submit_jobs(_aws(), _outputs(), p, "3f2c1ab", sfn=sfn, ecr=ecr)
    assert got == {"started": ["arn:x:2"], "running": 2, "done": 1, "left": 0}

    # the same name with other trials is refused
    changed = _plan(("grid", "lr=[0.5, 0.03, 0.01]"), ("grid", "batch_size=[8]"), strategy="jobs")
    sfn = _client("stepfunctions")
    with Stubber(sfn) as s_sfn, pytest.raises(CliError, match="other trials"):
        _stub_existing(s_sfn, existing, started[0]["input"])
        sweep.submit_jobs(_aws(), _outputs(), changed, "3f2c1ab", sfn=sfn, ecr=_client("ecr"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--grid", "lr=[0.1, -1]"], "trial t001 (lr=-1): lr: got -1.0; must be a finite number > 0"),
        (["--grid", "batch_size=[8, 0]", "--strategy", "tuning"], "trial t001 (batch_size=0)"),
        (["--grid", "lr=[0.1]", "--max-parallel", "101"], "--max-parallel 101: expected 1 to 100"),
        (["--grid", "data_dir=[/a, /b]"], "a sweep cannot vary data_dir"),
        (["--grid", "lr=[0.1]", "--machine", "scaling-plan"], "a sweep runs on one type"),
        (["--grid", "lr=[0.1]", "--machine", "train-x9"], "error: --machine 'train-x9': unknown instance type 'ml.x9'"),
        (["--grid", "lr=0.1"], "--grid lr: '0.1' is not a list"),
        (["--range", "lr=1e-4:0.1:log"], "add --random N"),
    ],
)
def test_bad_sweep_is_exit_2_before_any_aws_call(flags, message, monkeypatch, capsys):
    from infra.cli import main as main_mod

    def no_aws(*a, **k):
        raise AssertionError("AWS session opened")

    monkeypatch.setattr(main_mod, "open_session", no_aws)
    argv = ["--env", ENV, "sweep", "--name", "roofs", "--config", ROOFS, "--image-tag", "x"]
    argv += flags if "--machine" in flags else flags + ["--machine", "train-g5-xlarge"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_dry_run_prints_the_requests_without_aws(monkeypatch, capsys):
    from infra.cli import main as main_mod

    monkeypatch.setattr(main_mod, "open_session", lambda *a, **k: (_ for _ in ()).throw(AssertionError("AWS")))
    argv = [
        "--env",
        ENV,
        "sweep",
        "--name",
        "roofs-lr",
        "--machine",
        "train-g5-xlarge",
        "--config",
        ROOFS,
        "--image-tag",
        "3f2c1ab",
        "--grid",
        "lr=[0.1, 0.03]",
        "--dry-run",
    ]
    assert main(argv) == 0
    jobs_out = json.loads(capsys.readouterr().out)
    assert [s["input"]["run_name"] for s in jobs_out["StartExecution"]] == ["roofs-lr-t000", "roofs-lr-t001"]
    assert main(argv + ["--strategy", "tuning"]) == 0
    req = json.loads(capsys.readouterr().out)["CreateHyperParameterTuningJob"]
    assert req["HyperParameterTuningJobConfig"]["Strategy"] == "Grid"
    assert req["TrainingJobDefinition"]["RoleArn"] == "<SageMakerRoleArn>"


# ------------------------------------------------------------------------------------------------- status
def test_sweep_status_of_a_tuning_job_ranks_its_trials(tmp_path):
    sm = _client("sagemaker")
    t0 = dt.datetime(2026, 11, 26, 10, 0, tzinfo=dt.UTC)
    name = "trainstack-dev-roofs-lr"
    cfg = {
        "Strategy": "Grid",
        "ResourceLimits": {"MaxNumberOfTrainingJobs": 3, "MaxParallelTrainingJobs": 2},
        "HyperParameterTuningJobObjective": {"Type": "Maximize", "MetricName": "val_miou"},
        "ParameterRanges": {"CategoricalParameterRanges": [{"Name": "lr", "Values": ["0.1", "0.03", "0.01"]}]},
    }

    def summary(n, lr, status, value=None, secs=600):
        s = {
            "TrainingJobName": f"{name}-{n:03d}-1a2b3c4d",
            "TrainingJobArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:training-job/x{n}",
            "CreationTime": t0,
            "TrainingJobStatus": status,
            "TunedHyperParameters": {"lr": lr},
            "TrainingStartTime": t0,
            "TrainingEndTime": t0 + dt.timedelta(seconds=secs),
        }
        if value is not None:
            s["FinalHyperParameterTuningJobObjectiveMetric"] = {"MetricName": "val_miou", "Value": value}
        return s

    with Stubber(sm) as st:
        st.add_response(
            "describe_hyper_parameter_tuning_job",
            {
                "HyperParameterTuningJobName": name,
                "HyperParameterTuningJobArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:hyper-parameter-tuning-job/{name}",
                "HyperParameterTuningJobConfig": cfg,
                "HyperParameterTuningJobStatus": "InProgress",
                "CreationTime": t0,
                "TrainingJobStatusCounters": {},
                "ObjectiveStatusCounters": {},
            },
            {"HyperParameterTuningJobName": name},
        )
        st.add_response(
            "list_training_jobs_for_hyper_parameter_tuning_job",
            {
                "TrainingJobSummaries": [
                    summary(1, "0.1", "Completed", 0.61),
                    summary(2, "0.03", "Completed", 0.72),
                    summary(3, "0.01", "Failed"),
                ]
            },
        )
        got = sweep.gather(_aws(), "roofs-lr", sm=sm)
    assert (
        got["strategy"] == "tuning" and got["names"] == ["lr"] and (got["metric"], got["mode"]) == ("val_miou", "max")
    )
    assert [(r["rank"], r["trial"], r["lr"], r["val_miou"], r["status"]) for r in got["rows"]] == [
        (1, "t001", 0.03, 0.72, "Completed"),
        (2, "t000", 0.1, 0.61, "Completed"),
        (None, "t002", 0.01, None, "Failed"),
    ]
    assert got["rows"][0]["wall_s"] == 600.0
    from trainer.config.sweep import write_results

    paths = write_results(got["rows"], got["names"], got["metric"], got["mode"], tmp_path)
    md = paths["md"].read_text()
    assert md.index("| 1 | t001 | 0.03 | 0.72 |") < md.index("| 2 | t000 | 0.1 | 0.61 |")
    assert json.loads(paths["json"].read_text())["trials"][0]["trial"] == "t001"


def test_sweep_status_of_a_jobs_sweep_searches_by_tags_and_keeps_other_envs_out():
    from botocore.exceptions import ClientError  # noqa: F401  (the stub's error is a ClientError)

    sm = _client("sagemaker")
    t0 = dt.datetime(2026, 11, 26, 10, 0, tzinfo=dt.UTC)

    def job(trial, lr, status, miou=None, env=ENV, created=t0, secs=900):
        tags = {
            "trainstack:env": env,
            "trainstack:sweep": "roofs-lr",
            "trainstack:trial": trial,
            "trainstack:parameters": "lr",
            "trainstack:objective": "val_miou max",
        }
        j = {
            "TrainingJobName": f"trainstack-{env}-g5-xlarge-{trial}abc1",
            "TrainingJobStatus": status,
            "CreationTime": created,
            "HyperParameters": {"lr": lr, "task": "segmentation"},
            "TrainingTimeInSeconds": secs,
            "Tags": [{"Key": k, "Value": v} for k, v in tags.items()],
        }
        if miou is not None:
            j["FinalMetricDataList"] = [
                {"MetricName": "val_miou", "Value": miou, "Timestamp": t0},
                {"MetricName": "train_loss", "Value": 0.3, "Timestamp": t0},
            ]
        return {"TrainingJob": j}

    with Stubber(sm) as st:
        st.add_client_error("describe_hyper_parameter_tuning_job", "ResourceNotFound", "not found")
        st.add_response(
            "search",
            {
                "Results": [
                    job("t000", "0.1", "Completed", 0.5),
                    job("t001", "0.03", "InProgress"),
                    job("t001", "0.03", "Failed", created=t0 - dt.timedelta(hours=1)),  # older attempt of t001
                    job("t002", "0.01", "Completed", 0.8),
                    job("t000", "9", "Completed", 0.99, env="dev-x"),  # another environment's sweep of the same name
                ]
            },
            {"Resource": "TrainingJob", "SearchExpression": sweep.search_filters(ENV, "roofs-lr")},
        )
        got = sweep.gather(_aws(), "roofs-lr", sm=sm)
    assert got["strategy"] == "jobs"
    assert [(r["rank"], r["trial"], r["lr"], r["val_miou"], r["status"], r["wall_s"]) for r in got["rows"]] == [
        (1, "t002", 0.01, 0.8, "Completed", 900.0),
        (2, "t000", 0.1, 0.5, "Completed", 900.0),
        (None, "t001", 0.03, None, "InProgress", 900.0),
    ]
    filters = sweep.search_filters(ENV, "roofs-lr")["Filters"]
    assert {"Name": "Tags.trainstack:env", "Operator": "Equals", "Value": "dev"} in filters


# ------------------------------------------------------------------------------------------------- synthesized
@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    return moto_env.synthesize(tmp_path_factory.mktemp("cdk-sweep"), github_repo=moto_env.GITHUB_REPO)


def test_deploy_role_may_run_sweeps(templates):
    from tests.infra_helpers import is_allowed, policy_statements, resolve

    acct, reg, env = moto_env.ACCOUNT, moto_env.REGION, moto_env.ENV
    st = policy_statements(templates["CiStack"], "GithubDeployRoleDefaultPolicy", acct, reg)
    tuning_job = f"arn:aws:sagemaker:{reg}:{acct}:hyper-parameter-tuning-job/trainstack-{env}-roofs-lr"
    for action in (
        "CreateHyperParameterTuningJob",
        "DescribeHyperParameterTuningJob",
        "ListTrainingJobsForHyperParameterTuningJob",
        "StopHyperParameterTuningJob",
        "AddTags",
    ):
        assert is_allowed(st, f"sagemaker:{action}", tuning_job), action
        assert not is_allowed(st, f"sagemaker:{action}", tuning_job.replace("trainstack-", "other-")), action
    machine = f"arn:aws:states:{reg}:{acct}:stateMachine:trainstack-{env}-train-g5-xlarge"
    assert is_allowed(st, "states:StartExecution", machine) and is_allowed(st, "states:DescribeStateMachine", machine)
    assert is_allowed(
        st, "states:DescribeExecution", f"arn:aws:states:{reg}:{acct}:execution:trainstack-{env}-train-g5-xlarge:r-1"
    )
    for action in ("Search", "ListHyperParameterTuningJobs", "ListTags"):  # sweep-status, teardown
        assert is_allowed(st, f"sagemaker:{action}", "*"), action
    role = f"arn:aws:iam::{acct}:role/trainstack-{env}-sagemaker-{reg}"
    assert is_allowed(st, "iam:PassRole", role, {"iam:PassedToService": "sagemaker.amazonaws.com"})
    assert not is_allowed(st, "iam:PassRole", role, {"iam:PassedToService": "ec2.amazonaws.com"})
    assert not is_allowed(st, "iam:PassRole", f"arn:aws:iam::{acct}:role/{env}-TrainingStack-InstanceRole1-X")
    # the role the training stack really creates (its name is set, not generated)
    sm_roles = [
        resolve(r["Properties"].get("RoleName"), acct, reg)
        for r in templates["TrainingStack"]["Resources"].values()
        if r["Type"] == "AWS::IAM::Role" and "sagemaker.amazonaws.com" in json.dumps(r["Properties"])
    ]
    assert sm_roles == [f"trainstack-{env}-sagemaker-{reg}"]


def test_state_machine_tags_training_jobs_with_env_run_and_sweep(templates):
    from tests.infra_helpers import state_machine_definitions

    defs = state_machine_definitions(templates["TrainingStack"])
    d = defs[f"trainstack-{moto_env.ENV}-train-g5-xlarge"]
    task = next(s for s in d["States"].values() if s.get("Resource", "").endswith("createTrainingJob.sync"))
    tags = {t["Key"]: t.get("Value", t.get("Value.$")) for t in task["Parameters"]["Tags"]}
    assert tags == {
        "trainstack:prefix": f"trainstack-{moto_env.ENV}",
        "trainstack:env": moto_env.ENV,
        "trainstack:run": "$.args.run_name",
        "trainstack:sweep": "$.args.sweep.sweep",
        "trainstack:trial": "$.args.sweep.trial",
        "trainstack:parameters": "$.args.sweep.parameters",
        "trainstack:objective": "$.args.sweep.objective",
    }
    defaults = next(s for k, s in d["States"].items() if k.startswith("Defaults"))
    assert defaults["Parameters"]["defaults"]["sweep"] == {"sweep": "", "trial": "", "parameters": "", "objective": ""}


def test_retry_failed_restarts_failed_trials_under_their_run_names():
    p = _plan(("grid", "lr=[0.1, 0.03, 0.01]"), strategy="jobs")
    now = dt.datetime(2026, 11, 26, 10, 0, tzinfo=dt.UTC)
    first = json.dumps(sweep.execution_input(p, 0, "3f2c1ab"))
    existing = [
        _execution("roofs-lr-t000-20261126-090000", "FAILED", now),
        _execution("roofs-lr-t001-20261126-090000", "SUCCEEDED", now),
    ]
    for retry, want in ((False, ["roofs-lr-t002"]), (True, ["roofs-lr-t000", "roofs-lr-t002"])):
        sfn, ecr = _client("stepfunctions"), _client("ecr")
        with Stubber(sfn) as s_sfn, Stubber(ecr) as s_ecr:
            _stub_existing(s_sfn, existing, first)
            s_ecr.add_response("describe_images", {"imageDetails": [{"imageDigest": "sha256:" + "c" * 64}]})
            names = []
            for i in range(len(want)):
                s_sfn.add_response("start_execution", {"executionArn": f"arn:x:{i}", "startDate": now})
            orig = sfn.start_execution
            sfn.start_execution = lambda names=names, orig=orig, **kw: (
                names.append(json.loads(kw["input"])["run_name"]) or orig(**kw)
            )
            got = sweep.submit_jobs(_aws(), _outputs(), p, "3f2c1ab", retry_failed=retry, sfn=sfn, ecr=ecr)
        assert names == want
        assert got["left"] == 0 and got["running"] == len(want)
        assert got["done"] == (2 if not retry else 1)


def _plan_file(tmp_path, fits: bool, batch_size: int = 16) -> str:
    """The shape ``python -m trainer plan --out`` writes (``batch_size``, ``rows`` of ``instance``/``fits``/
    ``errors``), with the ml.g5.xlarge row of a real plan of configs/seed001_roofs_gpu.yaml (1024 px, batch 16)."""
    error = "needs 622.6 GiB per GPU, has 22.4 GiB minus 10% margin: lower batch_size or raise accumulate_grad_batches"
    row = {"instance": "ml.g5.xlarge", "fits": fits, "memory_fits": fits, "errors": [] if fits else [error]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"batch_size": batch_size, "rows": [row]}))
    return str(path)


def test_plan_file_refuses_a_machine_that_does_not_fit_one_trial(tmp_path):
    p = _plan(("grid", "lr=[0.1, 0.03]"), strategy="jobs")
    with pytest.raises(CliError, match="one trial does not fit ml.g5.xlarge .needs 622.6 GiB per GPU"):
        sweep_plan.check_plan(p, _plan_file(tmp_path, fits=False))
    sweep_plan.check_plan(p, _plan_file(tmp_path, fits=True))  # fits: accepted
    big = _plan(("grid", "batch_size=[16, 32]"), strategy="jobs")
    with pytest.raises(CliError, match="planned for batch_size 16; trial t001 uses 32"):
        sweep_plan.check_plan(big, _plan_file(tmp_path, fits=True))
    sizes = _plan(("grid", "image_size=[512, 1024]"), strategy="jobs")
    with pytest.raises(CliError, match="varies image_size"):
        sweep_plan.check_plan(sizes, _plan_file(tmp_path, fits=True))
    other = sweep_plan.plan(ENV, "m", "train-m5-xlarge", ROOFS, {}, ["lr=[0.1]"], [])
    with pytest.raises(CliError, match="no row for ml.m5.xlarge"):
        sweep_plan.check_plan(other, _plan_file(tmp_path, fits=True))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CliError, match="not a plan"):
        sweep_plan.check_plan(p, str(tmp_path / "bad.json"))


def test_teardown_stops_this_environments_running_tuning_jobs_only():
    sm = _client("sagemaker")
    t0 = dt.datetime(2026, 11, 26, 10, 0, tzinfo=dt.UTC)
    arn = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:hyper-parameter-tuning-job/"

    def summary(name):
        return {
            "HyperParameterTuningJobName": name,
            "HyperParameterTuningJobArn": arn + name,
            "Strategy": "Grid",
            "HyperParameterTuningJobStatus": "InProgress",
            "CreationTime": t0,
            "TrainingJobStatusCounters": {},
            "ObjectiveStatusCounters": {},
        }

    for apply in (False, True):
        with Stubber(sm) as st:
            st.add_response(
                "list_hyper_parameter_tuning_jobs",
                {"HyperParameterTuningJobSummaries": [summary("trainstack-dev-a"), summary("trainstack-dev-x-b")]},
                {"NameContains": "trainstack-dev-", "StatusEquals": "InProgress"},
            )
            st.add_response(
                "list_tags",
                {"Tags": [{"Key": "trainstack:env", "Value": "dev"}]},
                {"ResourceArn": arn + "trainstack-dev-a"},
            )
            st.add_response(
                "list_tags",
                {"Tags": [{"Key": "trainstack:env", "Value": "dev-x"}]},
                {"ResourceArn": arn + "trainstack-dev-x-b"},
            )
            if apply:
                st.add_response(
                    "stop_hyper_parameter_tuning_job", {}, {"HyperParameterTuningJobName": "trainstack-dev-a"}
                )
            assert tuning.stop_tuning_jobs(_aws(), apply=apply, sm=sm) == ["trainstack-dev-a"]
            st.assert_no_pending_responses()


def test_sweep_status_command_prints_the_table_and_writes_the_results(monkeypatch, capsys, tmp_path):
    from infra.cli import main as main_mod
    from trainer.config.sweep import rank

    rows = [
        {"trial": "t000", "lr": 0.1, "val_miou": 0.5, "status": "Completed", "wall_s": 10.0},
        {"trial": "t001", "lr": 0.03, "val_miou": 0.7, "status": "Completed", "wall_s": 12.0},
    ]
    got = {
        "strategy": "jobs",
        "rows": rank(rows, "val_miou", "max"),
        "names": ["lr"],
        "metric": "val_miou",
        "mode": "max",
    }
    monkeypatch.setattr(main_mod, "open_session", lambda *a, **k: _aws())
    monkeypatch.setattr(main_mod, "load_outputs", lambda *a, **k: _outputs())
    monkeypatch.setattr(sweep, "gather", lambda aws, name: got)
    assert main(["--env", ENV, "sweep-status", "--name", "roofs-lr", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert out.index("| 1 | t001 | 0.03 | 0.7 |") < out.index("| 2 | t000 | 0.1 | 0.5 |")
    assert "jobs sweep roofs-lr: 2 trials" in out
    assert {p.name for p in (tmp_path / "r").iterdir()} == {"results.md", "results.json", "results.png"}


def test_a_trials_execution_input_renders_a_tagged_training_job(templates):
    """The deployed train-g5-xlarge state machine run by moto's Step Functions interpreter with the input
    ``sweep`` sends for trial t001: the CreateTrainingJob request (validated against botocore's model) carries
    the trial's hyperparameters, its own checkpoint prefix and the env/run/sweep tags sweep-status searches by."""
    import time

    from moto import mock_aws

    from tests.infra.test_infra_sagemaker_requests import _install_fake_sagemaker_sync

    p = sweep_plan.plan(moto_env.ENV, "roofs-lr", "train-g5-xlarge", ROOFS, {}, ["lr=[0.1, 0.03]"], [])
    mp = pytest.MonkeyPatch()
    try:
        moto_env.fake_credentials(mp)
        with mock_aws():
            moto_env.deploy(templates)
            sfn = boto3.client("stepfunctions", region_name=moto_env.REGION)
            arn = next(
                m["stateMachineArn"]
                for m in sfn.list_state_machines()["stateMachines"]
                if m["name"] == f"trainstack-{moto_env.ENV}-train-g5-xlarge"
            )
            d = sfn.describe_state_machine(stateMachineArn=arn)
        recorded: list[dict] = []
        with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
            sfn = boto3.client("stepfunctions", region_name=moto_env.REGION)
            _install_fake_sagemaker_sync(mp, recorded)
            arn = sfn.create_state_machine(name=d["name"], definition=d["definition"], roleArn=d["roleArn"])[
                "stateMachineArn"
            ]
            ex = sfn.start_execution(stateMachineArn=arn, input=json.dumps(sweep.execution_input(p, 1, "3f2c1ab")))[
                "executionArn"
            ]
            deadline = time.monotonic() + 60
            while (desc := sfn.describe_execution(executionArn=ex))["status"] == "RUNNING":
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert desc["status"] == "SUCCEEDED", desc.get("cause")
    finally:
        mp.undo()
    (req,) = recorded
    _valid(req, "CreateTrainingJob")
    assert req["HyperParameters"] == p.trial_hps[1] and req["HyperParameters"]["lr"] == "0.03"
    assert req["CheckpointConfig"]["S3Uri"].endswith("/checkpoints/roofs-lr-t001/g5-xlarge/")
    tags = {t["Key"]: t["Value"] for t in req["Tags"]}
    assert tags == {
        "trainstack:prefix": f"trainstack-{moto_env.ENV}",
        "trainstack:env": moto_env.ENV,
        "trainstack:run": "roofs-lr-t001",
        "trainstack:sweep": "roofs-lr",
        "trainstack:trial": "t001",
        "trainstack:parameters": "lr",
        "trainstack:objective": "val_miou max",
    }


def test_every_sweep_call_is_allowed_by_the_deploy_role(templates, monkeypatch, tmp_path):
    """The calls of sweep (both strategies), sweep-status (both), stop and teardown of tuning jobs, as the tests above
    make them, recorded as IAM actions on their resources and checked against the synthesized GitHub deploy role
    (tests.infra_helpers.CallRecorder / is_allowed, the way test_infra_iam.py checks teardown); plus the PassRole
    CreateHyperParameterTuningJob implies for its RoleArn, to sagemaker.amazonaws.com only."""
    from tests.infra_helpers import CallRecorder, is_allowed, policy_statements

    st = policy_statements(templates["CiStack"], "GithubDeployRoleDefaultPolicy", ACCOUNT, REGION)
    rec = CallRecorder()

    def recorded_client(name):
        c = boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name=REGION).client(name)
        c.meta.events.register("before-parameter-build.*.*", rec._hook)
        return c

    monkeypatch.setattr(sys.modules[__name__], "_client", recorded_client)
    test_submit_tuning_reads_the_state_machine_and_creates_one_tuning_job()
    test_jobs_strategy_starts_k_trials_then_tops_up_on_rerun()
    test_sweep_status_of_a_tuning_job_ranks_its_trials(tmp_path)
    test_sweep_status_of_a_jobs_sweep_searches_by_tags_and_keeps_other_envs_out()
    test_teardown_stops_this_environments_running_tuning_jobs_only()
    test_stop_names_a_tuning_job_of_this_environment()
    actions = {a for a, _ in rec.calls}
    assert {
        "sagemaker:CreateHyperParameterTuningJob",
        "sagemaker:DescribeHyperParameterTuningJob",
        "sagemaker:ListTrainingJobsForHyperParameterTuningJob",
        "sagemaker:Search",
        "sagemaker:ListHyperParameterTuningJobs",
        "sagemaker:ListTags",
        "sagemaker:StopHyperParameterTuningJob",
        "states:StartExecution",
        "states:DescribeStateMachine",
        "states:ListExecutions",
        "states:DescribeExecution",
        "ecr:DescribeImages",
    } <= actions
    assert rec.denied(st, ACCOUNT, REGION) == []
    roles = [p["TrainingJobDefinition"]["RoleArn"] for a, p in rec.calls if a.endswith("CreateHyperParameterTuningJob")]
    assert roles and all(
        is_allowed(st, "iam:PassRole", r, {"iam:PassedToService": "sagemaker.amazonaws.com"}) for r in roles
    )


def test_stop_names_a_tuning_job_of_this_environment():
    sm = _client("sagemaker")
    t0 = dt.datetime(2026, 11, 26, 10, 0, tzinfo=dt.UTC)
    name = "trainstack-dev-roofs-lr"
    arn = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:hyper-parameter-tuning-job/{name}"
    describe = {
        "HyperParameterTuningJobName": name,
        "HyperParameterTuningJobArn": arn,
        "HyperParameterTuningJobConfig": {"Strategy": "Grid", "ResourceLimits": {"MaxParallelTrainingJobs": 2}},
        "HyperParameterTuningJobStatus": "InProgress",
        "CreationTime": t0,
        "TrainingJobStatusCounters": {},
        "ObjectiveStatusCounters": {},
    }
    for env_tag, stopped in (("dev", True), ("dev-x", False)):
        with Stubber(sm) as st:
            st.add_response("describe_hyper_parameter_tuning_job", describe, {"HyperParameterTuningJobName": name})
            st.add_response("list_tags", {"Tags": [{"Key": "trainstack:env", "Value": env_tag}]}, {"ResourceArn": arn})
            if stopped:
                st.add_response("stop_hyper_parameter_tuning_job", {}, {"HyperParameterTuningJobName": name})
                assert "stopping tuning job" in tuning.stop_tuning_job(_aws(), name, sm=sm)
            else:
                with pytest.raises(CliError, match="not tagged trainstack:env=dev"):
                    tuning.stop_tuning_job(_aws(), name, sm=sm)
            st.assert_no_pending_responses()
    with Stubber(sm) as st:  # no such tuning job: a training job name, left to jobs.stop_run
        st.add_client_error("describe_hyper_parameter_tuning_job", "ResourceNotFound", "no such job")
        assert tuning.stop_tuning_job(_aws(), "trainstack-dev-g5-1a2b3c", sm=sm) is None
    assert tuning.stop_tuning_job(_aws(), "trainstack-dev-g5-xlarge-1a2b3c4d-long", sm=sm) is None  # > 32: no call
