"""boto3 session, credential and region checks, and AWS errors turned into one clear line plus the next step.

Every command goes through :func:`open_session` and :func:`explain`, so "no credentials", "wrong region",
"stack not deployed", "image missing" and capacity/spot errors read the same everywhere: one line
``error: WHAT; next: WHAT TO DO``. :func:`unreachable` does the same for network errors (exit 75).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import boto3
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

#: botocore's "no answer from the endpoint" errors (refused, DNS, timeouts, TLS, proxy, dropped connections).
NETWORK_ERRORS = (BotoConnectionError, HTTPClientError)

#: EC2 errors after which another try (later, elsewhere, on-demand) may succeed.
CAPACITY_ERRORS = {
    "InsufficientInstanceCapacity": "EC2 has no {what} capacity in this AZ right now",
    "SpotMaxPriceTooLow": "the spot price for {what} is above the launch template's max price",
    "MaxSpotInstanceCountExceeded": "the account's spot instance request limit is reached",
    "VcpuLimitExceeded": "the account's vCPU quota for {what} is used up",
    "InstanceLimitExceeded": "the account's instance limit for {what} is reached",
    "Unsupported": "{what} is not offered in this AZ",
}
_CAPACITY_HINTS = {
    "InsufficientInstanceCapacity": "retry in a few minutes, add --on-demand-fallback, or pick another type "
    "(`python -m trainer plan` ranks them)",
    "SpotMaxPriceTooLow": "add --on-demand-fallback, or redeploy with -c spot_max_price_fraction=1.0",
    "MaxSpotInstanceCountExceeded": "cancel open spot requests (`python -m infra teardown`) or ask for a "
    "quota increase in Service Quotas",
    "VcpuLimitExceeded": "ask for a quota increase in Service Quotas ('All P/G Spot Instance Requests' or the "
    "on-demand one), or use a smaller type",
    "InstanceLimitExceeded": "ask for a quota increase in Service Quotas",
    "Unsupported": "redeploy in another AZ (-c availability_zone=...) or pick another type",
}


class CliError(Exception):
    """A failure the user can act on: ``message`` says what, ``hint`` says what to do next."""

    def __init__(self, message: str, hint: Optional[str] = None, code: int = 2):
        super().__init__(message)
        self.message, self.hint, self.code = message, hint, code

    def __str__(self) -> str:
        return self.message + (f"; next: {self.hint}" if self.hint else "")


@dataclass
class Aws:
    """An open session: ``session`` (boto3.Session), ``region``, ``account`` (str), ``env`` (environment name)."""

    session: boto3.Session
    region: str
    account: str
    env: str

    def client(self, name: str):
        return self.session.client(name, region_name=self.region)


def open_session(env: str, region: Optional[str] = None, profile: Optional[str] = None) -> Aws:
    """Open a session and check it can talk to AWS (``sts:GetCallerIdentity``).

    Raises CliError for no/partial credentials, no region, or a region name AWS does not have.
    """
    try:
        session = boto3.Session(profile_name=profile, region_name=region)
    except Exception as e:  # botocore.exceptions.ProfileNotFound and friends
        raise CliError(f"AWS profile problem: {e}", "check --profile / AWS_PROFILE against ~/.aws/config") from None
    region = session.region_name
    if not region:
        raise CliError("no AWS region configured", "pass --region us-east-1 or set AWS_REGION")
    known = set(session.get_available_regions("ec2")) | set(session.get_available_regions("ec2", "aws-cn"))
    if known and region not in known:
        raise CliError(f"unknown AWS region {region!r}", f"use one of: {', '.join(sorted(known)[:8])}, ...")
    try:
        ident = session.client("sts", region_name=region).get_caller_identity()
    except (NoCredentialsError, PartialCredentialsError):
        raise CliError(
            "no AWS credentials found",
            "run `aws configure` or `aws sso login`, set AWS_PROFILE, or in GitHub Actions use "
            "aws-actions/configure-aws-credentials with role-to-assume",
        ) from None
    except NoRegionError:
        raise CliError("no AWS region configured", "pass --region or set AWS_REGION") from None
    except ClientError as e:
        raise explain(e, "checking credentials") from None
    except NETWORK_ERRORS as e:
        raise unreachable(e, region, changed=False) from None
    except BotoCoreError as e:  # expired SSO token, credential process failing, bad config file, ...
        raise CliError(
            f"AWS credentials could not be loaded: {_one_line(e)}",
            "refresh them (`aws sso login`) or check AWS_PROFILE / ~/.aws/config",
        ) from None
    return Aws(session, region, ident["Account"], env)


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def unreachable(err: Exception, region: Optional[str] = None, changed: Optional[bool] = None) -> CliError:
    """A CliError with exit 75 (transient: rerun later) for a botocore network error ``err``.

    The message names the endpoint URL botocore tried and ``region``; the hint lists what to check (network,
    proxy variables, ``AWS_ENDPOINT_URL*`` overrides when set, ``--region``). ``changed=False`` says nothing
    was changed yet (the failure came before any write); otherwise the hint points to ``status`` first.
    """
    url = getattr(err, "kwargs", {}).get("endpoint_url") or "the AWS endpoint"
    where = url + (f" (region {region})" if region else "")
    overrides = sorted(k for k in os.environ if k == "AWS_ENDPOINT_URL" or k.startswith("AWS_ENDPOINT_URL_"))
    checks = ["the network connection", "HTTPS_PROXY/NO_PROXY", *overrides, "--region"]
    then = (
        "then rerun (nothing was changed)"
        if changed is False
        else "then run `python -m infra status` before rerunning: the request may have been applied"
    )
    return CliError(f"cannot reach {where}: {type(err).__name__}", f"check {', '.join(checks)}; {then}", code=75)


def explain(err: ClientError, doing: str, what: str = "", env: Optional[str] = None) -> CliError:
    """Turn a botocore ClientError into a CliError naming what failed and the next option.

    ``env`` (the environment name) makes the "deploy it" hint a command that can be pasted as is.
    """
    code = err.response.get("Error", {}).get("Code", "")
    msg = err.response.get("Error", {}).get("Message", str(err))
    if code in CAPACITY_ERRORS:
        return CliError(
            f"{doing}: {CAPACITY_ERRORS[code].format(what=what or 'this type')} ({code}: {msg})",
            _CAPACITY_HINTS[code],
            code=75,
        )
    if code in (
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "AuthFailure",
        "SignatureDoesNotMatch",
    ):
        return CliError(
            f"{doing}: AWS rejected the credentials ({code})",
            "refresh them (`aws sso login`) or check the region: some accounts only enable some regions",
        )
    if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation"):
        return CliError(
            f"{doing}: not allowed ({code}): {msg}",
            "use a role with this permission (the deploy "
            "role of infra/constructs/github_oidc.py has what the CLI needs)",
        )
    if code == "ValidationError" and "does not exist" in msg:
        deploy = "npx cdk deploy TrainingStack" + (f" -c env={env}" if env else "")
        return CliError(f"{doing}: {msg}", f"deploy it: `{deploy}` (or pass the --region it was deployed in)")
    if code in ("RepositoryNotFoundException", "ImageNotFoundException"):
        return CliError(f"{doing}: {msg}", "build and push it: `python -m infra push-image`")
    if code == "ResourceLimitExceeded":
        return CliError(
            f"{doing}: SageMaker quota reached: {msg}",
            "ask for a quota increase ('... for spot "
            "training job usage') or stop a running job (`python -m infra stop JOB`)",
        )
    return CliError(f"{doing}: {code}: {msg}")
