"""Faults AWS documents, injected into the emulated account's answers: throttling, lost answers, eventual consistency.

:class:`Faults` is a WSGI middleware around moto's server app (:mod:`tests.e2e.emulator_server` wraps it when
``TRAINSTACK_E2E_FAULTS`` names a rules file). Each rule names a service and operation, optionally a caller (a
substring of the User-Agent: ``Boto3/`` for our CLI, ``aws-sdk-js`` for the CDK CLI) and a substring of the request
path (an S3 key such as ``jobs/``), and which matching call (``nth``, 1-based) gets the fault:

- ``throttle``: the service's throttling answer, not run: EC2 ``RequestLimitExceeded`` (HTTP 503, as botocore's
  ``_retry.json`` expects it for EC2; EC2 developer guide, "Request throttling for the Amazon EC2 API"), S3
  ``SlowDown`` 503 (Amazon S3 user guide, "Amazon S3 error best practices"), ``ThrottlingException`` 400 for the
  JSON services (SSM, CloudWatch Logs, ...), ``Throttling`` 400 for the query services (CloudFormation, STS, IAM),
  Lambda's ``TooManyRequestsException`` 429;
- ``lost``: the call runs, then its answer is replaced by HTTP 500 ``InternalError`` (the answer that never
  arrived: the caller cannot tell whether it took effect; S3 user guide, "Retry InternalErrors");
- ``not_found_new``: an EC2 call naming an instance that a RunInstances answered with and that no call named
  since gets ``InvalidInstanceID.NotFound`` (EC2 developer guide, "Eventual consistency in the Amazon EC2 API").

Whatever the rules, RunInstances is idempotent per ``ClientToken`` as in EC2 (EC2 developer guide, "Ensuring
idempotency in Amazon EC2 API requests"; moto creates another instance): a repeat with a token already answered
gets the first answer and creates nothing.

Requests whose User-Agent carries :data:`CHECK_AGENT` (the tests' own reads) are never faulted nor counted. Every
injected fault is written to ``TRAINSTACK_E2E_FAULTS_SEEN`` (a JSON list, rewritten after each change): the rule's
``name``, the call, the fault, and ``retried`` (the next call of the same operation by the same caller, with the
HTTP status it got), so a test can assert that each fault was hit and absorbed.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import parse_qs

#: User-Agent marker of the tests' own clients (``Emulator.client``): their calls are never faulted.
CHECK_AGENT = "trainstack-e2e-check"
FAULTS = ("throttle", "lost", "not_found_new")
_SCOPE = re.compile(r"Credential=[^/]+/\d{8}/[^/]+/([^/]+)/aws4_request")
_INSTANCE = re.compile(rb"<instanceId>(i-[0-9a-f]+)</instanceId>")


def identify(environ: dict, body: bytes) -> tuple[str, str, dict]:
    """(service, operation, query parameters) of one request: the service from the SigV4 credential scope, the
    operation from ``X-Amz-Target`` (JSON protocols), ``Action=`` (query protocols: EC2, CloudFormation, STS, IAM),
    or for S3 the method and path (``PutObject``, ``GetObject``, ...; ``Bucket<METHOD>`` without a key)."""
    auth = environ.get("HTTP_AUTHORIZATION", "") or environ.get("QUERY_STRING", "")
    m = _SCOPE.search(auth) or re.search(r"X-Amz-Credential=[^%&]+%2F\d{8}%2F[^%]+%2F([^%]+)%2F", auth)
    service = m.group(1) if m else ""
    target = environ.get("HTTP_X_AMZ_TARGET", "")
    if target:
        return service, target.rsplit(".", 1)[-1], {}
    params = parse_qs(environ.get("QUERY_STRING", ""))
    if "x-www-form-urlencoded" in environ.get("CONTENT_TYPE", ""):
        params.update(parse_qs(body.decode("utf-8", "replace")))
    if "Action" in params:
        return service, params["Action"][0], params
    if service == "s3":
        path = environ.get("PATH_INFO", "").lstrip("/")
        virtual = environ.get("HTTP_HOST", "").split(":")[0].endswith(".localhost")  # bucket.localhost
        key = path if virtual else path.split("/", 1)[1] if "/" in path else ""
        method = environ.get("REQUEST_METHOD", "GET")
        if not key:
            return service, f"Bucket{method.title()}", params
        if "uploadId" in params or "partNumber" in params or "uploads" in params:
            return service, f"Multipart{method.title()}", params
        names = {"PUT": "PutObject", "GET": "GetObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}
        return service, names.get(method, f"Object{method.title()}"), params
    return service, f"{environ.get('REQUEST_METHOD', '')} {environ.get('PATH_INFO', '')}", params


def error_answer(service: str, protocol: str, status: int, code: str, message: str) -> tuple[str, list, bytes]:
    """(status line, headers, body) of an AWS error answer in the protocol the caller parses."""
    rid = str(uuid.uuid4())
    if protocol == "json":
        body = json.dumps({"__type": code, "message": message}).encode()
        headers = [("Content-Type", "application/x-amz-json-1.1"), ("x-amzn-RequestId", rid)]
    elif protocol == "rest-json":
        body = json.dumps({"message": message}).encode()
        headers = [("Content-Type", "application/json"), ("x-amzn-ErrorType", code), ("x-amzn-RequestId", rid)]
    elif service == "s3":
        body = f"<Error><Code>{code}</Code><Message>{message}</Message><RequestId>{rid}</RequestId></Error>".encode()
        headers = [("Content-Type", "application/xml"), ("x-amz-request-id", rid)]
    elif service == "ec2":
        body = (
            f"<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors>"
            f"<RequestID>{rid}</RequestID></Response>"
        ).encode()
        headers = [("Content-Type", "text/xml")]
    else:
        kind = "Receiver" if status >= 500 else "Sender"
        body = (
            f"<ErrorResponse><Error><Type>{kind}</Type><Code>{code}</Code><Message>{message}</Message></Error>"
            f"<RequestId>{rid}</RequestId></ErrorResponse>"
        ).encode()
        headers = [("Content-Type", "text/xml")]
    reasons = {400: "Bad Request", 429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}
    return f"{status} {reasons.get(status, 'Error')}", [*headers, ("Content-Length", str(len(body)))], body


def throttle_answer(service: str, protocol: str) -> tuple[int, str, str]:
    """(HTTP status, code, message) of ``service``'s documented throttling answer."""
    if service == "ec2":
        return 503, "RequestLimitExceeded", "Request limit exceeded."
    if service == "s3":
        return 503, "SlowDown", "Please reduce your request rate."
    if service == "lambda":
        return 429, "TooManyRequestsException", "Rate exceeded"
    if protocol == "json":
        return 400, "ThrottlingException", "Rate exceeded"
    return 400, "Throttling", "Rate exceeded"


class Faults:
    """The middleware: ``Faults(app, rules, seen_path)``; ``rules`` is a list of dicts with ``name``, ``service``,
    ``operation``, ``fault`` (one of :data:`FAULTS`) and optionally ``agent``, ``path`` (substrings of the
    User-Agent and of the request path) and ``nth`` (default 1). Raises ValueError for a rule without those."""

    def __init__(self, app, rules: list[dict], seen_path: Path | None = None):
        for r in rules:
            missing = [k for k in ("name", "service", "operation", "fault") if k not in r]
            if missing or r["fault"] not in FAULTS:
                raise ValueError(f"fault rule {r}: needs name, service, operation and fault in {FAULTS}")
        self.app, self.rules, self.seen_path = app, rules, seen_path
        self.calls = [0] * len(rules)
        self.seen: list[dict] = []
        self.tokens: dict[str, tuple[str, list, bytes]] = {}  # RunInstances ClientToken -> its answer
        self.fresh: set[str] = set()  # instances a RunInstances answered with that no call named since
        self.lock = threading.Lock()
        self._write()

    @classmethod
    def from_env(cls, app) -> Faults:
        """The middleware around ``app`` with the rules of ``TRAINSTACK_E2E_FAULTS`` (a JSON file; none when unset)
        and its record at ``TRAINSTACK_E2E_FAULTS_SEEN`` (none when unset)."""
        rules, seen = os.environ.get("TRAINSTACK_E2E_FAULTS"), os.environ.get("TRAINSTACK_E2E_FAULTS_SEEN")
        return cls(app, json.loads(Path(rules).read_text()) if rules else [], Path(seen) if seen else None)

    def _write(self) -> None:
        if self.seen_path is None:
            return
        tmp = self.seen_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.seen, indent=1))
        tmp.replace(self.seen_path)

    def _run(self, environ: dict) -> tuple[str, list, bytes]:
        got: dict = {}

        def start_response(status, headers, exc_info=None):
            got["status"], got["headers"] = status, list(headers)
            return lambda data: got.setdefault("early", []).append(data)

        result = self.app(environ, start_response)
        try:
            body = b"".join(got.get("early", [])) + b"".join(result)
        finally:
            if hasattr(result, "close"):
                result.close()
        return got["status"], got["headers"], body

    def __call__(self, environ, start_response):
        body, length = b"", int(environ.get("CONTENT_LENGTH") or 0)
        if length and "x-www-form-urlencoded" in environ.get("CONTENT_TYPE", ""):  # query protocols: Action=
            body = environ["wsgi.input"].read(length)
            environ["wsgi.input"] = io.BytesIO(body)
        agent = environ.get("HTTP_USER_AGENT", "") + " " + environ.get("HTTP_X_AMZ_USER_AGENT", "")
        if CHECK_AGENT in agent:
            return self.app(environ, start_response)
        service, operation, params = identify(environ, body)
        protocol = "json" if environ.get("HTTP_X_AMZ_TARGET") else "query" if "Action" in params else "rest-json"
        named = {v[0] for k, v in params.items() if re.fullmatch(r"InstanceId(\.\d+)?", k)}
        token = params.get("ClientToken", [None])[0] if operation == "RunInstances" else None
        with self.lock:
            retry_of = [  # the first later call of a faulted operation by the same caller: its retry
                e
                for e in self.seen
                if e["retried"] is None
                and (e["service"], e["operation"]) == (service, operation)
                and e["agent"] in agent
            ]
            for e in retry_of:
                e["retried"] = {"at": time.time()}
            fault = None
            for i, rule in enumerate(self.rules):
                if (rule["service"], rule["operation"]) != (service, operation):
                    continue
                if rule.get("agent", "") not in agent or rule.get("path", "") not in environ.get("PATH_INFO", ""):
                    continue
                if rule["fault"] == "not_found_new" and not (named & self.fresh):
                    continue
                self.calls[i] += 1
                if self.calls[i] == rule.get("nth", 1) and fault is None:
                    fault = rule
            stale = named & self.fresh
            self.fresh -= named
            cached = self.tokens.get(token) if token else None
        if cached is not None:
            status, headers, answer = cached
        elif fault is not None and fault["fault"] != "lost":
            if fault["fault"] == "throttle":
                code_status, code, message = throttle_answer(service, protocol)
            else:
                code_status, code, message = (
                    400,
                    "InvalidInstanceID.NotFound",
                    (f"The instance ID '{sorted(stale)[0]}' does not exist"),
                )
            status, headers, answer = error_answer(service, protocol, code_status, code, message)
        else:
            status, headers, answer = self._run(environ)
            if operation == "RunInstances" and status.startswith("200"):
                with self.lock:
                    self.fresh |= {m.decode() for m in _INSTANCE.findall(answer)}
                    if token:
                        self.tokens[token] = (status, headers, answer)
            if fault is not None:  # it ran; its answer is lost on the way back
                message = "We encountered an internal error. Please try again."
                status, headers, answer = error_answer(service, protocol, 500, "InternalError", message)
        with self.lock:
            for e in retry_of:
                e["retried"].update(status=int(status.split()[0]), faulted=fault is not None)
            if fault is not None:
                self.seen.append(
                    {
                        "name": fault["name"], "fault": fault["fault"], "service": service, "operation": operation,
                        "agent": fault.get("agent", ""), "status": int(status.split()[0]),
                        "path": environ.get("PATH_INFO", ""), "at": time.time(), "retried": None,
                    }
                )  # fmt: skip
            self._write()
        start_response(status, headers)
        return [answer]
