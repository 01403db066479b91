"""MonitoringStack: SNS topic, alarms, EventBridge rules, log groups and the dashboard of one environment.

Alarm thresholds come from the seeds: GPU utilization < 50 % for 15 minutes is seed 002's data-bottleneck
symptom; host memory above 80 % is seed 001's limit; the rest (GPU idle < 5 % for 30 minutes, disk > 85 %,
estimated charges over a budget) stop money leaking, seed 003's "CRITICAL: stop billing". The per-instance
"GPU idle -> stop/terminate" alarm needs the instance id, so each instance creates it for itself at boot
(:func:`instance_idle_alarm_command`, called from the launch templates' user data).
"""

from __future__ import annotations

import shlex

import aws_cdk as cdk
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subs
from constructs import Construct

from catalog.metrics import headline_metrics
from infra.config import InfraConfig
from infra.constructs import cloudwatch_agent as agent

EC2_EVENTS = ("EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation")
#: Metrics filtered from EC2 runs' metric logs and graphed: each task's headline metric, train_loss, images_per_s.
TRAINING_METRICS = headline_metrics()


def idle_alarm_name(cfg: InfraConfig) -> str:
    """Name prefix of the per-instance idle alarms (``<prefix>-gpu-idle-<instance-id>``)."""
    return f"{cfg.prefix}-gpu-idle"


def instance_idle_alarm_command(cfg: InfraConfig, topic_arn: str) -> str:
    """Shell commands (for user data) creating this instance's "GPU idle -> stop" alarm.

    Expects ``$IID`` (instance id), ``$REGION``, ``$LIFECYCLE`` (IMDS ``instance-life-cycle``) and ``$KEEP``
    (the ``trainstack:keep`` tag) in the shell. One-time spot instances cannot be stopped, so they are
    terminated; data lives on EBS/S3. A kept instance (``KEEP=true``) gets an alarm that only notifies the
    topic: it is never stopped or terminated by it.
    """
    minutes = cfg.gpu_idle_minutes
    return (
        'ACTIONS=("arn:aws:automate:$REGION:ec2:stop" ' + shlex.quote(topic_arn) + ")\n"
        'if [ "$LIFECYCLE" = spot ]; then ACTIONS[0]="arn:aws:automate:$REGION:ec2:terminate"; fi\n'
        'if [ "${KEEP:-}" = true ]; then ACTIONS=(' + shlex.quote(topic_arn) + "); fi\n"
        f'aws cloudwatch put-metric-alarm --region "$REGION" --alarm-name "{idle_alarm_name(cfg)}-$IID" '
        f"--namespace {shlex.quote(agent.namespace(cfg.env))} --metric-name {agent.GPU_UTIL} "
        '--dimensions Name=InstanceId,Value="$IID" --statistic Average --period 60 '
        f"--evaluation-periods {minutes} --datapoints-to-alarm {minutes} --threshold {cfg.gpu_idle_percent} "
        "--comparison-operator LessThanThreshold --treat-missing-data breaching "
        '--alarm-actions "${ACTIONS[@]}"\n'
    )


def function_failure_alarm(scope: Construct, cid: str, function, topic: sns.ITopic, name: str) -> cw.Alarm:
    """An alarm on ``function``'s ``Errors + Throttles`` (Lambda metrics, sum over 5 minutes; AWS Lambda developer
    guide, "Types of metrics for Lambda functions") >= 1, notifying ``topic`` when it goes to ALARM and back to
    OK: an invocation that failed or was throttled is never silent. Missing data (no invocation) is OK."""
    period = cdk.Duration.minutes(5)
    expr = cw.MathExpression(
        expression="errors + throttles",
        using_metrics={
            "errors": function.metric_errors(period=period, statistic="Sum"),
            "throttles": function.metric_throttles(period=period, statistic="Sum"),
        },
        label="errors + throttles",
        period=period,
    )
    alarm = cw.Alarm(
        scope,
        cid,
        alarm_name=name,
        metric=expr,
        threshold=1,
        evaluation_periods=1,
        datapoints_to_alarm=1,
        comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
        treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        alarm_description=f"{name}: the function failed or was throttled (its failed events: the on-failure queue)",
    )
    alarm.add_alarm_action(cw_actions.SnsAction(topic))
    alarm.add_ok_action(cw_actions.SnsAction(topic))
    return alarm


def queue_depth_alarm(scope: Construct, cid: str, queue, topic: sns.ITopic, name: str) -> cw.Alarm:
    """An alarm on ``queue``'s ``ApproximateNumberOfMessagesVisible`` (maximum over 5 minutes) > 0, notifying
    ``topic`` when it goes to ALARM and back to OK: a failed event waiting in a dead-letter queue is never silent,
    and the alarm stays in ALARM until someone reads and deletes it (Amazon SQS developer guide, "Available
    CloudWatch metrics for Amazon SQS"; SQS sends them every 5 minutes while the queue is active, and a queue
    with nothing in it for 6 hours goes inactive: missing data is OK)."""
    alarm = cw.Alarm(
        scope,
        cid,
        alarm_name=name,
        metric=queue.metric_approximate_number_of_messages_visible(period=cdk.Duration.minutes(5), statistic="Maximum"),
        threshold=0,
        evaluation_periods=1,
        datapoints_to_alarm=1,
        comparison_operator=cw.ComparisonOperator.GREATER_THAN_THRESHOLD,
        treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        alarm_description=f"{name}: events the recovery could not handle wait in its failure queue "
        "(`python -m infra status` counts them)",
    )
    alarm.add_alarm_action(cw_actions.SnsAction(topic))
    alarm.add_ok_action(cw_actions.SnsAction(topic))
    return alarm


def job_name_patterns(cfg: InfraConfig) -> list[dict]:
    """EventBridge patterns matching the names of this environment's training jobs and no other's: one
    ``prefix`` per job phase, ``<prefix>-<phase>-`` (job names are ``<prefix>-<phase>-<8 hex>``). A bare
    ``trainstack-dev`` prefix also matched every job of an environment ``dev-x``. EventBridge user guide,
    "Content filtering in Amazon EventBridge event patterns" (prefix matching)."""
    return [{"prefix": f"{cfg.prefix}-{phase}-"} for phase in dict.fromkeys(cfg.job_phases())]


class MonitoringStack(cdk.Stack):
    """Attributes: ``topic``, ``train_log_group``, ``metrics_log_group``, ``alarms`` (name -> Alarm)."""

    def __init__(self, scope: Construct, cid: str, *, config: InfraConfig, **kwargs) -> None:
        super().__init__(scope, cid, **kwargs)
        cfg = self.cfg = config
        key = kms.Key(
            self,
            "TopicKey",
            enable_key_rotation=True,
            removal_policy=cdk.RemovalPolicy.DESTROY,
            description=f"{cfg.prefix} alarm topic",
        )
        for svc in ("events.amazonaws.com", "cloudwatch.amazonaws.com"):
            key.grant_encrypt_decrypt(iam.ServicePrincipal(svc))
        self.topic = sns.Topic(
            self, "Alarms", display_name=f"{cfg.prefix} training alarms", master_key=key, enforce_ssl=True
        )
        if cfg.alarm_email:
            self.topic.add_subscription(subs.EmailSubscription(cfg.alarm_email))

        # Not KMS-encrypted with a key of ours (decision): CloudWatch Logs encrypts every log group at rest with
        # service-owned keys; the training logs hold loss lines and paths, no secrets. A customer key would cost
        # $1/month per environment plus requests and a key policy for logs.<region>.amazonaws.com.
        self.train_log_group = logs.LogGroup(
            self,
            "TrainLogs",
            log_group_name=agent.log_group_name(cfg.env, agent.TRAIN_LOG_GROUP),
            retention=logs.RetentionDays.THREE_MONTHS,
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )
        self.metrics_log_group = logs.LogGroup(
            self,
            "MetricsLogs",
            log_group_name=agent.log_group_name(cfg.env, agent.METRICS_LOG_GROUP),
            retention=logs.RetentionDays.THREE_MONTHS,
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )
        for name in TRAINING_METRICS:
            self.metrics_log_group.add_metric_filter(
                f"Filter-{name}",
                metric_namespace=agent.namespace(cfg.env),
                metric_name=name,
                filter_pattern=logs.FilterPattern.exists(f"$.{name}"),
                metric_value=f"$.{name}",
            )

        self.alarms: dict[str, cw.Alarm] = {}
        self._alarms(cfg)
        self._rules(cfg)
        self._dashboard(cfg)
        cdk.CfnOutput(self, "AlarmTopicArn", value=self.topic.topic_arn)
        cdk.CfnOutput(self, "TrainLogGroup", value=self.train_log_group.log_group_name)

    def _metric(self, name: str, stat: str, minutes: int = 1) -> cw.Metric:
        return cw.Metric(
            namespace=agent.namespace(self.cfg.env),
            metric_name=name,
            statistic=stat,
            period=cdk.Duration.minutes(minutes),
        )

    def _alarm(
        self, cid: str, metric: cw.IMetric, threshold: float, periods: int, op: cw.ComparisonOperator, description: str
    ) -> None:
        alarm = cw.Alarm(
            self,
            cid,
            alarm_name=f"{self.cfg.prefix}-{cid}",
            metric=metric,
            threshold=threshold,
            evaluation_periods=periods,
            datapoints_to_alarm=periods,
            comparison_operator=op,
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
            alarm_description=description,
        )
        alarm.add_alarm_action(cw_actions.SnsAction(self.topic))
        self.alarms[cid] = alarm

    def _alarms(self, cfg: InfraConfig) -> None:
        lt, gt = cw.ComparisonOperator.LESS_THAN_THRESHOLD, cw.ComparisonOperator.GREATER_THAN_THRESHOLD
        self._alarm(
            "gpu-low-utilization",
            self._metric(agent.GPU_UTIL, "Average"),
            cfg.gpu_low_util_percent,
            cfg.gpu_low_util_minutes,
            lt,
            f"GPU utilization < {cfg.gpu_low_util_percent:g} % for {cfg.gpu_low_util_minutes} min: the "
            "GPUs wait on data (seed 002). Raise --workers, use FFCV or FSx.",
        )
        self._alarm(
            "gpu-idle",
            self._metric(agent.GPU_UTIL, "Maximum"),
            cfg.gpu_idle_percent,
            cfg.gpu_idle_minutes,
            lt,
            f"Every GPU of {cfg.env} < {cfg.gpu_idle_percent:g} % for {cfg.gpu_idle_minutes} min; each "
            "instance also stops itself through its own alarm.",
        )
        self._alarm(
            "host-memory-high",
            self._metric(agent.HOST_MEM, "Maximum"),
            cfg.host_memory_percent,
            5,
            gt,
            f"Host memory > {cfg.host_memory_percent:g} % (seed 001): lower --workers/--prefetch-factor.",
        )
        self._alarm(
            "disk-high",
            self._metric(agent.DISK, "Maximum"),
            cfg.disk_percent,
            5,
            gt,
            f"A disk (data volume or root) is > {cfg.disk_percent:g} % full: prune checkpoints.",
        )
        if cfg.region and cfg.region != "us-east-1":
            cdk.Annotations.of(self).add_warning_v2(
                "trainstack:billing-alarm",
                f"No estimated-charges alarm: billing metrics exist only in us-east-1 "
                f"and an alarm cannot watch another region ({cfg.region}); deploy a us-east-1 environment for it.",
            )
            return
        charges = cw.Metric(
            namespace="AWS/Billing",
            metric_name="EstimatedCharges",
            statistic="Maximum",
            dimensions_map={"Currency": "USD"},
            period=cdk.Duration.hours(6),
        )
        self._alarm(
            "estimated-charges",
            charges,
            cfg.budget_usd,
            1,
            gt,
            f"Estimated charges this month > ${cfg.budget_usd:g} (billing metrics live in us-east-1 and "
            "need 'Receive Billing Alerts' turned on).",
        )

    def _rules(self, cfg: InfraConfig) -> None:
        target = targets.SnsTopic(self.topic)
        events.Rule(
            self,
            "SpotEvents",
            description="Spot interruption warnings and rebalance recommendations",
            event_pattern=events.EventPattern(source=["aws.ec2"], detail_type=list(EC2_EVENTS)),
            targets=[target],
        )
        events.Rule(
            self,
            "SageMakerJobEvents",
            description=f"{cfg.prefix} SageMaker jobs that failed or stopped",
            event_pattern=events.EventPattern(
                source=["aws.sagemaker"],
                detail_type=["SageMaker Training Job State Change"],
                detail={"TrainingJobStatus": ["Failed", "Stopped"], "TrainingJobName": job_name_patterns(cfg)},
            ),
            targets=[target],
        )

    def _dashboard(self, cfg: InfraConfig) -> None:
        ns = agent.namespace(cfg.env)

        def per_instance(metric: str) -> cw.MathExpression:
            return cw.MathExpression(
                expression=f"SEARCH('{{{ns},InstanceId}} MetricName=\"{metric}\"', 'Average', 60)",
                label="",
                period=cdk.Duration.minutes(1),
            )

        def sagemaker(metric: str) -> cw.MathExpression:
            return cw.MathExpression(
                expression=f'SEARCH(\'{{/aws/sagemaker/TrainingJobs,TrainingJobName}} MetricName="{metric}" '
                f"{cfg.prefix}', 'Average', 300)",
                label=f"SageMaker {metric}",
                period=cdk.Duration.minutes(5),
            )

        dash = cw.Dashboard(self, "Dashboard", dashboard_name=f"{cfg.prefix}-training")
        dash.add_widgets(
            cw.GraphWidget(title="GPU utilization (%)", left=[per_instance(agent.GPU_UTIL)], width=12),
            cw.GraphWidget(title="GPU memory used (MiB)", left=[per_instance(agent.GPU_MEM_USED)], width=12),
        )
        dash.add_widgets(
            cw.GraphWidget(title="Host memory used (%)", left=[per_instance(agent.HOST_MEM)], width=12),
            cw.GraphWidget(title="Disk used (%)", left=[self._metric(agent.DISK, "Maximum")], width=12),
        )
        for name in TRAINING_METRICS:
            dash.add_widgets(
                cw.GraphWidget(
                    title=f"{name} (EC2 runs / SageMaker jobs)",
                    width=24,
                    left=[self._metric(name, "Average", 5), sagemaker(name)],
                )
            )
        dash.add_widgets(cw.AlarmStatusWidget(alarms=list(self.alarms.values()), title="Alarms", width=24))
