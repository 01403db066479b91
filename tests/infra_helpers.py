"""Helpers for the infra tests: synthesize the app offline and read what came out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import infra  # noqa: F401  (silences jsii's Node banner before anything imports aws_cdk)

REPO = Path(__file__).resolve().parents[1]


def synth(context: dict, outdir: Path):
    """Synthesize the whole app into ``outdir``; returns (config, {construct id: Template}, {id: template dict})."""
    from aws_cdk.assertions import Template

    from infra.app import build_app

    app, cfg, stacks = build_app(context, outdir=str(outdir))
    assembly = app.synth()
    templates = {cid: Template.from_stack(stack) for cid, stack in stacks.items()}
    raw = {cid: assembly.get_stack_by_name(stack.stack_name).template for cid, stack in stacks.items()}
    return cfg, templates, raw


def resources(template: dict, rtype: str) -> dict[str, dict]:
    """Logical id -> resource of one CloudFormation type."""
    return {k: v for k, v in template["Resources"].items() if v["Type"] == rtype}


def flatten(value: Any, token: str = "<TOKEN>") -> str:
    """A CloudFormation string value with every ``Fn::Join`` joined and every other token as ``token``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "Fn::Join" in value:
        sep, parts = value["Fn::Join"]
        return sep.join(flatten(p, token) for p in parts)
    if isinstance(value, dict) and "Fn::Base64" in value:
        return flatten(value["Fn::Base64"], token)
    return token


def state_machine_definitions(template: dict) -> dict[str, dict]:
    """StateMachineName -> parsed Amazon States Language (tokens replaced by ``<TOKEN>``)."""
    out = {}
    for res in resources(template, "AWS::StepFunctions::StateMachine").values():
        props = res["Properties"]
        out[props["StateMachineName"]] = json.loads(flatten(props["DefinitionString"]))
    return out
