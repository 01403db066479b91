"""``python -m infra``: operate a deployed environment with boto3.

    python -m infra [--env NAME] [--region R] [--profile P] COMMAND ...
      push-image   build images/training/Dockerfile (docker, podman or buildah), push to the stack's ECR repository
                   tagged with the commit, print the pushed digest
      launch TYPE  run a spot instance from the stack's launch template (--on-demand-fallback to fall back)
      submit       start a managed-spot SageMaker run through the stack's state machine
      sweep        a hyperparameter sweep: managed-spot jobs (at most K running; rerun to top up) or one
                   SageMaker tuning job (--strategy tuning); --dry-run prints the requests, no AWS call
      sweep-status a sweep's trials ranked by its metric: results.md/json/png in --out, the table on stdout
      status       instances, executions and training jobs of the environment (or one of them; an EC2 job:
                   its attempts, time lost per interruption, spend against its cap)
      logs TARGET  CloudWatch log tail of an EC2 job (across its instances), an instance or a training job
      stop TARGET  stop one EC2 job (and its recovery), instance, execution, training job or tuning job
      teardown     find (and with --yes remove) everything that still bills: instances, spot requests, volumes,
                   running executions and tuning jobs
                   (--wait: until the instances are terminated and the data volume detached)
      cost         what is running and what it has cost so far

Resource names come from the stacks' outputs. Every error is one line on stderr, ``error: WHAT; next: WHAT TO
DO``. Exit codes: 0 done; 2 bad input or an AWS refusal that a rerun will not fix (credentials, permissions,
stack not deployed, invalid --env); 75 transient: capacity or spot refusals, and AWS unreachable (no network,
DNS, proxy, timeouts) -- try again later or with the suggested option.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from botocore.exceptions import BotoCoreError

from catalog import CatalogError
from infra.cli import costs, ec2_jobs, image, instances, jobs, logs, sweep, sweep_plan, tuning
from infra.cli.outputs import load as load_outputs
from infra.cli.parser import build_parser
from infra.cli.session import NETWORK_ERRORS, CliError, open_session, unreachable
from infra.config import ENV_RE, ENV_RULE

REPO = Path(__file__).resolve().parents[2]


def _kv(pairs: list[str]) -> dict[str, str]:
    out = {}
    for item in pairs:
        if "=" not in item:
            raise CliError(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip().replace("-", "_")] = v
    return out


def _print_table(rows: list[dict], cols: list[str]) -> None:
    if not rows:
        print("  (none)")
        return
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  " + "  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  " + "  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))


def _recovery_line(args: argparse.Namespace, env: str) -> str:
    """What the recovery controller will do for a launched job (launch's last line)."""
    if args.no_recover:
        return "recovery: off (--no-recover): an interruption ends the job"
    ladder = ", then ".join(
        ["spot retries with backoff"]
        + ([f"fallback types {','.join(args.fallback_types)}"] if args.fallback_types else [])
        + (["on-demand"] if args.on_demand_fallback else [])
    )
    cap = f"${args.max_cost_usd:g}" if args.max_cost_usd else "no cost cap"
    return (
        f"recovery: on: after an interruption the job is relaunched from its checkpoint ({ladder}); at most "
        f"{args.max_recoveries} recoveries, {cap}; status: python -m infra --env {env} status {args.job}; "
        f"stop: python -m infra --env {env} stop {args.job}"
    )


def _ec2_job(aws, outputs, target: Optional[str]):
    """The record of EC2 job ``target`` (None when ``target`` is an instance, ARN, SageMaker job or no job)."""
    if not target or target.startswith(("i-", "arn:", f"trainstack-{aws.env}-")):
        return None
    return ec2_jobs.load(aws, outputs, target)


def run(args: argparse.Namespace) -> int:
    """Run one command: first the checks that need no AWS call, then the session, the stack outputs, the work."""
    planned = None
    if args.command == "submit":
        jobs.check_request(args.run_name, args.config, _kv(args.set), args.data, args.instance_count)
    elif args.command == "launch":
        instances.check_request(args.instance_type, args.job, args.fallback_types)
    elif args.command == "sweep":  # every trial validated before any AWS call
        planned = sweep_plan.plan(
            args.env,
            args.name,
            args.machine,
            args.config,
            _kv(args.set),
            args.grid,
            args.range,
            args.random,
            args.sweep_seed,
            args.metric,
            args.strategy,
            args.tuning_strategy,
            args.max_parallel,
            args.data,
        )
        if args.plan:
            sweep_plan.check_plan(planned, args.plan)
    if args.command in ("launch", "submit", "sweep") and not args.image_tag:
        args.image_tag = image.git_tag(REPO)  # immutable: a restarted or resubmitted job runs the same image
    if planned is not None and args.dry_run:
        print(json.dumps(sweep.dry_run(planned, args.image_tag), indent=1))
        return 0
    aws = open_session(args.env, args.region, args.profile)
    # teardown must also clean up after a deploy that rolled back or a stack deleted half-way
    outputs = load_outputs(aws, partial=args.command == "teardown")
    cmd = args.command
    if cmd == "push-image":
        print(
            f"pushed {image.push_image(aws, outputs, REPO, args.tag, args.base_image, args.builder, ca_bundle=args.ca_bundle, archs=args.archs)}"
        )
    elif cmd == "launch":
        got = instances.launch(
            aws,
            outputs,
            args.instance_type,
            args.job,
            args.config,
            args.image_tag,
            args.args,
            args.keep,
            args.on_demand_fallback,
            recover=not args.no_recover,
            fallback_types=args.fallback_types,
            max_recoveries=args.max_recoveries,
            max_cost_usd=args.max_cost_usd,
        )
        print(
            f"launched {got.instance_id} ({args.instance_type}, {got.market}, launch template version "
            f"{got.version}); logs: python -m infra --env {aws.env} logs {args.job} --follow"
        )
        print(_recovery_line(args, aws.env))
    elif cmd == "submit":
        arn = jobs.submit(
            aws,
            outputs,
            args.machine,
            args.run_name,
            args.image_tag,
            args.config,
            _kv(args.set),
            args.data,
            args.instance_count,
            args.nproc_per_node,
        )
        print(f"started {arn}")
    elif cmd == "sweep":
        p = planned
        if p.strategy == "tuning":
            arn = tuning.submit_tuning(aws, outputs, p, args.image_tag)
            print(
                f"started tuning job {arn} ({p.tuning_strategy}, {len(p.trials)} trials, {p.max_parallel} at a "
                f"time, objective {p.metric} {p.mode})"
            )
        else:
            got = sweep.submit_jobs(aws, outputs, p, args.image_tag, args.retry_failed)
            for arn in got["started"]:
                print(f"started {arn}")
            print(
                f"sweep {p.name}: {got['running']} running, {got['done']} finished, {got['left']} not started "
                f"(at most {p.max_parallel} at a time)"
                + ("; rerun this command to start the next ones as trials finish" if got["left"] else "")
            )
        print(sweep_plan.cost_line(p))
        print(f"results: python -m infra --env {aws.env} sweep-status --name {p.name}")
    elif cmd == "sweep-status":
        from trainer.config.sweep import results_markdown, write_results

        got = sweep.gather(aws, args.name)
        out = Path(args.out or REPO / "runs" / "sweeps" / args.name)
        try:
            paths = write_results(got["rows"], got["names"], got["metric"], got["mode"], out)
        except OSError as e:
            raise CliError(f"--out {out}: cannot write the results ({e})") from None
        print(results_markdown(got["rows"], got["names"], got["metric"], got["mode"]), end="")
        print(f"{got['strategy']} sweep {args.name}: {len(got['rows'])} trials; {paths['md']}, {paths['png']}")
    elif cmd == "status":
        job = _ec2_job(aws, outputs, args.target)
        if job is not None:
            info = ec2_jobs.status(aws, outputs, job)
            if args.json:
                print(json.dumps(info, indent=1, default=str))
            else:
                ec2_jobs.print_status(info, _print_table)
            return 0
        if args.target:
            if args.target.startswith("i-"):
                found = [i for i in instances.list_instances(aws) if i["instance_id"] == args.target]
                if not found:
                    raise CliError(f"{args.target} is not a live instance of environment {aws.env}")
                info = found[0]
            elif args.target.startswith("arn:") and ":execution:" in args.target:
                info = jobs.describe_execution(aws, args.target)
            else:
                info = jobs.describe_job(aws, args.target)
            print(json.dumps(info, indent=1, default=str))
            return 0
        state = {
            "instances": instances.list_instances(aws),
            "ec2_jobs": ec2_jobs.overview(aws, outputs),
            **jobs.list_runs(aws, outputs),
        }
        state["recovery_failures"] = ec2_jobs.failure_queue_depth(outputs, aws.client("sqs"))
        if args.json:
            print(json.dumps(state, indent=1, default=str))
            return 0
        for key, cols in (
            ("instances", ["instance_id", "type", "market", "state", "job", "launch_time"]),
            ("ec2_jobs", ["job", "state", "spend_usd", "reason"]),
            ("executions", ["machine", "name", "status", "start"]),
            ("jobs", ["name", "status", "start"]),
        ):
            print(f"{key.replace('_', ' ')}:")
            _print_table(state[key], cols)
        line = ec2_jobs.failure_queue_line(outputs, state["recovery_failures"])
        if line:
            print(line)
    elif cmd == "logs":
        try:
            streams = None
            if _ec2_job(aws, outputs, args.target) is not None:  # every attempt's stream, new ones as they come

                def streams() -> list[str]:
                    record = ec2_jobs.load(aws, outputs, args.target).record
                    return [ec2_jobs.stream_name(a["instance_id"], args.target) for a in record["attempts"]]

            for line in logs.tail(aws, outputs, args.target, args.lines, args.follow, streams=streams):
                print(line, flush=args.follow)
        except KeyboardInterrupt:  # the way to end --follow
            return 0
    elif cmd == "stop":
        if _ec2_job(aws, outputs, args.target) is not None:
            print(ec2_jobs.stop(aws, outputs, args.target))
        elif args.target.startswith("i-"):
            print(f"{instances.stop_instance(aws, args.target, outputs=outputs)} {args.target}")
        else:
            print(tuning.stop_tuning_job(aws, args.target) or jobs.stop_run(aws, args.target))
    elif cmd == "teardown":
        if not (outputs.bucket or outputs.alarm_topic_arn or outputs.repository_uri):
            print(f"no stack of environment {aws.env} is deployed: looking for what its tags still name")
        found = instances.sweep(aws, outputs, apply=args.yes)
        found["executions"] = jobs.stop_running_executions(aws, outputs, apply=args.yes)
        found["tuning_jobs"] = tuning.stop_tuning_jobs(aws, apply=args.yes)
        verb = "removed" if args.yes else "would remove (run again with --yes)"
        for key, items in found.items():
            print(f"{verb} {len(items)} {key.replace('_', ' ')}: {' '.join(items) or '-'}")
        if args.yes and args.wait:
            instances.wait_until_released(aws, outputs, found["instances"])
            print("released: the instances are terminated and the data volume is detached")
        print(
            f"kept: data volume {outputs.volume_id or '(unknown: no DataStack outputs)'}, bucket "
            f"{outputs.bucket or '(unknown)'} (cdk destroy DataStack never runs here)"
        )
    elif cmd == "cost":
        est = costs.estimate(aws)
        if args.json:
            print(json.dumps(est, indent=1, default=str))
            return 0
        rows = [
            {
                **r,
                "hours": f"{r['hours']:.2f}",
                "usd_per_hour": r["usd_per_hour"] or "?",
                "usd": f"{r['usd']:.2f}" if r["usd"] is not None else "?",
            }
            for r in est["rows"]
        ]
        _print_table(rows, ["what", "type", "market", "hours", "usd_per_hour", "usd", "price_source"])
        print(f"total so far: ${est['total_usd']:.2f} (estimate at {est['at']})")
    return 0


def _error(message: object) -> None:
    print("error: " + " ".join(str(message).split()), file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit code (0; 2 bad input or AWS refusal; 75 capacity, spot or network errors).

    ``--env`` (or TRAINSTACK_ENV) is checked against the stacks' rule (infra.config.ENV_RE) before any AWS call.
    """
    args = build_parser(__doc__).parse_args(argv)
    source = "--env" if args.env is not None else "TRAINSTACK_ENV"
    args.env = args.env if args.env is not None else os.environ.get("TRAINSTACK_ENV") or "dev"
    if not ENV_RE.match(args.env):
        _error(f"{source} {args.env!r}: expected {ENV_RULE} (the rule of `cdk deploy -c env=...`)")
        return 2
    try:
        return run(args)
    except CliError as e:
        _error(e)
        return e.code
    except CatalogError as e:
        _error(e)
        return 2
    except NETWORK_ERRORS as e:
        err = unreachable(e, args.region)
        _error(err)
        return err.code
    except BotoCoreError as e:  # anything else botocore raises before a request gets an answer
        _error(f"AWS client ({type(e).__name__}): {e}")
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
