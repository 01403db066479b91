"""AssumeRoleWithWebIdentity on the local AWS emulator for the configure-aws-credentials stand-in (action.yml).

Inputs come from the environment action.yml sets (ROLE_TO_ASSUME, REGION, AUDIENCE, ROLE_SESSION_NAME,
ROLE_DURATION_SECONDS) and act's GITHUB_* variables; AWS_ENDPOINT_URL must name the emulator (the stand-in never
calls AWS itself). boto3 when importable, else the AWS CLI. Before assuming the role it checks what AWS STS
checks and moto does not: the role exists, its trust policy admits this token (an Allow of
sts:AssumeRoleWithWebIdentity for a Federated principal of GitHub's provider whose conditions, StringEquals or
StringLike on the token's aud and sub, all hold; other conditions count as not met), that provider exists and
the duration is within the role's MaxSessionDuration. The credentials go to GITHUB_ENV, masked first
(``::add-mask::``), the account to GITHUB_OUTPUT.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from urllib.parse import unquote

ISSUER = "token.actions.githubusercontent.com"
#: operation -> (boto3 method, AWS CLI command)
OPERATIONS = {
    "GetRole": ("get_role", "get-role"),
    "GetOpenIDConnectProvider": ("get_open_id_connect_provider", "get-open-id-connect-provider"),
    "AssumeRoleWithWebIdentity": ("assume_role_with_web_identity", "assume-role-with-web-identity"),
}


class Fail(Exception):
    """What to report as the step's ::error:: line."""


#: the real action's default session name (src/index.ts ROLE_SESSION_NAME)
ROLE_SESSION_NAME = "GitHubActions"


def check_names(region: str, session_name: str) -> None:
    """Refuse what configure-aws-credentials@v6 refuses before calling STS (src/index.ts: REGION_REGEX, the role
    session name's length and ROLE_SESSION_NAME_REGEX), with its messages. Raises Fail."""
    if not re.fullmatch(r"[a-z0-9-]+", region):
        raise Fail(f"Region is not valid: {region}")
    if not 2 <= len(session_name) <= 64:
        raise Fail(f"Role session name must be between 2 and 64 characters, got {len(session_name)}: '{session_name}'")
    if not re.fullmatch(r"[\w+=,.@-]*", session_name, re.ASCII):
        raise Fail(
            f"Role session name is not valid: '{session_name}'. Must satisfy regular expression pattern: [\\w+=,.@-]*"
        )


def github_claims(env, audience: str) -> dict:
    """The claims of GitHub's token for this job; sub as GitHub forms it without a deployment environment."""
    repo, event, ref = env.get("GITHUB_REPOSITORY", ""), env.get("GITHUB_EVENT_NAME", ""), env.get("GITHUB_REF", "")
    sub = f"repo:{repo}:pull_request" if event in ("pull_request", "pull_request_target") else f"repo:{repo}:ref:{ref}"
    now = int(time.time())
    return {
        "iss": f"https://{ISSUER}",
        "aud": audience,
        "sub": sub,
        "repository": repo,
        "repository_owner": repo.split("/")[0],
        "ref": ref,
        "sha": env.get("GITHUB_SHA", ""),
        "event_name": event,
        "workflow": env.get("GITHUB_WORKFLOW", ""),
        "actor": env.get("GITHUB_ACTOR", ""),
        "run_id": env.get("GITHUB_RUN_ID", ""),
        "jti": str(uuid.uuid4()),
        "iat": now,
        "nbf": now,
        "exp": now + 300,
    }


def unsigned_jwt(claims: dict) -> str:
    """A JWT with alg "none" and an empty signature (GitHub's are RS256-signed)."""

    def part(obj) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj, separators=(",", ":")).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}."


def _list(value) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def _like(pattern: str, value: str) -> bool:
    """IAM StringLike: ``*`` any run of characters, ``?`` one character."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value, re.S) is not None


def trusted_provider(policy: dict, claims: dict) -> tuple[str | None, list[str]]:
    """The provider ARN of the first statement that admits the token, else None and why each statement does not."""
    reasons = []
    for i, st in enumerate(_list(policy.get("Statement"))):
        principal = st.get("Principal")
        federated = _list(principal.get("Federated")) if isinstance(principal, dict) else []
        providers = [p for p in federated if isinstance(p, str) and p.endswith(f":oidc-provider/{ISSUER}")]
        actions = [a.lower() for a in _list(st.get("Action"))]
        if st.get("Effect") != "Allow" or not providers:
            reasons.append(f"statement {i} allows no Federated principal of {ISSUER}")
            continue
        if not any(_like(a, "sts:assumerolewithwebidentity") for a in actions):
            reasons.append(f"statement {i} does not allow sts:AssumeRoleWithWebIdentity")
            continue
        unmet = []
        for op, pairs in (st.get("Condition") or {}).items():
            for key, wanted in pairs.items():
                claim = key.split(":", 1)[1] if key.startswith(f"{ISSUER}:") else None
                value = str(claims.get(claim, ""))
                if op not in ("StringEquals", "StringLike") or claim is None:
                    unmet.append(f"{op} {key} (not evaluated by the stand-in)")
                elif not any(v == value if op == "StringEquals" else _like(v, value) for v in _list(wanted)):
                    unmet.append(f"{op} {key} {_list(wanted)} does not admit {value!r}")
        if not unmet:
            return providers[0], []
        reasons.append(f"statement {i}: " + "; ".join(unmet))
    return None, reasons


def aws(operation: str, region: str, **params) -> dict:
    """One IAM/STS call on the endpoint AWS_ENDPOINT_URL: boto3, else the AWS CLI; errors raise Fail."""
    service = "sts" if operation.startswith("Assume") else "iam"
    method, command = OPERATIONS[operation]
    try:
        import boto3
        import botocore.exceptions
    except ImportError:
        cli = shutil.which("aws")
        if cli is None:
            raise Fail("neither boto3 (workspace .venv or python3) nor the AWS CLI is available") from None
        args = [cli, service, command, "--region", region, "--output", "json", "--cli-input-json", json.dumps(params)]
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode:
            raise Fail(f"aws {service} {command}: {done.stderr.strip()}") from None
        return json.loads(done.stdout or "{}")
    try:
        return getattr(boto3.client(service, region_name=region), method)(**params)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
        raise Fail(f"{service} {operation}: {e}") from None


def main(env=os.environ) -> None:
    role = env.get("ROLE_TO_ASSUME", "").strip()
    region = env.get("REGION", "").strip()
    if not role:
        raise Fail("input role-to-assume is empty (the workflows pass vars.AWS_DEPLOY_ROLE_ARN: act --var)")
    if not region:
        raise Fail("input aws-region is empty (the workflows pass vars.AWS_REGION: act --var)")
    check_names(region, env.get("ROLE_SESSION_NAME") or ROLE_SESSION_NAME)
    if not env.get("AWS_ENDPOINT_URL"):
        raise Fail("AWS_ENDPOINT_URL is not set: the stand-in only talks to the local emulator")
    match = re.fullmatch(r"arn:aws[\w-]*:iam::(\d{12}):role/(?:[\w+=,.@/-]*/)?([\w+=,.@-]+)", role)
    if not match:
        raise Fail(f"role-to-assume {role!r} is not an IAM role ARN")
    claims = github_claims(env, env.get("AUDIENCE") or "sts.amazonaws.com")
    if not claims["repository"]:
        raise Fail("GITHUB_REPOSITORY is empty: the token's sub needs OWNER/NAME")
    found = aws("GetRole", region, RoleName=match.group(2))["Role"]
    policy = found["AssumeRolePolicyDocument"]
    policy = json.loads(unquote(policy)) if isinstance(policy, str) else policy
    provider, reasons = trusted_provider(policy, claims)
    if provider is None:
        raise Fail(
            f"the trust policy of {role} does not admit aud {claims['aud']!r}, sub {claims['sub']!r}: "
            + " | ".join(reasons)
        )
    aws("GetOpenIDConnectProvider", region, OpenIDConnectProviderArn=provider)
    duration = int(env.get("ROLE_DURATION_SECONDS") or 3600)
    if duration > int(found.get("MaxSessionDuration", 3600)):
        raise Fail(
            f"role-duration-seconds {duration} exceeds the role's MaxSessionDuration {found['MaxSessionDuration']}"
        )
    token = unsigned_jwt(claims)
    got = aws(
        "AssumeRoleWithWebIdentity",
        region,
        RoleArn=role,
        WebIdentityToken=token,
        DurationSeconds=duration,
        RoleSessionName=env.get("ROLE_SESSION_NAME") or ROLE_SESSION_NAME,
    )
    creds, arn = got["Credentials"], got["AssumedRoleUser"]["Arn"]
    secret = {
        "AWS_ACCESS_KEY_ID": creds["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": creds["SecretAccessKey"],
        "AWS_SESSION_TOKEN": creds["SessionToken"],
    }
    for value in secret.values():
        print(f"::add-mask::{value}", flush=True)
    with open(env["GITHUB_ENV"], "a") as f:
        for key, value in {**secret, "AWS_REGION": region, "AWS_DEFAULT_REGION": region}.items():
            f.write(f"{key}={value}\n")
    with open(env["GITHUB_OUTPUT"], "a") as f:
        f.write(f"aws-account-id={arn.split(':')[4]}\n")
    print(f"assumed {role} as {arn} with sub {claims['sub']} on {env['AWS_ENDPOINT_URL']}, region {region}")


if __name__ == "__main__":
    try:
        main()
    except Fail as e:
        print(f"::error::configure-aws-credentials stand-in: {e}", flush=True)
        sys.exit(1)
