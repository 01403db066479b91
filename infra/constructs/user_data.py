"""User data of the training instances: one bash script, rendered per instance type.

What it does at boot, in order (each step logged to /var/log/trainstack-user-data.log):

1. IMDSv2 token; instance id, region, lifecycle (spot/on-demand) and the job's instance tags
   (``trainstack:job``, ``trainstack:config``, ``trainstack:image-tag``, ``trainstack:args``; the launch
   templates turn on instance-metadata tags).
2. Attach the data volume by *volume id* and find it through its NVMe by-id link
   (``/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol...``, EC2 user guide "Amazon EBS and NVMe"), never
   by guessing ``/dev/nvme1n1`` as seed 003 does; format it only if it has no file system; mount at /data.
   A volume still held by a reclaimed spot instance is retried for up to 10 minutes.
3. Mount FSx for Lustre at /fsx when the data stack has one.
4. CloudWatch agent with NVIDIA GPU, memory and disk metrics (``cloudwatch_agent.agent_config``) and this
   instance's own "GPU idle -> stop/terminate" alarm.
5. Log in to ECR, write ``/etc/trainstack.env`` and a systemd unit running the training container with
   the image's ``train`` entrypoint and ``TRAINSTACK_NPROC_PER_NODE=<GPUs from the catalog>``.
   ``Restart=on-failure`` with ``RestartPreventExitStatus=2 3``: a run that stopped with a durable checkpoint
   (the entrypoint's exit 75) is restarted and resumes; a bad config (2) is not retried. On success the instance shuts itself down
   (terminates: ``InstanceInitiatedShutdownBehavior=terminate``) unless tagged ``trainstack:keep=true``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from infra.constructs import cloudwatch_agent as agent

CONTAINER_CHECKPOINTS = "/data/checkpoints"
CONTAINER_RUNS = "/data/runs"


@dataclass(frozen=True)
class UserDataParams:
    """Values baked into one launch template's user data (CDK tokens are fine in the str fields)."""

    env: str
    volume_id: str
    repository_uri: str
    train_log_group: str
    idle_alarm_command: str
    nproc_per_node: int
    efa: bool
    default_config: str
    default_image_tag: str
    fsx_dns_name: Optional[str] = None
    fsx_mount_name: Optional[str] = None


_HEAD = r"""set -euo pipefail
exec >>/var/log/trainstack-user-data.log 2>&1
echo "trainstack user data: start $(date -Is)"
IMDS=http://169.254.169.254/latest
TOKEN=$(curl -sS -X PUT "$IMDS/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 21600")
md() { curl -sSf -H "X-aws-ec2-metadata-token: $TOKEN" "$IMDS/meta-data/$1"; }
tag() { curl -sf -H "X-aws-ec2-metadata-token: $TOKEN" "$IMDS/meta-data/tags/instance/$1" || true; }
IID=$(md instance-id); REGION=$(md placement/region); LIFECYCLE=$(md instance-life-cycle)
export AWS_DEFAULT_REGION="$REGION"
"""

_VOLUME = r"""# --- data volume, by id ---
DEV="/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_${VOL//-/}"
for i in $(seq 1 60); do
  HOLDER=$(aws ec2 describe-volumes --volume-ids "$VOL" --query 'Volumes[0].Attachments[0].InstanceId' --output text)
  [ "$HOLDER" = "$IID" ] && break
  if [ "$HOLDER" = "None" ]; then aws ec2 attach-volume --volume-id "$VOL" --instance-id "$IID" --device /dev/sdf || true; fi
  sleep 10
done
for i in $(seq 1 60); do [ -e "$DEV" ] && break; sleep 5; done
[ -e "$DEV" ] || { echo "data volume $VOL never appeared at $DEV"; exit 1; }
blkid "$DEV" >/dev/null || mkfs.ext4 -q -L trainstack-data "$DEV"
mkdir -p /data && mountpoint -q /data || mount -o noatime "$DEV" /data
grep -q "$DEV" /etc/fstab || echo "$DEV /data ext4 defaults,noatime,nofail 0 2" >> /etc/fstab
mkdir -p {ckpt} {runs}
"""

_FSX = r"""# --- FSx for Lustre ---
if ! command -v mount.lustre >/dev/null; then
  apt-get update -q && apt-get install -y -q "lustre-client-modules-$(uname -r)" || apt-get install -y -q lustre-client-modules-aws
fi
mkdir -p /fsx && mountpoint -q /fsx || mount -t lustre -o relatime,flock "{dns}@tcp:/{mount}" /fsx
"""

_AGENT = r"""# --- CloudWatch agent (GPU, memory, disk; metrics.jsonl) ---
CWA=/opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl
if [ ! -x "$CWA" ]; then
  curl -sSfo /tmp/cwa.deb https://s3.amazonaws.com/amazoncloudwatch-agent/ubuntu/amd64/latest/amazon-cloudwatch-agent.deb
  dpkg -i /tmp/cwa.deb
fi
mkdir -p /opt/aws/amazon-cloudwatch-agent/etc
cat > /opt/aws/amazon-cloudwatch-agent/etc/trainstack.json <<'CWA_EOF'
{agent_config}
CWA_EOF
"$CWA" -a fetch-config -m ec2 -s -c file:/opt/aws/amazon-cloudwatch-agent/etc/trainstack.json
"""

_SERVICE = r"""# --- training container under systemd ---
REPO="{repo}"
JOB=$(tag trainstack:job); CONFIG=$(tag trainstack:config); IMAGE_TAG=$(tag trainstack:image-tag)
cat > /etc/trainstack.env <<ENV_EOF
IMAGE=$REPO:${IMAGE_TAG:-{image_tag}}
JOB=${JOB:-default}
CONFIG=${CONFIG:-{config}}
ARGS="$(tag trainstack:args)"
NPROC={nproc}
EFA={efa}
REGION=$REGION
IID=$IID
LOG_GROUP={log_group}
KEEP=$(tag trainstack:keep)
ENV_EOF
aws ecr get-login-password | docker login --username AWS --password-stdin "${REPO%%/*}"
cat > /usr/local/bin/trainstack-run <<'RUN_EOF'
#!/bin/bash
# One attempt of the job through the image's `train` entrypoint (docs/training-image.md): it starts torchrun
# with NPROC ranks and exits 75 when the run stopped with a durable checkpoint (systemd then starts us again
# and the trainer resumes), 2 for a bad config, 0 when done (the model goes to /data/runs/$JOB/model).
set -u
. /etc/trainstack.env
mkdir -p {ckpt}/"$JOB" {runs}/"$JOB"
DEVICES=""
if [ "$EFA" = 1 ]; then for d in /dev/infiniband/uverbs*; do DEVICES="$DEVICES --device=$d"; done; fi
docker pull "$IMAGE" || echo "pull failed; using the local copy of $IMAGE if any"
docker rm -f "trainstack-$JOB" 2>/dev/null || true
# shellcheck disable=SC2086
exec docker run --rm --name "trainstack-$JOB" --gpus all --ipc=host --network host $DEVICES \
  --ulimit memlock=-1 --ulimit stack=67108864 -v /data:/data -v /fsx:/fsx \
  -e TRAINSTACK_NPROC_PER_NODE="$NPROC" -e TRAINSTACK_SM_ROOT={runs}/"$JOB" \
  --log-driver awslogs --log-opt awslogs-region="$REGION" --log-opt awslogs-group="$LOG_GROUP" \
  --log-opt awslogs-stream="$IID/$JOB" "$IMAGE" \
  train --config "$CONFIG" --checkpoint-dir {ckpt}/"$JOB" --log-dir {runs}/"$JOB" $ARGS
RUN_EOF
cat > /usr/local/bin/trainstack-done <<'DONE_EOF'
#!/bin/bash
. /etc/trainstack.env
if [ "$SERVICE_RESULT" = success ] && [ "$KEEP" != true ]; then shutdown -h +1 "trainstack: job $JOB done"; fi
DONE_EOF
chmod +x /usr/local/bin/trainstack-run /usr/local/bin/trainstack-done
cat > /etc/systemd/system/trainstack-train.service <<'UNIT_EOF'
[Unit]
Description=Trainstack training container (resumes from its checkpoint after exit 75)
After=docker.service network-online.target
Requires=docker.service
StartLimitIntervalSec=0

[Service]
Type=simple
EnvironmentFile=/etc/trainstack.env
ExecStart=/usr/local/bin/trainstack-run
ExecStop=/usr/bin/docker stop -t 110 trainstack-${JOB}
Restart=on-failure
RestartSec=15
RestartPreventExitStatus=2 3
KillSignal=SIGTERM
TimeoutStopSec=120
ExecStopPost=/usr/local/bin/trainstack-done

[Install]
WantedBy=multi-user.target
UNIT_EOF
systemctl daemon-reload
systemctl enable --now trainstack-train.service
echo "trainstack user data: done $(date -Is)"
"""


def render(p: UserDataParams) -> str:
    """The whole user-data script (without the ``#!/bin/bash`` line, which CDK's UserData adds)."""
    parts = [_HEAD, f'VOL="{p.volume_id}"\n',
             _VOLUME.replace("{ckpt}", CONTAINER_CHECKPOINTS).replace("{runs}", CONTAINER_RUNS)]
    if p.fsx_dns_name:
        parts.append(_FSX.replace("{dns}", p.fsx_dns_name).replace("{mount}", p.fsx_mount_name or ""))
    parts.append(_AGENT.replace("{agent_config}", agent.agent_config(p.env)))
    parts.append(p.idle_alarm_command)
    service = (_SERVICE.replace("{repo}", p.repository_uri).replace("{image_tag}", p.default_image_tag)
               .replace("{config}", p.default_config).replace("{nproc}", str(p.nproc_per_node))
               .replace("{efa}", "1" if p.efa else "0").replace("{log_group}", p.train_log_group)
               .replace("{ckpt}", CONTAINER_CHECKPOINTS).replace("{runs}", CONTAINER_RUNS))
    parts.append(service)
    return "".join(parts)
