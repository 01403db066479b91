"""The recovery function's deployed environment: :class:`Settings`, read from the environment variables that
infra/constructs/recovery.py sets on the Lambda function, and the two periods the deployment fixes (the tick,
:data:`TICK_S`; the grace before what EC2 has not confirmed decides, :data:`UNKNOWN_GRACE_S`). Separate from
:mod:`infra.recovery` (the decisions): the construct reads the tick from here, and the decisions take settings
from a test as from the function's environment.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

#: Seconds between two ticks of the recovery function (the EventBridge schedule, infra/constructs/recovery.py).
TICK_S = 120
#: Seconds during which what EC2 says of a new attempt (NotFound) or of an unexplained termination (no
#: StateReason, no warning) is not yet an answer. The EC2 developer guide ("Eventual consistency in the Amazon
#: EC2 API") has Describe calls retried with backoff "up to a few minutes".
UNKNOWN_GRACE_S = 300


@dataclass
class Settings:
    """The deployed environment, from the function's environment variables (infra/constructs/recovery.py).
    ``idle_alarm_prefix``: name prefix of the per-instance GPU-idle alarms (``<prefix><instance id>``,
    infra/stacks/monitoring.py). ``unknown_grace_s``: seconds (:data:`UNKNOWN_GRACE_S`; optional variable
    ``TRAINSTACK_UNKNOWN_GRACE_S``)."""

    env: str
    bucket: str
    topic_arn: str
    volume_id: str
    launch_templates: dict[str, str]  # instance type -> launch template id
    idle_alarm_prefix: str = ""
    unknown_grace_s: float = UNKNOWN_GRACE_S

    def __post_init__(self) -> None:
        self.idle_alarm_prefix = self.idle_alarm_prefix or f"trainstack-{self.env}-gpu-idle-"

    @classmethod
    def from_environ(cls, environ=os.environ) -> Settings:
        """Raises KeyError naming a missing ``TRAINSTACK_*`` variable."""
        return cls(
            env=environ["TRAINSTACK_ENV"],
            bucket=environ["TRAINSTACK_BUCKET"],
            topic_arn=environ["TRAINSTACK_TOPIC_ARN"],
            volume_id=environ["TRAINSTACK_VOLUME_ID"],
            launch_templates=json.loads(environ["TRAINSTACK_LAUNCH_TEMPLATES"]),
            idle_alarm_prefix=environ.get("TRAINSTACK_IDLE_ALARM_PREFIX", ""),
            unknown_grace_s=float(environ.get("TRAINSTACK_UNKNOWN_GRACE_S", UNKNOWN_GRACE_S)),
        )
