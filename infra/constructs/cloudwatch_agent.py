"""The CloudWatch agent configuration of the training instances, and the metric names alarms are built on.

One place for both, so an alarm can never watch a metric the agent does not publish. Metric names are the
agent's own (CloudWatch agent docs, "Collect NVIDIA GPU metrics": ``nvidia_smi_utilization_gpu`` in percent,
``nvidia_smi_memory_used`` in MiB; "Metrics collected by the CloudWatch agent": ``mem_used_percent``,
``disk_used_percent``). Each metric is published per instance (dimension ``InstanceId``) and aggregated over
the whole environment (no dimensions), in the namespace ``Trainstack/<env>``.
"""

from __future__ import annotations

import json

GPU_UTIL = "nvidia_smi_utilization_gpu"
GPU_MEM_USED = "nvidia_smi_memory_used"
GPU_MEM_UTIL = "nvidia_smi_utilization_memory"
HOST_MEM = "mem_used_percent"
DISK = "disk_used_percent"
TRAIN_LOG_STREAM = "{instance_id}/train"
#: Log group of the container's stdout (``key=value`` epoch lines), relative to ``/trainstack/<env>/``.
TRAIN_LOG_GROUP = "train"
#: Log group of the trainer's ``metrics.jsonl`` files (JSON metric filters read it).
METRICS_LOG_GROUP = "metrics"


def namespace(env: str) -> str:
    """CloudWatch namespace of one environment's agent and training metrics."""
    return f"Trainstack/{env}"


def log_group_name(env: str, which: str) -> str:
    """``/trainstack/<env>/<which>`` for ``which`` in (TRAIN_LOG_GROUP, METRICS_LOG_GROUP)."""
    return f"/trainstack/{env}/{which}"


def agent_config(env: str, data_mount: str = "/data", metrics_glob: str = "/data/runs/**/metrics.jsonl") -> str:
    """The agent's JSON config (``amazon-cloudwatch-agent-ctl -a fetch-config -c file:...``).

    GPU metrics every 60 s; host memory and the data and root disks; the trainer's metrics files shipped to
    ``/trainstack/<env>/metrics``.
    """
    dims = {"InstanceId": "${aws:InstanceId}", "InstanceType": "${aws:InstanceType}"}
    cfg = {
        "agent": {"metrics_collection_interval": 60, "run_as_user": "root"},
        "metrics": {
            "namespace": namespace(env),
            "append_dimensions": dims,
            "aggregation_dimensions": [["InstanceId"], []],
            "metrics_collected": {
                "nvidia_gpu": {
                    "measurement": [
                        "utilization_gpu",
                        "utilization_memory",
                        "memory_used",
                        "memory_total",
                        "temperature_gpu",
                        "power_draw",
                    ]
                },
                "mem": {"measurement": ["mem_used_percent"]},
                "disk": {"measurement": ["used_percent"], "resources": [data_mount, "/"], "drop_device": True},
            },
        },
        "logs": {
            "logs_collected": {
                "files": {
                    "collect_list": [
                        {
                            "file_path": metrics_glob,
                            "log_group_name": log_group_name(env, METRICS_LOG_GROUP),
                            "log_stream_name": "{instance_id}",
                            "retention_in_days": 90,
                        },
                    ]
                }
            }
        },
    }
    return json.dumps(cfg, indent=1)
