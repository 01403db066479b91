"""CloudFormation handlers for the resource types our templates use that moto's CloudFormation lacks.

moto serves each of these types' APIs (PutMetricAlarm, PutMetricFilter, PutBucketPolicy, ...) but its
CloudFormation has no handler for them, so ``parse_resource`` in ``moto/cloudformation/parsing.py`` warns "not
supported" and the stack still ends CREATE_COMPLETE without the resource. Each class below is a
``CloudFormationModel`` (moto finds handlers as that class's direct subclasses: ``get_model_list``) whose create
and delete call the same moto backend method the API calls, with the template's properties mapped the way the
API's own request is: so the resource exists in the emulator, and the e2e checks read it back through the AWS
APIs like any other. A property a handler does not map is listed in :data:`UNMAPPED`; the checks do not
assert on those.

``AWS::CDK::Metadata`` gets no handler: it is the CDK's version report, which CloudFormation itself stores and
no API reads (``tests.e2e.resources.NOT_CREATED``).

Importing this module registers the handlers with moto for the whole process (moto finds them as subclasses), so
only the emulator's own process imports it (``tests/e2e/emulator_server.py``): in a pytest worker they would
change what moto's in-process CloudFormation does for the unit tests (tests/moto_env.py strips what moto lacks).
"""

from __future__ import annotations

import json
from typing import Any

from moto.core.common_models import CloudFormationModel

#: Properties present in our templates that a handler here does not pass on.
UNMAPPED = {"AWS::CloudWatch::Alarm": ("Tags",)}


def _policy(doc: Any) -> str:
    return doc if isinstance(doc, str) else json.dumps(doc)


class _Handler:
    """Shared plumbing; each handler also names ``CloudFormationModel`` among its bases (moto looks for that
    class's direct subclasses) and implements ``cloudformation_type``, ``create`` and ``delete``."""

    def __init__(self, physical_id: str, props: dict, account_id: str, region_name: str):
        self.physical_id, self.props, self.account_id, self.region_name = physical_id, props, account_id, region_name

    @property
    def physical_resource_id(self) -> str:
        return self.physical_id

    @staticmethod
    def cloudformation_name_type() -> str:
        return ""

    @classmethod
    def create_from_cloudformation_json(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs):
        props = cloudformation_json.get("Properties", {})
        physical_id = cls.create(props, account_id, region_name, kwargs.get("LogicalId", resource_name))
        return cls(physical_id, props, account_id, region_name)

    @classmethod
    def create(cls, props: dict, account_id: str, region_name: str, logical_id: str) -> str:
        raise NotImplementedError


class MetricAlarm(_Handler, CloudFormationModel):
    """``AWS::CloudWatch::Alarm`` -> ``CloudWatchBackend.put_metric_alarm`` (metric alarms, math included)."""

    @staticmethod
    def cloudformation_type() -> str:
        return "AWS::CloudWatch::Alarm"

    @classmethod
    def create(cls, props, account_id, region_name, logical_id):
        from moto.cloudwatch.models import Dimension, Metric, MetricDataQuery, MetricStat, cloudwatch_backends

        queries = None
        if props.get("Metrics"):
            queries = []
            for q in props["Metrics"]:
                stat = q.get("MetricStat")
                metric_stat = None
                if stat:
                    m = stat["Metric"]
                    dims = [Dimension(d["Name"], d["Value"]) for d in m.get("Dimensions", [])]
                    metric_stat = MetricStat(
                        Metric(m["MetricName"], m.get("Namespace"), dims),
                        str(stat["Period"]),
                        stat["Stat"],
                        stat.get("Unit"),
                    )
                queries.append(
                    MetricDataQuery(
                        q["Id"], q.get("Label"), q.get("Period"), q.get("ReturnData"), q.get("Expression"), metric_stat
                    )
                )
        name = props.get("AlarmName") or logical_id
        cloudwatch_backends[account_id][region_name].put_metric_alarm(
            name=name,
            namespace=props.get("Namespace"),
            metric_name=props.get("MetricName"),
            metric_data_queries=queries,
            comparison_operator=props["ComparisonOperator"],
            evaluation_periods=int(props["EvaluationPeriods"]),
            datapoints_to_alarm=props.get("DatapointsToAlarm"),
            period=props.get("Period"),
            threshold=float(props["Threshold"]),
            statistic=props.get("Statistic"),
            extended_statistic=props.get("ExtendedStatistic"),
            description=props.get("AlarmDescription"),
            dimensions=props.get("Dimensions", []),
            alarm_actions=props.get("AlarmActions", []),
            ok_actions=props.get("OKActions", []),
            insufficient_data_actions=props.get("InsufficientDataActions", []),
            unit=props.get("Unit"),
            actions_enabled=props.get("ActionsEnabled", True),
            treat_missing_data=props.get("TreatMissingData"),
            evaluate_low_sample_count_percentile=props.get("EvaluateLowSampleCountPercentile"),
            threshold_metric_id=props.get("ThresholdMetricId"),
        )
        return name

    @classmethod
    def has_cfn_attr(cls, attr: str) -> bool:
        return attr == "Arn"

    def get_cfn_attribute(self, attribute_name: str) -> str:
        return f"arn:aws:cloudwatch:{self.region_name}:{self.account_id}:alarm:{self.physical_id}"

    def delete(self, account_id: str, region_name: str) -> None:
        from moto.cloudwatch.models import cloudwatch_backends

        cloudwatch_backends[account_id][region_name].delete_alarms([self.physical_id])


class MetricFilter(_Handler, CloudFormationModel):
    """``AWS::Logs::MetricFilter`` -> ``LogsBackend.put_metric_filter``."""

    @staticmethod
    def cloudformation_type() -> str:
        return "AWS::Logs::MetricFilter"

    @classmethod
    def create(cls, props, account_id, region_name, logical_id):
        from moto.logs.models import logs_backends

        name = props.get("FilterName") or logical_id
        transformations = [{k[0].lower() + k[1:]: v for k, v in t.items()} for t in props["MetricTransformations"]]
        logs_backends[account_id][region_name].put_metric_filter(
            name, props["FilterPattern"], props["LogGroupName"], transformations
        )
        return f"{props['LogGroupName']}|{name}"

    def delete(self, account_id: str, region_name: str) -> None:
        from moto.logs.models import logs_backends

        group, name = self.physical_id.split("|", 1)
        logs_backends[account_id][region_name].delete_metric_filter(name, group)


class BucketPolicy(_Handler, CloudFormationModel):
    """``AWS::S3::BucketPolicy`` -> ``S3Backend.put_bucket_policy``."""

    @staticmethod
    def cloudformation_type() -> str:
        return "AWS::S3::BucketPolicy"

    @classmethod
    def create(cls, props, account_id, region_name, logical_id):
        from moto.s3.models import s3_backends

        s3_backends[account_id]["aws"].put_bucket_policy(props["Bucket"], _policy(props["PolicyDocument"]).encode())
        return props["Bucket"]

    def delete(self, account_id: str, region_name: str) -> None:
        from moto.s3.models import s3_backends

        backend = s3_backends[account_id]["aws"]
        if self.physical_id in backend.buckets:  # not when the bucket went first
            backend.delete_bucket_policy(self.physical_id)


class TopicPolicy(_Handler, CloudFormationModel):
    """``AWS::SNS::TopicPolicy`` -> ``SNSBackend.set_topic_attribute(arn, "policy", ...)`` for each topic (the
    attribute name as SetTopicAttributes passes it, after ``camelcase_to_underscores``)."""

    @staticmethod
    def cloudformation_type() -> str:
        return "AWS::SNS::TopicPolicy"

    @classmethod
    def create(cls, props, account_id, region_name, logical_id):
        from moto.sns.models import sns_backends

        for arn in props["Topics"]:
            sns_backends[account_id][region_name].set_topic_attribute(arn, "policy", _policy(props["PolicyDocument"]))
        return logical_id

    def delete(self, account_id: str, region_name: str) -> None:
        pass  # AWS resets the topic's policy to its default; moto's topic goes with its own stack


class QueuePolicy(_Handler, CloudFormationModel):
    """``AWS::SQS::QueuePolicy`` -> ``SQSBackend.set_queue_attributes(name, {"Policy": ...})``."""

    @staticmethod
    def cloudformation_type() -> str:
        return "AWS::SQS::QueuePolicy"

    @classmethod
    def create(cls, props, account_id, region_name, logical_id):
        from moto.sqs.models import sqs_backends

        for url in props["Queues"]:
            sqs_backends[account_id][region_name].set_queue_attributes(
                url.rstrip("/").rsplit("/", 1)[-1], {"Policy": _policy(props["PolicyDocument"])}
            )
        return logical_id

    def delete(self, account_id: str, region_name: str) -> None:
        pass  # as TopicPolicy: the queue goes with its stack


class EventInvokeConfig(_Handler, CloudFormationModel):
    """``AWS::Lambda::EventInvokeConfig`` -> ``LambdaBackend.put_function_event_invoke_config``."""

    @staticmethod
    def cloudformation_type() -> str:
        return "AWS::Lambda::EventInvokeConfig"

    @classmethod
    def create(cls, props, account_id, region_name, logical_id):
        from moto.awslambda.models import lambda_backends

        config = {k: v for k, v in props.items() if k not in ("FunctionName", "Qualifier")}
        lambda_backends[account_id][region_name].put_function_event_invoke_config(props["FunctionName"], config)
        return props["FunctionName"]

    def delete(self, account_id: str, region_name: str) -> None:
        from moto.awslambda.models import lambda_backends

        try:
            lambda_backends[account_id][region_name].delete_function_event_invoke_config(self.physical_id)
        except Exception:  # the function went first in the same stack deletion
            pass


class SecurityGroupEgress(_Handler, CloudFormationModel):
    """``AWS::EC2::SecurityGroupEgress`` -> ``SecurityGroupBackend.authorize_security_group_egress``."""

    @staticmethod
    def cloudformation_type() -> str:
        return "AWS::EC2::SecurityGroupEgress"

    @classmethod
    def _rule(cls, props) -> dict:
        groups = [{"GroupId": props["DestinationSecurityGroupId"]}] if props.get("DestinationSecurityGroupId") else []
        ranges = [{"CidrIp": props["CidrIp"], "Description": props.get("Description")}] if props.get("CidrIp") else []
        return dict(
            group_name_or_id=props["GroupId"],
            ip_protocol=str(props["IpProtocol"]),
            from_port=props.get("FromPort"),
            to_port=props.get("ToPort"),
            ip_ranges=ranges,
            source_groups=groups,
        )

    @classmethod
    def create(cls, props, account_id, region_name, logical_id):
        from moto.ec2.models import ec2_backends

        ec2_backends[account_id][region_name].authorize_security_group_egress(**cls._rule(props))
        return logical_id

    def delete(self, account_id: str, region_name: str) -> None:
        from moto.ec2.models import ec2_backends

        try:
            ec2_backends[account_id][region_name].revoke_security_group_egress(**self._rule(self.props))
        except Exception:  # the group went first in the same stack deletion
            pass


class OIDCProvider(_Handler, CloudFormationModel):
    """``AWS::IAM::OIDCProvider`` -> ``IAMBackend.create_open_id_connect_provider`` (the CI stack's GitHub
    provider; Ref and GetAtt Arn are its ARN)."""

    @staticmethod
    def cloudformation_type() -> str:
        return "AWS::IAM::OIDCProvider"

    @classmethod
    def create(cls, props, account_id, region_name, logical_id):
        from moto.iam.models import iam_backends

        provider = iam_backends[account_id]["aws"].create_open_id_connect_provider(
            props["Url"], props.get("ThumbprintList", []), props.get("ClientIdList", []), props.get("Tags", [])
        )
        return provider.arn

    @classmethod
    def has_cfn_attr(cls, attr: str) -> bool:
        return attr == "Arn"

    def get_cfn_attribute(self, attribute_name: str) -> str:
        return self.physical_id

    def delete(self, account_id: str, region_name: str) -> None:
        from moto.iam.models import iam_backends

        iam_backends[account_id]["aws"].delete_open_id_connect_provider(self.physical_id)


class S3AutoDeleteObjects(_Handler):
    """``Custom::S3AutoDeleteObjects`` (aws-cdk-lib's ``autoDeleteObjects``: ephemeral environments' buckets): the
    CDK's provider is a Node.js Lambda function, and moto runs Lambda code only in Docker, which this machine
    lacks. This handler does what that function does on Delete (every object version and delete marker of the
    bucket removed, so CloudFormation can delete the bucket) and nothing on Create, as the function does. The
    function itself, its role and its asset are deployed and checked like any other resource; its code does not
    run. Not a ``CloudFormationModel``: moto routes every ``Custom::`` type to its ``CustomModel`` first, so
    :func:`route_custom_types` puts this one in front."""

    TYPE = "Custom::S3AutoDeleteObjects"

    @staticmethod
    def cloudformation_type() -> str:
        return S3AutoDeleteObjects.TYPE

    @classmethod
    def create(cls, props, account_id, region_name, logical_id):
        return f"{logical_id}-{props['BucketName']}"

    def delete(self, account_id: str, region_name: str) -> None:
        from moto.s3.models import s3_backends

        backend, bucket = s3_backends[account_id]["aws"], self.props["BucketName"]
        if bucket not in backend.buckets:
            return
        versions, _, markers, _, _ = backend.list_object_versions(bucket, max_keys=None)
        for item in [*versions, *markers]:
            backend.delete_object(bucket, item.name, version_id=item.version_id, bypass=True)


def route_custom_types() -> None:
    """Custom resource types handled here instead of moto's ``CustomModel`` (which would invoke the provider's
    Lambda function): ``resource_class_from_type`` in ``moto/cloudformation/parsing.py`` is wrapped."""
    from moto.cloudformation import parsing

    custom = {S3AutoDeleteObjects.TYPE: S3AutoDeleteObjects}
    resource_class_from_type = parsing.resource_class_from_type

    def with_custom(resource_type: str):
        return custom.get(resource_type) or resource_class_from_type(resource_type)

    parsing.resource_class_from_type = with_custom


HANDLED = tuple(c.cloudformation_type() for c in _Handler.__subclasses__())
